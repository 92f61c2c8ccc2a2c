"""One run per workdir: a lock held for the life of the process that trains there.

Two runs writing one workdir interleave their metrics and race each other's checkpoint saves
(orbax renames one run's temporary directory under the other). `hold(workdir)` takes an
exclusive `flock` on `workdir/.lock` and writes `pid host` into it; the kernel drops the lock
when the process ends, however it ends (a killed run leaves no stale lock: the file stays, its
lock does not). A second run finds the lock taken and is refused with the first one's pid and
host. Multi-process, process 0 holds it for the job (the others share its workdir).

Taking it again in the process that holds it is a no-op (tests check several configs on one
workdir in one process). A process runs one job at a time: taking the lock of another workdir
gives up the one it held (a test session checks hundreds of workdirs, one descriptor each).
"""

from __future__ import annotations

import errno
import fcntl
import os
import pathlib
import socket

from jaxrlhf.schema import ConfigError

LOCK_FILE = ".lock"

_held: dict[pathlib.Path, int] = {}  # this process's locks: workdir -> open descriptor


def make(workdir: pathlib.Path) -> None:
    """Creates `workdir` and its parents (there already: nothing to do).

    Raises:
      ConfigError: a file stands in its place (mkdir would say "[Errno 17] File exists").
      OSError: it cannot be created.
    """
    if workdir.exists() and not workdir.is_dir():
        raise ConfigError(f"workdir: {workdir} is a file, not a directory")
    workdir.mkdir(parents=True, exist_ok=True)


def hold(workdir: pathlib.Path) -> None:
    """Locks `workdir` for this process until it exits (or `release`).

    Raises:
      ConfigError: another live process holds it (`workdir: in use by pid N on HOST`).
    """
    workdir = workdir.resolve()
    if workdir in _held:
        return
    for other in list(_held):
        release(other)
    fd = os.open(workdir / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        holder = os.pread(fd, 256, 0).decode(errors="replace").split()
        os.close(fd)
        if e.errno not in (errno.EWOULDBLOCK, errno.EACCES):
            raise ConfigError(f"workdir: cannot lock {workdir / LOCK_FILE}: {e}") from None
        pid, host = (holder + ["?", "?"])[:2]
        raise ConfigError(f"workdir: in use by pid {pid} on {host} ({workdir} takes one run at "
                          "a time; wait for that one to end, or use another --workdir)") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()} {socket.gethostname()}\n".encode(), 0)
    _held[workdir] = fd


def release(workdir: pathlib.Path) -> None:
    """Gives up this process's lock on `workdir` (if it holds one)."""
    fd = _held.pop(workdir.resolve(), None)
    if fd is not None:
        os.close(fd)  # closing the descriptor drops the flock
