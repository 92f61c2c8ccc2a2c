"""Term storm: SIGTERM to the training command's whole process group at random moments.

What `timeout`, Slurm and Kubernetes do to a job: SIGTERM to every process of its group (the
trainer, its reward workers, the multiprocessing helpers), then SIGKILL after a grace period.
The same tiny PPO command (`python -m jaxrlhf.train`, a warm start, a reward pool, checkpoints
every other step) runs in one workdir, and is stopped `--terms` times, each at a moment of one
of these kinds (the first three once, in order; then startup, step and save in turn):

- `startup`: a random moment in the first seconds (imports, checks, compilation);
- `warm_start`: inside the supervised warm start (its first record is logged);
- `evaluation`: after the warm start, before the first RL step (the held-out evaluation);
- `step`: a random moment inside an RL step, after the run made progress past its resume point;
- `save`: while a checkpoint is being written (orbax's temporary directory exists).

Each stop must end within `--grace` seconds (60: else SIGKILL, counted), print no traceback,
and either save a checkpoint (the trainer says `checkpoint N saved`) or leave the previous ones
intact: the next run of the same command resumes from the newest checkpoint without finding a
damaged one. After the last stop the run finishes. The last line is one JSON object:

    python benchmarks/term_storm.py --terms=10
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import random
import re
import signal
import subprocess
import sys
import tempfile
import time

from storm_job import (
    REPO, WARM_START_STEPS, job_env, kill_group, left_in_session, records, rl_records,
    saves_in_progress, start, train_command,
)

KINDS = ("startup", "warm_start", "evaluation", "step", "save")
TRACEBACK = "Traceback (most recent call last)"
_WARM = "sft/actor/loss"  # in a warm-start record


def rl_steps(workdir: pathlib.Path) -> int:
    return max([r["step"] for r in rl_records(workdir)], default=-1)


def wait_for(kind: str, proc: subprocess.Popen, log: pathlib.Path, workdir: pathlib.Path,
             rng: random.Random, timeout_s: float) -> bool:
    """Waits for a moment of `kind`; False if the run ended (or timed out) before it came."""
    deadline = time.monotonic() + timeout_s
    start_step = rl_steps(workdir)
    warm_records = sum(_WARM in r for r in records(workdir))
    after = time.monotonic() + rng.uniform(0.5, 8.0)
    before = saves_in_progress(workdir)

    def came() -> bool:
        match kind:
            case "startup":
                return time.monotonic() > after
            case "warm_start":
                return sum(_WARM in r for r in records(workdir)) > warm_records
            case "evaluation":  # the warm start's end checkpoint written, no evaluation yet
                return ((workdir / f"checkpoints/warm_start/{WARM_START_STEPS}").is_dir()
                        and "held-out before" not in log.read_text())
            case "step":
                return rl_steps(workdir) > start_step
            case "save":
                return bool(saves_in_progress(workdir) - before)

    while not came():
        if proc.poll() is not None or time.monotonic() > deadline:
            return False
        time.sleep(0.005)
    if kind == "step":
        time.sleep(rng.uniform(0.0, 0.5))
    return proc.poll() is None


def outcome(log: pathlib.Path) -> dict:
    text = log.read_text()
    resumed = re.search(r"resuming (?:the warm start )?from checkpoint (\d+)|the warm start "
                        r"is done: its checkpoint (\d+)", text)
    saved = re.search(r"checkpoint (\d+) saved in", text)
    return {"resumed_from": int(resumed.group(1) or resumed.group(2)) if resumed else None,
            "saved": int(saved.group(1)) if saved else None,
            "damaged": len(re.findall(r"warning: checkpoint \S+ cannot be restored", text)),
            "tracebacks": text.count(TRACEBACK),
            "errors": [line for line in text.splitlines()
                       if line.startswith(("error:", "stopped:"))]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--terms", type=int, default=10)
    parser.add_argument("--steps", type=int, default=40, help="RL steps of the job")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--grace", type=float, default=60.0, help="seconds from SIGTERM to exit")
    parser.add_argument("--workdir", default="", help="default: a new temporary directory")
    parser.add_argument("--run_timeout", type=float, default=900.0)
    args = parser.parse_args()
    root = pathlib.Path(args.workdir or tempfile.mkdtemp(prefix="jaxrlhf-term-storm-"))
    (root / "logs").mkdir(parents=True, exist_ok=True)
    env = job_env(root)
    rng, work = random.Random(args.seed), root / "work"
    command = train_command(work, args.steps, reward_workers=2, checkpoint_every=2)
    began, rows, attempts = time.monotonic(), [], 0
    while len(rows) < args.terms:
        # The phases before RL come once, in order (a stop in the evaluation saves checkpoint
        # 0, after which a rerun goes straight to RL); then startup, step and save in turn.
        kind = (KINDS[len(rows)] if len(rows) < 3 else
                ("startup", "step", "save")[len(rows) % 3])
        attempts += 1
        log = root / "logs" / f"run_{attempts:02d}.log"
        proc = start(command, env, log)
        if not wait_for(kind, proc, log, work, rng, args.run_timeout):
            if proc.poll() is None:
                kill_group(proc)
                sys.exit(f"run {attempts} made no progress in {args.run_timeout:.0f} s ({log})")
            row = {"run": attempts, "kind": kind, "moment_missed": True, "exit": proc.returncode,
                   **outcome(log)}
            print(json.dumps(row), flush=True)
            if proc.returncode != 0 or row["tracebacks"]:
                sys.exit(f"run {attempts} failed (exit {proc.returncode}); see {log}")
            break  # the job finished before the moment came
        t0 = time.monotonic()
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=args.grace)
            killed = False
        except subprocess.TimeoutExpired:
            kill_group(proc)
            killed = True
        leftover = left_in_session(proc.pid)
        row = {"run": attempts, "kind": kind, "exit": proc.returncode,
               "exit_seconds": round(time.monotonic() - t0, 1), "killed_after_grace": killed,
               "processes_left": len(leftover), **outcome(log)}
        rows.append(row)
        print(json.dumps(row), flush=True)

    final_log = root / "logs" / "final.log"
    final = subprocess.run(command, cwd=REPO, env=env, stdout=final_log.open("w"),
                           stderr=subprocess.STDOUT, timeout=args.run_timeout)
    last = outcome(final_log)
    reruns = rows[1:] + [last]
    # The checkpoint each stop left (saved, or the newest one before it) is where the next run
    # that gets as far as its start resumes (a run stopped during its startup never gets
    # there; the one after it must); before any checkpoint, runs start afresh.
    newest, started, resumed_right = None, 0, 0
    for row, rerun in zip(rows, reruns):
        newest = row["saved"] if row["saved"] is not None else newest
        if rerun["resumed_from"] is None and rerun.get("kind") == "startup":
            continue  # stopped before it said where it resumes
        started += 1
        resumed_right += rerun["resumed_from"] == newest and not rerun["damaged"]
    print(json.dumps({
        "terms": len(rows), "by_kind": {k: sum(r["kind"] == k for r in rows) for k in KINDS},
        "saved": sum(r["saved"] is not None for r in rows),
        "kept_previous": sum(r["saved"] is None for r in rows),
        "max_exit_seconds": max((r["exit_seconds"] for r in rows), default=None),
        "killed_after_grace": sum(r["killed_after_grace"] for r in rows),
        "processes_left": sum(r["processes_left"] for r in rows),
        "reruns_started": started, "reruns_resumed_newest": resumed_right,
        "damaged_found": sum(r["damaged"] for r in reruns),
        "tracebacks": sum(r["tracebacks"] for r in rows) + last["tracebacks"],
        "errors": sum(len(r["errors"]) for r in rows) + len(last["errors"]),
        "final_exit": final.returncode, "workdir": str(root),
        "seconds": round(time.monotonic() - began)}))


if __name__ == "__main__":
    main()
