"""Running model-written Python in a sandbox, for the `code` reward and the `python` tool.

The boundary is the kernel's, drawn by bubblewrap (`bwrap`, Debian's package `bubblewrap`):
each run is a fresh set of namespaces in which the program sees

  * files: a private mount namespace holding only the system's `/usr` (and `/bin`, `/lib`...
    as the host has them), the interpreter's own installation and `/etc/ld.so.cache`, all
    read-only and nosuid, a fresh `/dev` and `/proc`, and its scratch directory `/scratch`: a
    tmpfs of `Limits.scratch_bytes` holding `main.py`, its cwd, HOME and TMPDIR, the one place
    it may write. Nothing of the trainer (workdir, data, checkpoints, the repository, /tmp)
    exists there;
  * processes: a PID namespace of its own (its `/proc` lists its own processes only). When the
    program exits, or is killed at the wall-clock limit, the namespace's init exits and the
    kernel kills every process left in it before `run_python` returns;
  * no network: a network namespace holding only its own loopback; no IPC or UTS shared;
  * a user of its own when the trainer runs as root: a fresh uid that no other process has (so
    the process limit counts only its own processes and it owns no host file); as another user,
    a user namespace mapping that user;
  * resource limits (setrlimit, in the fresh interpreter before the program runs): CPU seconds
    (SIGXCPU), address space (MemoryError), file size (a huge output fails with EFBIG), open
    files, processes;
  * no user namespaces of its own: a seccomp filter (x86-64 and arm64) refuses them, so the
    kernel's code for privileged namespaces stays out of its reach (`_seccomp_filter`).

The program runs on the trainer's interpreter with the standard library only (`-I -S -B`: no
site-packages imported, no bytecode written), which also keeps a whole run at about 40 ms
(`benchmarks/sandbox_overhead.py`). Whatever it does inside (fork, exec a shell, ctypes,
Python's internals), it does as that uid in those namespaces; there is no Python-level block
list to get around. Its stdin, stdout and stderr are anonymous in-memory files (`memfd`) of
the trainer's, never paths the program could replace. Nothing of the sandbox runs in a fork of
the trainer: `bwrap` is exec'd, and the limits and uid change happen in the interpreter it
starts. `--die-with-parent`: a caller killed mid-run (a reward worker at its timeout) takes
the sandbox along.

Without a working `bwrap` nothing runs: `run_python` raises `SandboxUnavailable` naming the
package (`require` says so up front: `data/rewards.resolve_reward` refuses the `code` reward
before anything compiles; the `python` tool answers the policy with the error). A program that
fails in any way returns a `RunStatus` other than OK; it never raises, hangs the caller or
outlives the call.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import functools
import json
import os
import pathlib
import secrets
import select
import shutil
import signal
import struct
import subprocess
import sys
import time

# A uid range no account uses: each run (as root) gets a fresh one, owning nothing on the host.
_UID_BASE, _UID_SPAN = 3_100_000, 900_000
SCRATCH = "/scratch"
_PROGRAM = "main.py"
_TEARDOWN_S = 10.0  # the kernel's killing of a namespace's processes: milliseconds
_FAILED_SETUP = 97  # the interpreter could not set the limits or uid: nothing of the program ran
INSTALL_HINT = "needs bubblewrap (apt install bubblewrap)"

# A seccomp filter (classic BPF, loaded by bwrap's --seccomp just before the program) refusing
# new user namespaces: in one the program would hold every capability over its own namespaces,
# the kernel's code for them (netfilter above all) the usual way from an unprivileged uid to
# root. unshare/clone with CLONE_NEWUSER fail with EPERM; clone3, whose flags sit in memory a
# filter cannot read, with ENOSYS (glibc then falls back to clone); another ABI's calls (x32,
# i386 on x86-64) with ENOSYS. Per machine: (AUDIT_ARCH, clone, unshare, clone3, x32 bit).
_SECCOMP_ARCH = {"x86_64": (0xC000003E, 56, 272, 435, 0x40000000),
                 "aarch64": (0xC00000B7, 220, 97, 435, None)}
_CLONE_NEWUSER = 0x10000000


def _seccomp_filter(machine: str) -> bytes:
    """The filter's sock_filter array (`struct.pack("HBBI")` each) for `machine`."""
    arch, clone, unshare, clone3, x32 = _SECCOMP_ARCH[machine]
    load, jeq, jge, jset, ret = 0x20, 0x15, 0x35, 0x45, 0x06  # BPF_LD|W|ABS, BPF_JMP|..|K
    allow, errno = 0x7FFF0000, 0x00050000  # SECCOMP_RET_ALLOW, SECCOMP_RET_ERRNO
    enosys, eperm = errno | 38, errno | 1
    program = [  # (code, jump if true, jump if false, k); a jump skips that many ops
        (load, 0, 0, 4),  # seccomp_data.arch
        (jeq, 1, 0, arch),
        (ret, 0, 0, enosys),
        (load, 0, 0, 0),  # seccomp_data.nr
        *([] if x32 is None else [(jge, 4, 0, x32)]),
        (jeq, 3, 0, clone3),
        (jeq, 3, 0, unshare),
        (jeq, 2, 0, clone),
        (ret, 0, 0, allow),
        (ret, 0, 0, enosys),  # x32's calls and clone3
        (load, 0, 0, 16),  # seccomp_data.args[0], its low 32 bits: the flags
        (jset, 0, 1, _CLONE_NEWUSER),
        (ret, 0, 0, eperm),
        (ret, 0, 0, allow),
    ]
    return b"".join(struct.pack("HBBI", *op) for op in program)

# Run by `python -c` inside the sandbox (argv: the program, then the uid and limits that
# `_bwrap_command` passes): the limits, then (as root) the scratch directory handed to the
# program's uid and that uid taken, which drops every capability; only then the program.
_BOOTSTRAP = r'''
import os, sys

def _enter(uid, cpu, memory, files, processes, open_files):
    try:
        import resource
        for kind, value in ((resource.RLIMIT_CPU, (cpu, cpu + 1)),
                            (resource.RLIMIT_AS, (memory, memory)),
                            (resource.RLIMIT_FSIZE, (files, files)),
                            (resource.RLIMIT_NOFILE, (open_files, open_files)),
                            (resource.RLIMIT_NPROC, (processes, processes)),
                            (resource.RLIMIT_CORE, (0, 0))):
            resource.setrlimit(kind, value)
        if uid >= 0:
            os.chown(".", uid, uid)
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
    except Exception:  # any failure: refuse to run the program at all
        os._exit(%(failed)d)

def _run(path):  # as runpy.run_path(path, run_name="__main__"), without runpy's 15 ms import
    import builtins
    with open(path, "rb") as f:
        code = compile(f.read(), path, "exec")
    sys.argv = [path]
    builtins.exit = builtins.quit = sys.exit  # what `site` (-S: not imported) would add
    main = sys.modules["__main__"].__dict__
    main.clear()
    main.update(__name__="__main__", __file__=path, __builtins__=builtins)
    exec(code, main)

_enter(*map(int, sys.argv[2:]))
_run(sys.argv[1])
''' % {"failed": _FAILED_SETUP}


class SandboxUnavailable(ValueError):
    """This machine cannot run the sandbox (no `bwrap`, or one that cannot start)."""


class RunStatus(enum.Enum):
    OK = "ok"  # exited with status 0
    ERROR = "error"  # raised or exited non-zero (a path outside the sandbox: FileNotFoundError)
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
    file_bytes: int = 1 * 2**20  # stdout, stderr and any one file written
    processes: int = 8
    open_files: int = 64
    scratch_bytes: int = 16 * 2**20  # the whole scratch directory (a tmpfs: memory)


@dataclasses.dataclass(frozen=True)
class RunResult:
    status: RunStatus
    stdout: str
    stderr: str
    seconds: float


@dataclasses.dataclass(frozen=True)
class Isolation:
    """How runs are started here (see `probe`)."""

    bwrap: str
    own_uid: bool  # running as root: the program gets a uid of its own
    mounts: tuple[str, ...]  # bwrap's arguments for the read-only system and interpreter
    seccomp: bytes = dataclasses.field(repr=False)  # `_seccomp_filter` (b"": unknown machine)


def _system_mounts() -> list[str]:
    """/usr, the top-level links into it (or directories, where /usr is not merged) and the
    interpreter's installation, read-only; a directory holding it is made traversable (bwrap
    would copy /root's 0700 and lock the program's uid out of its own interpreter)."""
    args = ["--ro-bind", "/usr", "/usr"]
    for top in ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):
        if os.path.islink(top):
            args += ["--symlink", os.readlink(top), top]
        elif os.path.isdir(top):
            args += ["--ro-bind", top, top]
    args += ["--perms", "0755", "--dir", "/etc",
             "--ro-bind-try", "/etc/ld.so.cache", "/etc/ld.so.cache"]
    bound = ["/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"]
    made = set()
    candidates = {sys.prefix, sys.base_prefix, os.path.dirname(sys.executable)}
    for path in sorted(candidates | {os.path.realpath(p) for p in candidates}):
        if any(path == b or path.startswith(b + "/") for b in bound):
            continue
        if path == "/" or not os.path.isdir(path):
            raise SandboxUnavailable(f"cannot mount the interpreter's installation {path!r}")
        for parent in reversed(pathlib.PurePath(path).parents[:-1]):
            if str(parent) not in made:
                made.add(str(parent))
                args += ["--perms", "0755", "--dir", str(parent)]
        args += ["--ro-bind", path, path]
        bound.append(path)
    return args


def _bwrap_command(isolation: Isolation, limits: Limits, program_fd: int, info_fd: int,
                   seccomp_fd: int | None, uid: int | None) -> list[str]:
    """The whole command line of one run (the module docstring says what each part is for)."""
    namespaces = ["--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts",
                  "--unshare-cgroup-try"]
    if not isolation.own_uid:  # not root: an unprivileged user namespace makes the rest
        namespaces += ["--unshare-user", "--disable-userns"]
    limit_args = (-1 if uid is None else uid, max(1, int(limits.cpu_seconds)),
                  limits.memory_bytes, limits.file_bytes, limits.processes, limits.open_files)
    return [isolation.bwrap, *namespaces, "--die-with-parent", "--new-session",
            *isolation.mounts, "--proc", "/proc", "--dev", "/dev",
            "--size", str(limits.scratch_bytes), "--tmpfs", SCRATCH,
            "--file", str(program_fd), f"{SCRATCH}/{_PROGRAM}", "--chdir", SCRATCH,
            "--clearenv", "--setenv", "PATH", "/usr/bin:/bin", "--setenv", "LANG", "C.UTF-8",
            "--setenv", "HOME", SCRATCH, "--setenv", "TMPDIR", SCRATCH,
            "--info-fd", str(info_fd),
            *([] if seccomp_fd is None else ["--seccomp", str(seccomp_fd)]),
            sys.executable, "-I", "-S", "-B", "-c", _BOOTSTRAP, _PROGRAM, *map(str, limit_args)]


@functools.lru_cache(maxsize=1)
def probe() -> Isolation | str:
    """How runs start here, or why they cannot (a phrase following a subject: "the sandbox
    needs ..."): a trivial program run once in the sandbox."""
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        return f"{INSTALL_HINT}: no bwrap on PATH"
    try:
        machine = os.uname().machine
        isolation = Isolation(bwrap, os.geteuid() == 0, tuple(_system_mounts()),
                              _seccomp_filter(machine) if machine in _SECCOMP_ARCH else b"")
    except SandboxUnavailable as e:
        return str(e)
    try:
        result = _run(isolation, "print(6 * 7)", "", Limits())
    except OSError as e:  # not executable, or this kernel has no pidfds
        return f"needs a bubblewrap that can start here ({bwrap}: {e})"
    if result.status is not RunStatus.OK or result.stdout != "42\n":
        last = (result.stderr.strip().splitlines() or [result.status.value])[-1]
        return f"needs a bubblewrap that can start here ({bwrap}: {last})"
    return isolation


def require(what: str = "the sandbox") -> Isolation:
    """This machine's `Isolation`.

    Raises:
      SandboxUnavailable: one line, naming `what` and the package (or bwrap's own complaint).
    """
    isolation = probe()
    if isinstance(isolation, str):
        raise SandboxUnavailable(f"{what} {isolation}")
    return isolation


def _fresh_uid() -> int:
    return _UID_BASE + secrets.randbelow(_UID_SPAN)


def _status(returncode: int, stderr: str, timed_out: bool) -> RunStatus:
    # bwrap's init exits 128+N for a program killed by signal N
    signalled = returncode - 128 if returncode > 128 else -returncode
    if timed_out or signalled in (signal.SIGXCPU, signal.SIGKILL):
        return RunStatus.TIMEOUT
    if returncode == _FAILED_SETUP or (returncode == 1 and stderr.startswith("bwrap: ")):
        return RunStatus.SETUP
    if returncode != 0:
        if "MemoryError" in stderr:
            return RunStatus.MEMORY
        # Python ignores SIGXFSZ: a write past the file-size limit raises EFBIG instead.
        return RunStatus.OUTPUT_LIMIT if "[Errno 27] File too large" in stderr else RunStatus.ERROR
    return RunStatus.OK


def _memfd(name: str, data: str | bytes = b"") -> int:
    fd = os.memfd_create(name)
    os.write(fd, data.encode("utf-8") if isinstance(data, str) else data)
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


def _read(fd: int, limit: int) -> str:
    return os.pread(fd, limit, 0).decode("utf-8", errors="replace")


def _readable_within(fd: int, seconds: float) -> bool:
    """Whether `fd` (a pipe, or a pidfd: readable once its process has exited) becomes
    readable within `seconds`, woken at once (Popen.wait(timeout) polls with sleeps growing to
    50 ms: a 40 ms program would cost up to 90)."""
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    return bool(poller.poll(max(0, int(seconds * 1000))))


def _init_pidfd(info_r: int, seconds: float) -> int | None:
    """A pidfd of the sandbox's init, from bwrap's --info-fd report (written, then closed, as
    the namespaces are made, before the program starts); None when bwrap reported nothing (it
    failed to start, or did not finish saying so in time) or the init is gone already."""
    deadline, report = time.perf_counter() + seconds, b""
    while _readable_within(info_r, deadline - time.perf_counter()):
        if not (chunk := os.read(info_r, 4096)):
            try:
                return os.pidfd_open(int(json.loads(report)["child-pid"]))
            except (OSError, ValueError, KeyError):
                return None
        report += chunk
    return None


def _run(isolation: Isolation, code: str, stdin: str, limits: Limits) -> RunResult:
    uid = _fresh_uid() if isolation.own_uid else None
    start = time.perf_counter()
    fds = [_memfd("program", code), _memfd("stdin", stdin), _memfd("stdout"), _memfd("stderr")]
    seccomp_fd = _memfd("seccomp", isolation.seccomp) if isolation.seccomp else None
    info_r, info_w = os.pipe()
    fds += [info_r] + ([] if seccomp_fd is None else [seccomp_fd])
    try:
        program_fd, stdin_fd, out_fd, err_fd = fds[:4]
        passed = [fd for fd in (program_fd, info_w, seccomp_fd) if fd is not None]
        try:
            proc = subprocess.Popen(  # no preexec_fn: nothing runs in a fork of this process
                _bwrap_command(isolation, limits, program_fd, info_w, seccomp_fd, uid),
                stdin=stdin_fd, stdout=out_fd, stderr=err_fd, pass_fds=passed, close_fds=True,
                env={"PATH": "/usr/bin:/bin"}, start_new_session=True)
        finally:
            os.close(info_w)  # bwrap's copy alone: EOF if it dies before reporting
        init = _init_pidfd(info_r, limits.wall_seconds)
        if init is not None:
            fds.append(init)
        fds.append(bwrap_fd := os.pidfd_open(proc.pid))
        left = limits.wall_seconds - (time.perf_counter() - start)
        timed_out = not _readable_within(bwrap_fd, left)  # bwrap exits when the program does
        if timed_out:  # the init's death kills every process of its PID namespace
            if init is not None:
                with contextlib.suppress(ProcessLookupError):
                    signal.pidfd_send_signal(init, signal.SIGKILL)
            proc.kill()  # should it not have reported: --die-with-parent takes its child along
        proc.wait()
        if init is not None:  # ... and its init, with the namespace's last process, after it
            _readable_within(init, _TEARDOWN_S)
        stderr = _read(err_fd, limits.file_bytes)
        return RunResult(_status(proc.returncode, stderr, timed_out),
                         _read(out_fd, limits.file_bytes), stderr, time.perf_counter() - start)
    finally:
        for fd in fds:
            os.close(fd)


def run_python(code: str, stdin: str = "", limits: Limits = Limits()) -> RunResult:
    """Runs `code` as a program in the sandbox with `stdin`; never raises for the program's
    sake (a failed run is a status), never returns before every process of it is gone.

    Raises:
      SandboxUnavailable: this machine cannot sandbox (see `require`); nothing ran.
    """
    return _run(require(), code, stdin, limits)
