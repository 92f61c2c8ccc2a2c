"""Per-call cost of the code sandbox (`data/sandbox.py`): `run_python("print(1)")` against bare
starts of the same interpreter, alternated call by call in one process, so load from other
processes hits every side alike.

`python benchmarks/sandbox_overhead.py [--calls=60] [--other=PATH/TO/sandbox.py]`

`--other` loads another checkout's sandbox.py (e.g. `git show REV:jaxrlhf/data/sandbox.py >
/tmp/old_sandbox.py`) and times it too. Prints each side's median wall time per call. Not a
test: the figure of issue 46.

Measured on 2 loaded CPU cores (load average 3-7), 60 calls each, as root, against the sandbox
before bubblewrap (a separate uid, `unshare(CLONE_NEWNET)`, an audit hook, then a second
interpreter to kill the uid's leftovers; `--other` at commit abcef68), two runs: this sandbox
35 and 42 ms a call, the one before 93 and 96 ms; a bare `python -I -B -c` start 72 and 77 ms,
`python -I -S -B -c` 14 and 17 ms.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import subprocess
import sys
import time

from jaxrlhf.data import sandbox


def _load(path: str):
    spec = importlib.util.spec_from_file_location("other_sandbox", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["other_sandbox"] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=60)
    parser.add_argument("--other", default="", help="another checkout's sandbox.py")
    args = parser.parse_args()
    sides = {
        "python -I -B -c": lambda: subprocess.run(
            [sys.executable, "-I", "-B", "-c", "print(1)"], capture_output=True, check=True),
        "python -I -S -B -c": lambda: subprocess.run(
            [sys.executable, "-I", "-S", "-B", "-c", "print(1)"], capture_output=True,
            check=True),
        "sandbox": lambda: sandbox.run_python("print(1)"),
    }
    if args.other:
        other = _load(args.other)
        sides["other sandbox"] = lambda: other.run_python("print(1)")
    result = sandbox.run_python("print(1)")  # starts probe() too
    assert result.status is sandbox.RunStatus.OK and result.stdout == "1\n", result
    seconds = {name: [] for name in sides}
    for _ in range(args.calls):
        for name, call in sides.items():
            start = time.perf_counter()
            call()
            seconds[name].append(time.perf_counter() - start)
    for name, values in seconds.items():
        print(f"{name:20s} median {statistics.median(values) * 1e3:6.1f} ms a call")


if __name__ == "__main__":
    main()
