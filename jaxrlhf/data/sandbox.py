"""Running model-written Python in a sandboxed subprocess, for the `code` reward.

Each run gets a fresh throwaway directory (removed afterwards) holding the program; it runs as
`python -I -B` (no user site, no environment, no bytecode written) with stdin from the test case
and stdout to a file in that directory. What keeps it in:

  * resource limits (setrlimit, in the fresh interpreter before the program runs): CPU seconds (SIGXCPU), address space
    (MemoryError), file size (a huge output fails with EFBIG: Python ignores SIGXFSZ), open
    files, processes;
  * no network: a network namespace of its own (`unshare(CLONE_NEWNET)`, with a user namespace
    when unprivileged), so only a downed loopback exists;
  * a user of its own when the trainer runs as root: the program runs under a fresh uid that no
    other process has, so it cannot write the trainer's files, the process limit counts only its
    own processes, and every process left behind is killed by uid afterwards;
  * a Python audit hook installed before the program runs: process creation (fork, exec,
    subprocess, os.system), sockets, ctypes and writes outside the directory raise
    PermissionError (a second line where the OS-level ones are unavailable);
  * a wall-clock timeout after which the whole process group (and the uid's processes) is
    killed.

`probe()` reports which OS-level measures this machine allows; each run uses what it can.
A program that fails in any way returns a `RunStatus` other than OK; it never raises, hangs the
caller or outlives the call.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import functools
import os
import pathlib
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time

_CLONE_NEWNET, _CLONE_NEWUSER = 0x40000000, 0x10000000
# A uid range no account uses: each run picks a fresh one (as root), so killing "every process
# of this uid" afterwards can only hit the program's own leftovers.
_UID_BASE, _UID_SPAN = 3_100_000, 900_000
_PROGRAM = "main.py"
_STDOUT = "stdout.txt"
_STDERR = "stderr.txt"
_FAILED_SETUP = 97  # the child could not enter the sandbox: nothing of the program ran

# Run by `python -c` in the fresh interpreter that then runs the program (argv: the program,
# then `_enter_args`): it enters the sandbox (namespaces, limits, then the program's own uid;
# the order matters: the namespace needs privileges the uid drop removes) and installs the
# audit hook (see the module docstring). The trainer only execs it: nothing of the sandbox runs
# in a fork of the trainer's multi-threaded process.
_BOOTSTRAP = r'''
import os, sys

def _enter(netns, unshare_flags, uid, cpu, memory, files, processes, open_files):
    try:
        import ctypes, resource
        if netns and ctypes.CDLL(None, use_errno=True).unshare(unshare_flags) != 0:
            os._exit(%(failed)d)
        for kind, value in ((resource.RLIMIT_CPU, (cpu, cpu + 1)),
                            (resource.RLIMIT_AS, (memory, memory)),
                            (resource.RLIMIT_FSIZE, (files, files)),
                            (resource.RLIMIT_NOFILE, (open_files, open_files)),
                            (resource.RLIMIT_NPROC, (processes, processes)),
                            (resource.RLIMIT_CORE, (0, 0))):
            resource.setrlimit(kind, value)
        if uid >= 0:
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
    except Exception:  # any failure: refuse to run the program at all
        os._exit(%(failed)d)

_enter(*map(int, sys.argv[2:]))
del _enter
_root = os.path.realpath(os.getcwd())
_deny = {"os.system", "os.fork", "os.forkpty", "os.exec", "os.posix_spawn", "os.spawn",
         "subprocess.Popen", "socket.connect", "socket.bind", "socket.sendto",
         "socket.sendmsg", "socket.getaddrinfo", "ctypes.dlopen", "ctypes.dlsym",
         "ctypes.addressof", "ctypes.cdata", "os.kill", "os.killpg", "os.setuid", "os.chroot"}
_paths = {"os.remove": 1, "os.rename": 2, "os.replace": 2, "os.rmdir": 1, "os.mkdir": 1,
          "os.symlink": 2, "os.link": 2, "os.truncate": 1, "os.chmod": 1, "os.chown": 1,
          "os.utime": 1, "shutil.rmtree": 1, "shutil.copyfile": 2, "shutil.move": 2}
_write_flags = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC

def _inside(path):
    if isinstance(path, int):
        return True  # an already open descriptor
    path = os.path.realpath(os.fsdecode(path))
    return path == _root or path.startswith(_root + os.sep)

def _hook(event, args):
    if event in _deny:
        raise PermissionError(f"sandbox: {event} is not allowed")
    if event == "open":
        path, mode, flags = args
        writing = (isinstance(mode, str) and any(c in mode for c in "wax+")) or (
            isinstance(flags, int) and flags & _write_flags)
        if writing and path is not None and not _inside(path):
            raise PermissionError(f"sandbox: writing {path!r} outside the working directory")
    elif event in _paths:
        for path in args[:_paths[event]]:
            if path is not None and not _inside(path):
                raise PermissionError(f"sandbox: {event} on {path!r} outside the directory")

sys.addaudithook(_hook)
del _hook
import runpy
sys.argv = [sys.argv[1]]
runpy.run_path(sys.argv[0], run_name="__main__")
''' % {"failed": _FAILED_SETUP}


class RunStatus(enum.Enum):
    OK = "ok"  # exited with status 0
    ERROR = "error"  # raised or exited non-zero (a blocked escape raises PermissionError)
    TIMEOUT = "timeout"  # wall clock or CPU time limit
    MEMORY = "memory"  # address-space limit
    OUTPUT_LIMIT = "output_limit"  # wrote more than the file-size limit
    SETUP = "setup"  # the sandbox could not be entered (the program never ran)


@dataclasses.dataclass(frozen=True)
class Limits:
    """Resource limits of one run."""

    wall_seconds: float = 5.0
    cpu_seconds: int = 3
    memory_bytes: int = 512 * 2**20
    file_bytes: int = 1 * 2**20  # stdout, stderr and any file written
    processes: int = 8
    open_files: int = 64


@dataclasses.dataclass(frozen=True)
class RunResult:
    status: RunStatus
    stdout: str
    stderr: str
    seconds: float


@dataclasses.dataclass(frozen=True)
class Isolation:
    """What this machine allows (see `probe`)."""

    network_namespace: bool
    own_uid: bool  # running as root: the program gets a uid of its own
    interpreter: str  # a python the program's user can execute


def _world_executable(path: str) -> bool:
    """Whether any user can execute `path` (it and every parent directory are o+x)."""
    p = pathlib.Path(os.path.realpath(path))
    return all(os.stat(q).st_mode & 0o001 for q in [p, *p.parents])


def _interpreter(own_uid: bool) -> str:
    if not own_uid or _world_executable(sys.executable):
        return sys.executable
    for candidate in ("/usr/bin/python3", "/usr/local/bin/python3"):
        if os.path.exists(candidate) and _world_executable(candidate):
            return candidate
    raise RuntimeError("no python interpreter another user may run; cannot sandbox as root")


def _unshare_flags(own_uid: bool) -> int:
    return _CLONE_NEWNET | (0 if own_uid else _CLONE_NEWUSER)


@functools.lru_cache(maxsize=1)
def probe() -> Isolation:
    """Which OS-level isolation works here (tried once, in a throwaway interpreter)."""
    own_uid = os.geteuid() == 0
    tried = subprocess.run(
        [sys.executable, "-I", "-S", "-c", "import ctypes, sys; sys.exit(ctypes.CDLL(None)"
         ".unshare(int(sys.argv[1])) != 0)", str(_unshare_flags(own_uid))],
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return Isolation(network_namespace=tried.returncode == 0, own_uid=own_uid,
                     interpreter=_interpreter(own_uid))


def _enter_args(limits: Limits, isolation: Isolation, uid: int | None) -> list[str]:
    """The bootstrap's arguments: what `_enter` in `_BOOTSTRAP` sets up (uid -1: keep ours)."""
    values = (int(isolation.network_namespace), _unshare_flags(isolation.own_uid),
              -1 if uid is None else uid, max(1, int(limits.cpu_seconds)), limits.memory_bytes,
              limits.file_bytes, limits.processes, limits.open_files)
    return [str(v) for v in values]


def _kill_uid(uid: int) -> None:
    """SIGKILL every process of `uid` (the run's own uid: its leftovers, nothing else), from an
    interpreter that becomes that uid: as it, kill(-1) reaches only the uid's processes."""
    subprocess.run(
        [probe().interpreter, "-I", "-S", "-c", "import os, signal, sys\n"
         "uid = int(sys.argv[1]); os.setgroups([]); os.setgid(uid); os.setuid(uid)\n"
         "try:\n    os.kill(-1, signal.SIGKILL)\nexcept ProcessLookupError:\n    pass",
         str(uid)], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL)


def _status(returncode: int, stderr: str, timed_out: bool) -> RunStatus:
    if timed_out or returncode in (-signal.SIGXCPU, -signal.SIGKILL):
        return RunStatus.TIMEOUT
    if returncode == -signal.SIGXFSZ:
        return RunStatus.OUTPUT_LIMIT
    if returncode == _FAILED_SETUP:
        return RunStatus.SETUP
    if returncode != 0:
        if "MemoryError" in stderr:
            return RunStatus.MEMORY
        # Python ignores SIGXFSZ: a write past the file-size limit raises EFBIG instead.
        return RunStatus.OUTPUT_LIMIT if "[Errno 27] File too large" in stderr else RunStatus.ERROR
    return RunStatus.OK


def _read(path: pathlib.Path, limit: int) -> str:
    if not path.exists():
        return ""
    with path.open("rb") as f:
        return f.read(limit).decode("utf-8", errors="replace")


def run_python(code: str, stdin: str = "", limits: Limits = Limits()) -> RunResult:
    """Runs `code` as a program in the sandbox with `stdin`; never raises for the program's
    sake (a failed run is a status), never returns before every process of it is gone."""
    isolation = probe()
    uid = _UID_BASE + secrets.randbelow(_UID_SPAN) if isolation.own_uid else None
    workdir = pathlib.Path(tempfile.mkdtemp(prefix="jaxrlhf_sandbox_"))
    start = time.perf_counter()
    try:
        (workdir / _PROGRAM).write_text(code, encoding="utf-8")
        (workdir / "stdin.txt").write_text(stdin, encoding="utf-8")
        if uid is not None:
            os.chown(workdir, uid, uid)
            os.chown(workdir / _PROGRAM, uid, uid)
        with (open(workdir / "stdin.txt", "rb") as stdin_f,
              open(workdir / _STDOUT, "wb") as out_f, open(workdir / _STDERR, "wb") as err_f):
            proc = subprocess.Popen(  # no preexec_fn: nothing runs in a fork of this process
                [isolation.interpreter, "-I", "-B", "-c", _BOOTSTRAP, _PROGRAM,
                 *_enter_args(limits, isolation, uid)],
                cwd=workdir, stdin=stdin_f, stdout=out_f, stderr=err_f, close_fds=True,
                env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": str(workdir)},
                start_new_session=True)
            timed_out = False
            try:
                proc.wait(timeout=limits.wall_seconds)
            except subprocess.TimeoutExpired:
                timed_out = True
            finally:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(proc.pid, signal.SIGKILL)  # the group: forked children too
                if uid is not None:
                    _kill_uid(uid)
                proc.wait()
        stderr = _read(workdir / _STDERR, limits.file_bytes)
        status = _status(proc.returncode, stderr, timed_out)
        return RunResult(status, _read(workdir / _STDOUT, limits.file_bytes), stderr,
                         time.perf_counter() - start)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
