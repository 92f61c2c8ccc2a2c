"""The `code` reward's sandbox: programs that try to escape, each with its asserted outcome.

Every escape scores 0 with its failure counted by kind, returns within the wall-clock limit
(plus process start-up), and leaves no damage: no file outside the sandbox, no connection
reaching a server on this machine, no process left behind, the caller alive.
"""

import json
import os
import pathlib
import socket
import tempfile
import threading
import time

import pytest

from jaxrlhf.data import sandbox
from jaxrlhf.data.code_reward import code_reward, extract_code, parse_tests, run_tests
from jaxrlhf.data.rewards import resolve_reward
from jaxrlhf.data.sandbox import Limits, RunStatus, run_python

LIMITS = Limits(wall_seconds=4.0, cpu_seconds=2, memory_bytes=256 * 2**20,
                file_bytes=64 * 2**10, processes=8)
SLACK_S = 6.0  # interpreter start-up and clean-up on a loaded machine


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


def _sandbox_processes(uids: set[int]) -> list[int]:
    """Pids of processes running under one of `uids` (the sandbox uids of this test's runs: other
    tests running at the same time on the other pytest worker have sandboxed programs of their
    own, under other uids of the range)."""
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
    ("shell_write", "import os\nos.system('echo x > {outside}/escaped.txt')\nprint('ok')",
     RunStatus.ERROR, "file"),
    ("subprocess", "import subprocess\nsubprocess.run(['touch', '{outside}/escaped.txt'])\n"
     "print('ok')", RunStatus.ERROR, "file"),
    ("ctypes", "import ctypes\nctypes.CDLL(None).system(b'touch {outside}/escaped.txt')\n"
     "print('ok')", RunStatus.ERROR, "file"),
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
def test_escape_table(name, program, status, damage, public_dir, listener, monkeypatch):
    port, hits = listener
    used_uids = set()  # the uid of every run, as the sandbox kills its leftovers
    kill_uid = sandbox._kill_uid
    monkeypatch.setattr(sandbox, "_kill_uid", lambda uid: (used_uids.add(uid), kill_uid(uid))[1])
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
    assert _sandbox_processes(used_uids) == [], "a sandboxed process outlived its run"
    assert code_reward("", f"```python\n{code}\n```", json.dumps(
        [{"input": "", "output": "ok"}])) == 0.0


def test_a_correct_program_passes_and_the_directory_is_thrown_away():
    program = ("import os, sys\nopen('scratch.txt', 'w').write(sys.stdin.read())\n"
               "print(sum(int(x) for x in open('scratch.txt').read().split()), os.getcwd())")
    result = run_python(program, "1 2 3\n", LIMITS)
    assert result.status is RunStatus.OK, result.stderr
    total, cwd = result.stdout.split()
    assert total == "6" and not os.path.exists(cwd)  # writing inside is fine; then it is gone
    tests = json.dumps([{"input": "2 3\n", "output": "5"}, {"input": "4 4\n", "output": "8"},
                        {"input": "1 1\n", "output": "3"}])
    completion = "Here:\n```python\na, b = map(int, input().split())\nprint(a + b)\n```\n"
    assert resolve_reward("code")("", completion, tests) == pytest.approx(2 / 3)


def test_code_extraction_and_test_parsing():
    assert extract_code("x\n```py\nA\n```\n```python\nB\n```") == "B\n"
    assert extract_code("```\nC\n```") == "C\n"
    assert extract_code("print(1)") == "print(1)"
    assert parse_tests('[{"input": "", "output": "1"}]') == [("", "1")]
    for bad in (None, "[]", '{"input": ""}', '[{"input": 1, "output": "2"}]'):
        with pytest.raises(ValueError):
            parse_tests(bad)
