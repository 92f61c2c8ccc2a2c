"""A job's start with a cold and with a warm compilation cache (`compile.cache_dir`), alternated.

`python benchmarks/restart_compiles.py [--repeats=2] [--min_seconds=0,1] [-- TRAIN_ARGS...]`

Each round runs `python -m jaxrlhf.train` (default `--config=configs/ppo_tiny.py`, the main
job) twice per cache setting, in fresh processes: first on an empty cache directory (cold: it
compiles everything and writes it), then again on the same directory (warm: a restart). A
setting is JAX's minimum compile time for an executable to be written
(`JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS`; jaxrlhf's is 0, JAX's own default 1). It prints
per run the seconds from the process's start to its first metrics record (the warm start's
first step, or the first RL step where there is none), to its first RL step, and to its end,
and the summary's held-out accuracy (the same program, the same numbers). Load from other
processes hits cold and warm runs alike within a round; compare within rounds.
Not a test: a tool to see what a restart pays in compiles.

Measured (2 cores under other processes' load, 4-11; 3 rounds, default arguments): cold, the
first PPO step came 59-69 s after the start and the run ended at 80-96 s; warm, 21-31 s and
30-43 s, all 123 executables loaded, the same held-out accuracy (0.975). With JAX's 1 s
minimum, 10-15 executables were kept (which ones, by the load) and warm runs reached their
first PPO step in 31-36 s.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import time

REPO = pathlib.Path(__file__).resolve().parent.parent
RUN_DEADLINE_S = 1800  # a run taking longer is killed and reported (a hang is not a figure)


def _args():
    p = argparse.ArgumentParser()
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--min_seconds", default="0,1", help="minimum compile times to compare")
    p.add_argument("train_args", nargs="*", default=["--config=configs/ppo_tiny.py"])
    return p.parse_args()


def _records(path: pathlib.Path) -> list[dict]:
    rows = []
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            pass  # being written
    return rows


def run(train_args: list[str], cache: pathlib.Path, min_seconds: str) -> dict:
    """One `jaxrlhf.train` run: seconds to its first record, first RL step, end; accuracy."""
    work = pathlib.Path(tempfile.mkdtemp(prefix="restart-"))
    env = {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"}
    env.update(PYTHONPATH=str(REPO), JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=min_seconds)
    start = time.perf_counter()
    proc = subprocess.Popen(
        [sys.executable, "-m", "jaxrlhf.train", *train_args, f"--workdir={work}",
         f"--config.compile.cache_dir={cache}"],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    first = first_rl = None
    while proc.poll() is None:
        records = _records(work / "metrics.jsonl")
        now = time.perf_counter() - start
        if now > RUN_DEADLINE_S:
            proc.kill()
            raise TimeoutError(f"jaxrlhf.train ran over {RUN_DEADLINE_S} s: {train_args}")
        if records and first is None:
            first = now
        if any("reward" in r for r in records) and first_rl is None:
            first_rl = now
        time.sleep(0.05)
    end = time.perf_counter() - start
    out = proc.stdout.read()
    shutil.rmtree(work, ignore_errors=True)
    assert proc.returncode == 0, out[-2000:]
    summary = json.loads(out.strip().splitlines()[-1])
    return {"first_record_s": first, "first_rl_step_s": first_rl, "end_s": end,
            "accuracy_after": summary.get("accuracy_after"),
            "entries": len(list(cache.rglob("*-cache")))}  # in the host's folder


def main():
    args = _args()
    settings = args.min_seconds.split(",")
    for round_ in range(args.repeats):
        for min_seconds in settings:
            cache = pathlib.Path(tempfile.mkdtemp(prefix="restart-cache-"))
            for state in ("cold", "warm"):
                figures = run(args.train_args, cache, min_seconds)
                print(json.dumps({"round": round_, "min_compile_seconds": float(min_seconds),
                                  "cache": state, **figures}), flush=True)
            shutil.rmtree(cache, ignore_errors=True)


if __name__ == "__main__":
    main()
