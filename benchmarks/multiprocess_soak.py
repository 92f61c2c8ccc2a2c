"""Soak of the multi-process scenarios: rounds back to back under load, hangs and failures counted.

Each round runs the default multi-process tests (`tests/test_multiprocess.py`: a PPO plan whose
generation and training sit in different processes compared with one process, the two
SIGKILL cases (slow-marked in the default suite), and a transfer whose peer never arrives)
on two pytest workers, so both workers
run multi-process jobs at the same time, as in the README's test command. A round that has not
finished after `--round_timeout` seconds is a hang: its process tree is killed and the round is
counted as such. The last line is one JSON object with the counts and per-round seconds.

    python benchmarks/multiprocess_soak.py --rounds=20
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import signal
import subprocess
import sys
import time

REPO = pathlib.Path(__file__).resolve().parent.parent


def _round(timeout_s: float, log: pathlib.Path) -> tuple[str, float]:
    """One pytest run of the multi-process tests: ("pass" | "fail" | "hang", seconds)."""
    start = time.monotonic()
    with log.open("w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "pytest", "-q", "-n", "2", "tests/test_multiprocess.py",
             "-m", "not entry"],  # slow-marked kill tests included; whole training runs not
            cwd=REPO, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            code = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # the whole tree: pytest workers and JAX jobs
            proc.wait()
            return "hang", time.monotonic() - start
    return ("pass" if code == 0 else "fail"), time.monotonic() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--round_timeout", type=float, default=900.0,
                        help="seconds after which a round counts as hung")
    parser.add_argument("--logs", default="", help="directory for each round's pytest output")
    args = parser.parse_args()
    logs = pathlib.Path(args.logs or f"/tmp/jaxrlhf-soak-{os.getpid()}")
    logs.mkdir(parents=True, exist_ok=True)
    outcomes, seconds = [], []
    for i in range(args.rounds):
        outcome, took = _round(args.round_timeout, logs / f"round_{i:02d}.log")
        outcomes.append(outcome)
        seconds.append(round(took, 1))
        print(f"round {i + 1}/{args.rounds}: {outcome} in {took:.0f} s"
              + (f" (log: {logs / f'round_{i:02d}.log'})" if outcome != "pass" else ""),
              flush=True)
    print(json.dumps({"rounds": args.rounds, "passed": outcomes.count("pass"),
                      "failed": outcomes.count("fail"), "hangs": outcomes.count("hang"),
                      "round_seconds": seconds, "logs": str(logs)}))


if __name__ == "__main__":
    main()
