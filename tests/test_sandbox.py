"""The code sandbox (`data/sandbox.py`, bubblewrap): programs that try to escape, each with its
asserted outcome.

The table's escapes score 0 with their failure counted by kind, return within the wall-clock
limit (plus start-up) and leave no damage: no file outside the sandbox, no connection reaching a
server on this machine, no process left behind, the caller alive. The escapes found against the
old Python block list (reading the trainer's files and other processes' command lines, creating
files outside through `dir_fd`, `mkfifo`, `mknod`, clearing the block list through
`gc.get_objects()`, `_posixsubprocess.fork_exec` starting a shell) each run in a program that
first answers `45` (a positive control in the same sandbox: a sandbox that never started cannot
pass) and then reports what it reached; the assertion is on what it reached, not on a refusal.
"""

import ast
import json
import os
import pathlib
import re
import secrets
import subprocess
import sys
import socket
import tempfile
import textwrap
import threading
import time

import pytest
from conftest import sandbox_or_skip

import jaxrlhf
from jaxrlhf.data import sandbox, tools
from jaxrlhf.data.code_reward import code_reward, extract_code, parse_tests, run_tests
from jaxrlhf.data.rewards import resolve_reward
from jaxrlhf.data.sandbox import Limits, RunStatus, run_python

LIMITS = Limits(wall_seconds=4.0, cpu_seconds=2, memory_bytes=256 * 2**20,
                file_bytes=64 * 2**10, processes=8)
SLACK_S = 6.0  # interpreter start-up and clean-up on a loaded machine
CONTROL = "print(sum(range(10)), flush=True)\n"  # the positive control: 45


@pytest.fixture
def public_dir():
    """A world-writable directory outside the sandbox, so only the sandbox stops the write."""
    path = pathlib.Path(tempfile.mkdtemp(prefix="h13_escape_"))
    path.chmod(0o777)
    yield path
    for child in path.iterdir():
        child.unlink()
    path.rmdir()


@pytest.fixture
def trainer_workdir():
    """A run's workdir as a trainer leaves it (umask 022: world-readable), holding held-out rows
    with their answers: (the directory, the file, the secret in it)."""
    path = pathlib.Path(tempfile.mkdtemp(prefix="h13_workdir_"))
    path.chmod(0o755)
    secret = f"held-out-answer-{os.getpid()}-{time.time_ns()}"
    rows = path / "heldout.jsonl"
    rows.write_text(json.dumps({"prompt": "2+2=", "answer": secret}) + "\n")
    rows.chmod(0o644)
    yield path, rows, secret
    rows.unlink()
    path.rmdir()


@pytest.fixture
def listener():
    """A TCP server on 127.0.0.1 that records whether anything connected."""
    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(0.2)
    hits, stop = [], threading.Event()

    def serve():
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except OSError:
                continue
            hits.append(conn.recv(100))
            conn.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield server.getsockname()[1], hits
    stop.set()
    thread.join()
    server.close()


@pytest.fixture
def used_uids(monkeypatch, bwrap):
    """The uid of every run (as root each run has a fresh one), to look for its leftovers."""
    uids = set()
    fresh = sandbox._fresh_uid
    monkeypatch.setattr(sandbox, "_fresh_uid", lambda: (uids.add(uid := fresh()), uid)[1])
    return uids


def _processes_of(uids: set[int]) -> list[int]:
    """Pids of processes running under one of `uids` (this test's runs: other tests running at
    the same time have sandboxed programs of their own, under other uids of the range)."""
    found = []
    for status in pathlib.Path("/proc").glob("[0-9]*/status"):
        try:
            uid = int(next(line for line in status.read_text().splitlines()
                           if line.startswith("Uid:")).split()[1])
        except (OSError, StopIteration, ValueError):
            continue
        if uid in uids:
            found.append(int(status.parent.name))
    return found


def _run_answering(program: str, **fmt) -> sandbox.RunResult:
    """`program` after the positive control, in the sandbox; asserts the control answered."""
    result = run_python(CONTROL + textwrap.dedent(program).format(**fmt), "", LIMITS)
    assert result.stdout.startswith("45\n"), (result.status, result.stdout, result.stderr)
    return result


# (name, program, status it must end with, damage check id)
ESCAPES = [
    ("network_socket", "import socket\nsocket.create_connection(('127.0.0.1', {port}), 1)"
     ".sendall(b'x')\nprint('ok')", RunStatus.ERROR, "network"),
    ("network_raw_module", "import _socket\ns = _socket.socket()\ns.connect(('127.0.0.1', "
     "{port}))\ns.send(b'x')\nprint('ok')", RunStatus.ERROR, "network"),
    ("write_outside", "open('{outside}/escaped.txt', 'w').write('x')\nprint('ok')",
     RunStatus.ERROR, "file"),
    ("write_outside_os_open", "import os\nos.close(os.open('{outside}/escaped.txt', "
     "os.O_CREAT | os.O_WRONLY))\nprint('ok')", RunStatus.ERROR, "file"),
    ("shell_write", "import os\nassert os.system('echo x > {outside}/escaped.txt') == 0\n"
     "print('ok')", RunStatus.ERROR, "file"),
    ("subprocess", "import subprocess\nsubprocess.run(['touch', '{outside}/escaped.txt'], "
     "check=True)\nprint('ok')", RunStatus.ERROR, "file"),
    ("ctypes", "import ctypes\nassert ctypes.CDLL(None).system(b'touch {outside}/escaped.txt')"
     " == 0\nprint('ok')", RunStatus.ERROR, "file"),
    ("fork_bomb", "import os\nwhile True:\n    os.fork()", RunStatus.ERROR, "processes"),
    ("kill_parent", "import os, signal\nos.kill(os.getppid(), signal.SIGKILL)\nprint('ok')",
     RunStatus.ERROR, "none"),
    ("infinite_loop", "while True:\n    pass", RunStatus.TIMEOUT, "none"),
    ("sleep_forever", "import time\ntime.sleep(1000)", RunStatus.TIMEOUT, "none"),
    ("huge_output", "while True:\n    print('x' * 10000)", RunStatus.OUTPUT_LIMIT, "none"),
    ("huge_file", "f = open('big.bin', 'wb')\nwhile True:\n    f.write(b'x' * 65536)",
     RunStatus.OUTPUT_LIMIT, "none"),
    ("memory", "blocks = []\nwhile True:\n    blocks.append(bytearray(2**24))",
     RunStatus.MEMORY, "none"),
]


@pytest.mark.parametrize("name,program,status,damage", ESCAPES, ids=[e[0] for e in ESCAPES])
def test_escape_table(name, program, status, damage, public_dir, listener, used_uids):
    port, hits = listener
    code = program.format(port=port, outside=public_dir)
    start = time.perf_counter()
    report = run_tests(code, [("", "ok")], LIMITS)
    seconds = time.perf_counter() - start
    assert report.score == 0.0 and report.failed == 1
    assert report.statuses == {status: 1}, (name, report.statuses)
    assert seconds < LIMITS.wall_seconds + SLACK_S, seconds
    time.sleep(0.3)  # a connection in flight would have reached the server by now
    assert hits == [], "a sandboxed program reached a server on this machine"
    assert list(public_dir.iterdir()) == [], "a sandboxed program wrote outside its directory"
    assert used_uids or os.geteuid() != 0  # as root every run has a uid of its own
    assert _processes_of(used_uids) == [], "a sandboxed process outlived its run"
    assert code_reward("", f"```python\n{code}\n```", json.dumps(
        [{"input": "", "output": "ok"}])) == 0.0


# --- the escapes found against the Python block list ------------------------------------------


def test_the_trainers_files_are_not_there(trainer_workdir, bwrap):
    """The workdir's held-out rows (and checkpoints beside them) and the repository: absent."""
    workdir, rows, secret = trainer_workdir
    readme = pathlib.Path(jaxrlhf.__file__).resolve().parent.parent / "README.md"
    result = _run_answering("""
        import os
        for path in ({rows!r}, {readme!r}):
            try:
                print(open(path).read(300))
            except OSError as e:
                print('absent', path, type(e).__name__)
        for path in ({workdir!r}, os.path.dirname({workdir!r}), {repo!r}):
            try:
                print(path, os.listdir(path))
            except OSError as e:
                print('absent', path, type(e).__name__)
        """, rows=str(rows), readme=str(readme), workdir=str(workdir),
        repo=str(readme.parent))
    assert secret not in result.stdout and workdir.name not in result.stdout.replace(
        f"absent {workdir}", "")
    assert readme.read_text()[:60] not in result.stdout
    lines = result.stdout.splitlines()[1:]  # after the control's answer
    assert [line.split()[-1] for line in lines[:3]] == ["FileNotFoundError"] * 3, lines
    # The workdir's folder and the repository's exist there only as folders on the way to
    # the interpreter's own installation, mounted read-only (CI's venv lies below /tmp, in
    # the clone it tests): nothing else of them shows.
    interpreter = {pathlib.Path(p).resolve() for p in (sys.prefix, sys.base_prefix)}
    for line in lines[3:]:
        if line.startswith("absent "):
            assert line.endswith("FileNotFoundError"), line
            continue
        folder, listed = line.split(" ", 1)
        for entry in ast.literal_eval(listed):
            path = pathlib.Path(folder, entry)
            assert any(path == p or path in p.parents for p in interpreter), (path, lines)


def test_other_processes_are_invisible(bwrap):
    """The program's /proc holds its own processes only: not the trainer's command line, not
    another process's."""
    marker = f"jaxrlhf-secret-argv-{time.time_ns()}"
    helper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", marker])
    try:
        result = _run_answering("""
            import os
            pids = sorted(int(p) for p in os.listdir('/proc') if p.isdigit())
            for pid in pids + [{helper}, {trainer}]:
                try:
                    print(pid, open(f'/proc/{{pid}}/cmdline', 'rb').read().replace(b'\\0', b' '))
                except OSError as e:
                    print(pid, 'absent', type(e).__name__)
            print('pids', len(pids))
            """, helper=helper.pid, trainer=os.getpid())
    finally:
        helper.kill()
        helper.wait()
    assert marker not in result.stdout and "pytest" not in result.stdout
    assert "main.py" in result.stdout  # its own command line: /proc works
    assert int(result.stdout.split("pids ")[1]) <= 3, result.stdout  # init, the program, ls


def test_os_open_with_dir_fd_creates_nothing_outside(public_dir, bwrap):
    result = _run_answering("""
        import os
        d = os.open({outside!r}, os.O_RDONLY)
        os.close(os.open('escaped.txt', os.O_CREAT | os.O_WRONLY, dir_fd=d))
        print('created')
        """, outside=str(public_dir))
    assert "created" not in result.stdout and "FileNotFoundError" in result.stderr
    assert list(public_dir.iterdir()) == []


@pytest.mark.parametrize("make", ["os.mkfifo(p)", "os.mknod(p, 0o600 | stat.S_IFREG)",
                                  "os.mknod(p, 0o600 | stat.S_IFIFO)"])
def test_mkfifo_and_mknod_create_nothing_outside(make, public_dir, bwrap):
    result = _run_answering(f"""
        import os, stat
        p = {str(public_dir / 'node')!r}
        {make}
        print('created')
        """)
    assert "created" not in result.stdout and "FileNotFoundError" in result.stderr
    assert list(public_dir.iterdir()) == []


def test_no_block_list_to_clear_through_gc(public_dir, trainer_workdir, bwrap):
    """The old hook's deny set, found with gc.get_objects() and cleared, let os.system run: now
    the shell runs, and reaches nothing."""
    _, rows, secret = trainer_workdir
    result = _run_answering("""
        import gc, os
        for o in gc.get_objects():
            if isinstance(o, set) and 'os.system' in o:
                o.clear()
        print('status', os.system('echo x > {outside}/escaped.txt; cat {rows}'))
        """, outside=public_dir, rows=rows)
    assert secret not in result.stdout
    assert list(public_dir.iterdir()) == []
    assert result.stdout.splitlines()[1].startswith("status ") and "status 0" not in result.stdout


def test_fork_exec_starts_a_shell_that_reaches_nothing(public_dir, trainer_workdir, bwrap):
    """`_posixsubprocess.fork_exec` (no audit event) starting /bin/sh: it runs, as the sandbox's
    uid in its namespaces."""
    _, rows, secret = trainer_workdir
    result = _run_answering("""
        import _posixsubprocess, os, sys
        r, w = os.pipe()
        args = [b'/bin/sh', b'-c', b'echo sh-ran; echo x > {outside}/escaped.txt; cat {rows}']
        head = (args, [b'/bin/sh'], True, (), None, None, -1, -1, -1, -1, -1, -1, r, w, True,
                False)
        if sys.version_info < (3, 11):
            pid = _posixsubprocess.fork_exec(*head, None, None, None, -1, None)
        else:  # process_group, gid, extra_groups, uid, umask, preexec_fn[, allow_vfork]
            try:
                pid = _posixsubprocess.fork_exec(*head, -1, None, None, None, -1, None, False)
            except TypeError:
                pid = _posixsubprocess.fork_exec(*head, -1, None, None, None, -1, None)
        os.close(w)
        os.read(r, 100)
        print('exit', os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))
        """, outside=public_dir, rows=rows)
    assert "sh-ran" in result.stdout  # the shell did start
    assert secret not in result.stdout and "exit 0" not in result.stdout
    assert list(public_dir.iterdir()) == []


def test_only_the_scratch_directory_takes_files(bwrap):
    """Every directory of the sandbox's tree but /scratch refuses a file, a fifo and a node."""
    places = ["/", "/tmp", "/dev", "/dev/shm", "/usr", "/usr/lib", "/proc", "/etc", sys.prefix]
    result = _run_answering("""
        import os, stat
        for place in {places!r} + [os.getcwd()]:
            made = []
            for kind, make in (('file', lambda p: open(p, 'w').close()), ('fifo', os.mkfifo),
                               ('node', lambda p: os.mknod(p, 0o600 | stat.S_IFREG))):
                try:
                    make(os.path.join(place, 'escaped-' + kind))
                    made.append(kind)
                except OSError:
                    pass
            print(place, made)
        """, places=places)
    lines = result.stdout.splitlines()[1:]
    assert lines[:-1] == [f"{p} []" for p in places], result.stdout
    assert lines[-1] == "/scratch ['file', 'fifo', 'node']", result.stdout  # the cwd


def test_a_fifo_in_the_scratch_directory_does_not_hang_the_trainer(bwrap):
    """The old sandbox read the program's output back from files in its directory: a program
    that put fifos in their place left the trainer blocked in open() forever."""
    results = []
    program = CONTROL + textwrap.dedent("""
        import os
        for name in ('stdout.txt', 'stderr.txt', 'stdin.txt'):
            try:
                os.remove(name)
            except OSError:
                pass
            os.mkfifo(name)
        print('fifos made', flush=True)
        """)
    thread = threading.Thread(target=lambda: results.append(run_python(program, "", LIMITS)),
                              daemon=True)
    thread.start()
    thread.join(LIMITS.wall_seconds + SLACK_S)
    assert not thread.is_alive(), "run_python hung on the program's fifos"
    assert results[0].status is RunStatus.OK and results[0].stdout == "45\nfifos made\n"


def test_a_left_behind_process_dies_with_its_run(used_uids):
    """A daemonised grandchild (new session, parent gone) is killed before run_python
    returns: the sandbox's PID namespace ends with its init."""
    result = run_python(textwrap.dedent("""
        import os, time
        if os.fork() == 0:
            os.setsid()
            if os.fork() == 0:
                time.sleep(60)
            os._exit(0)
        os.wait()
        print('left one behind')
        """), "", LIMITS)
    assert result.status is RunStatus.OK and result.stdout == "left one behind\n"
    assert used_uids or os.geteuid() != 0
    assert _processes_of(used_uids) == []


def test_no_user_namespace_of_its_own(bwrap):
    """In one the program would hold every capability over namespaces of its own (the usual
    road from an unprivileged uid to root runs through that kernel code): the seccomp filter
    refuses them, while threads, fork and subprocess (glibc's clone3, refused, falls back to
    clone) still work."""
    if os.uname().machine not in sandbox._SECCOMP_ARCH:
        pytest.skip(f"no seccomp filter for {os.uname().machine}")
    x32 = os.uname().machine == "x86_64"
    result = _run_answering("""
        import ctypes, os, subprocess, threading
        libc = ctypes.CDLL(None, use_errno=True)
        def call(name, *args):
            print(name, libc.syscall(*args), os.strerror(ctypes.get_errno()))
        print('unshare', libc.unshare(0x10000000), os.strerror(ctypes.get_errno()))
        call('clone3', 435, 0, 0)
        if {x32}:
            call('x32 unshare', 0x40000000 + 272, 0x10000000)
        threading.Thread(target=print, args=('thread',)).start()
        print(subprocess.run(['echo', 'spawned'], capture_output=True, text=True).stdout.strip())
        if (pid := os.fork()) == 0:
            os._exit(5)
        print('forked', os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))
        """, x32=x32)
    assert result.stdout.splitlines()[1:] == [
        "unshare -1 Operation not permitted", "clone3 -1 Function not implemented",
        *(["x32 unshare -1 Function not implemented"] if x32 else []),
        "thread", "spawned", "forked 5"], result.stdout + result.stderr


def _processes_with_arg(arg: str) -> list[int]:
    found = []
    for cmdline in pathlib.Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if arg.encode() in cmdline.read_bytes().split(b"\0"):
                found.append(int(cmdline.parent.name))
        except OSError:
            continue
    return found


def test_a_killed_caller_takes_its_sandbox_along(bwrap):
    """A reward worker killed at its timeout (SIGKILL, no clean-up) takes its running program
    with it (bwrap's --die-with-parent), rather than leaving it to its own limits."""
    memory = 200 * 2**20 + secrets.randbelow(2**20)  # in the program's argv: how to find it
    caller = subprocess.Popen(
        [sys.executable, "-c", "import os\nfrom jaxrlhf.data import sandbox\n"
         "sandbox.run_python('import time\\ntime.sleep(100)', '', sandbox.Limits("
         "wall_seconds=100, memory_bytes=int(os.environ['SANDBOX_MEMORY'])))"],
        cwd=pathlib.Path(jaxrlhf.__file__).resolve().parent.parent,
        env=os.environ | {"SANDBOX_MEMORY": str(memory)})
    try:
        deadline = time.monotonic() + 60
        while not _processes_with_arg(str(memory)):  # the program has started
            assert time.monotonic() < deadline and caller.poll() is None, "no program started"
            time.sleep(0.1)
    finally:
        caller.kill()
        caller.wait()
    deadline = time.monotonic() + 10
    while _processes_with_arg(str(memory)):
        assert time.monotonic() < deadline, "the program outlived its killed caller"
        time.sleep(0.1)


def test_a_correct_program_passes_and_its_scratch_is_thrown_away(bwrap):
    program = ("import os, sys\nprint(sorted(os.listdir('.')), os.getcwd())\n"
               "open('scratch.txt', 'w').write(sys.stdin.read())\n"
               "print(sum(int(x) for x in open('scratch.txt').read().split()))")
    for _ in range(2):  # the second run does not see the first one's scratch.txt
        result = run_python(program, "1 2 3\n", LIMITS)
        assert result.status is RunStatus.OK, result.stderr
        assert result.stdout == f"['main.py'] {sandbox.SCRATCH}\n6\n"
    tests = json.dumps([{"input": "2 3\n", "output": "5"}, {"input": "4 4\n", "output": "8"},
                        {"input": "1 1\n", "output": "3"}])
    completion = "Here:\n```python\na, b = map(int, input().split())\nprint(a + b)\n```\n"
    assert resolve_reward("code")("", completion, tests) == pytest.approx(2 / 3)


# --- without bubblewrap --------------------------------------------------------------------


@pytest.fixture
def no_bwrap(monkeypatch):
    """This machine as a pip-only user's: no bwrap on PATH."""
    monkeypatch.setattr(sandbox.shutil, "which", lambda name: None)
    sandbox.probe.cache_clear()
    yield
    sandbox.probe.cache_clear()


def test_without_bubblewrap_the_code_reward_and_python_tool_refuse_in_one_line(no_bwrap):
    with pytest.raises(sandbox.SandboxUnavailable) as refused:
        resolve_reward("code")
    assert str(refused.value) == ("the code reward needs bubblewrap (apt install bubblewrap): "
                                  "no bwrap on PATH")
    answer = tools.call_tool(tools.ToolCall("python", {"code": "print(1)"}))
    assert answer == ("error: the sandbox needs bubblewrap (apt install bubblewrap): "
                      "no bwrap on PATH")
    with pytest.raises(sandbox.SandboxUnavailable):
        run_python("print(1)")
    assert resolve_reward("math")  # the others are unaffected


def test_without_bubblewrap_train_refuses_the_code_reward_before_compiling(tmp_path):
    """The real entry point, with a PATH holding no bwrap: exit 2, one line, no traceback."""
    python_dir = tmp_path / "bin"
    python_dir.mkdir()
    (python_dir / "python").symlink_to(sys.executable)
    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps({"prompt": "x", "answer": json.dumps(
        [{"input": "", "output": "1"}])}) + "\n")
    result = subprocess.run(
        [sys.executable, "-m", "jaxrlhf.train", "--config=configs/grpo_tiny.py",
         "--config.reward.function=code", f"--config.data.train_path={rows}",
         f"--workdir={tmp_path / 'run'}"],
        cwd=pathlib.Path(jaxrlhf.__file__).resolve().parent.parent, capture_output=True,
        text=True, timeout=300, env=os.environ | {"PATH": str(python_dir)})
    assert result.returncode == 2, result.stderr[-3000:]
    assert result.stderr.strip().splitlines()[-1] == (
        "error: reward.function: the code reward needs bubblewrap (apt install bubblewrap): "
        "no bwrap on PATH"), result.stderr[-3000:]
    assert "Traceback" not in result.stderr


def test_a_bwrap_that_cannot_start_is_refused_with_its_complaint(monkeypatch, tmp_path):
    """E.g. a container that forbids namespaces: bwrap's own line, in the one line."""
    fake = tmp_path / "bwrap"
    fake.write_text("#!/bin/sh\necho 'bwrap: No permissions to creating new namespace' >&2\n"
                    "exit 1\n")
    fake.chmod(0o755)
    monkeypatch.setattr(sandbox.shutil, "which", lambda name: str(fake))
    sandbox.probe.cache_clear()
    try:
        with pytest.raises(sandbox.SandboxUnavailable) as refused:
            resolve_reward("code")
    finally:
        sandbox.probe.cache_clear()
    assert str(refused.value) == (f"the code reward needs a bubblewrap that can start here "
                                  f"({fake}: bwrap: No permissions to creating new namespace)")


@pytest.mark.parametrize("ci, outcome", [("true", pytest.fail.Exception),
                                         ("", pytest.skip.Exception)])
def test_a_missing_bwrap_fails_the_tests_under_ci_and_skips_them_elsewhere(ci, outcome,
                                                                           no_bwrap, monkeypatch):
    """What the `bwrap` fixture of every sandbox test does on a machine without bwrap."""
    monkeypatch.setenv("CI", ci)
    with pytest.raises(outcome, match=re.escape(
            "the sandbox needs bubblewrap (apt install bubblewrap): no bwrap on PATH")):
        sandbox_or_skip()


def test_code_extraction_and_test_parsing():
    assert extract_code("x\n```py\nA\n```\n```python\nB\n```") == "B\n"
    assert extract_code("```\nC\n```") == "C\n"
    assert extract_code("print(1)") == "print(1)"
    assert parse_tests('[{"input": "", "output": "1"}]') == [("", "1")]
    for bad in (None, "[]", '{"input": ""}', '[{"input": 1, "output": "2"}]'):
        with pytest.raises(ValueError):
            parse_tests(bad)
