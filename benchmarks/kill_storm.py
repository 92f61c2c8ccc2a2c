"""Kill storm: SIGKILL the real training command at random moments, rerun it, compare the end.

An uninterrupted reference run of `python -m jaxrlhf.train` goes first. Then the same command
runs in a second workdir and is killed (SIGKILL to its whole process group: trainer and reward
workers) `--kills` times, each time at a moment of one of three kinds, in turn:

- `startup`: a random moment in the first seconds (imports, compilation, the warm start);
- `step`: a random moment inside an RL step, after the run made progress past its resume point;
- `save`: while an asynchronous checkpoint is being written (orbax's temporary directory exists).

Every rerun is the same command; its output says where it resumed and whether it found a damaged
checkpoint. After the last kill the run finishes, and its RL metrics and final evaluation must
equal the reference run's. The last line is one JSON object:

    python benchmarks/kill_storm.py --kills=20
"""

from __future__ import annotations

import argparse
import json
import pathlib
import random
import re
import signal
import subprocess
import sys
import tempfile
import time

from storm_job import (
    REPO, job_env, kill_group, rl_records, saves_in_progress, start, train_command,
)

KINDS = ("startup", "step", "save")
# Metrics that measure the machine or count since process start, not the training.
_SYSTEM_SUFFIXES = ("_seconds", "_bytes", "recompiles", "tokens_per_second")


def _command(workdir: pathlib.Path, steps: int) -> list[str]:
    """Checkpointing every step, so that kills often meet a save."""
    return train_command(workdir, steps, reward_workers=1, checkpoint_every=1)


def kill_moment(kind: str, proc: subprocess.Popen, workdir: pathlib.Path, rng: random.Random,
                step_seconds: float, timeout_s: float) -> bool:
    """Waits for a moment of `kind`; False if the run ended (or timed out) before it came."""
    deadline = time.monotonic() + timeout_s
    if kind == "startup":
        end = time.monotonic() + rng.uniform(0.5, 8.0)
        while time.monotonic() < end:
            if proc.poll() is not None:
                return False
            time.sleep(0.01)
        return True
    if kind == "step":
        start = max([r["step"] for r in rl_records(workdir)], default=-1)
        target = start + rng.randint(1, 3)
        while max([r["step"] for r in rl_records(workdir)], default=-1) < target:
            if proc.poll() is not None or time.monotonic() > deadline:
                return False
            time.sleep(0.01)
        time.sleep(rng.uniform(0.0, step_seconds))
        return proc.poll() is None
    before = saves_in_progress(workdir)  # left by earlier kills
    while not saves_in_progress(workdir) - before:  # "save": a new one is being written
        if proc.poll() is not None or time.monotonic() > deadline:
            return False
        time.sleep(0.002)
    return True


def outcome_of(log: pathlib.Path) -> dict:
    """What a run's output says about its start: resumed step, damaged checkpoints, errors."""
    text = log.read_text()
    resumed = re.search(r"resuming from checkpoint (\d+)", text)
    return {"resumed_from": int(resumed.group(1)) if resumed else None,
            "damaged": len(re.findall(r"warning: checkpoint \S+ cannot be restored", text)),
            "errors": [line for line in text.splitlines() if line.startswith("error:")]}


def differing_steps(got: list[dict], want: list[dict]) -> list[str]:
    """Step/key pairs where two runs' RL records differ (machine-timing metrics excepted)."""
    if [r["step"] for r in got] != [r["step"] for r in want]:
        return [f"steps {[r['step'] for r in got]} != {[r['step'] for r in want]}"]
    diffs = []
    for g, w in zip(got, want):
        for key in w:
            if key.startswith("time/") or key.endswith(_SYSTEM_SUFFIXES):
                continue
            if key not in g or (g[key] != w[key] if isinstance(w[key], list)  # rows
                                else abs(g[key] - w[key]) > 1e-6):
                diffs.append(f"step {w['step']} {key}: {g.get(key)} != {w[key]}")
    return diffs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kills", type=int, default=20)
    parser.add_argument("--steps", type=int, default=40, help="RL steps of the job")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workdir", default="", help="default: a new temporary directory")
    parser.add_argument("--run_timeout", type=float, default=900.0)
    args = parser.parse_args()
    root = pathlib.Path(args.workdir or tempfile.mkdtemp(prefix="jaxrlhf-storm-"))
    root.mkdir(parents=True, exist_ok=True)
    env = job_env(root)
    rng = random.Random(args.seed)

    began = time.monotonic()
    reference = subprocess.run(_command(root / "reference", args.steps), cwd=REPO, env=env,
                               capture_output=True, text=True, timeout=args.run_timeout)
    if reference.returncode != 0:
        sys.exit(f"the reference run failed:\n{reference.stderr[-3000:]}")
    reference_seconds = time.monotonic() - began
    step_seconds = reference_seconds / (args.steps + 20)  # RL and warm-start steps, roughly
    print(f"reference run: {reference_seconds:.0f} s", flush=True)

    work, logs = root / "storm", root / "logs"
    logs.mkdir(exist_ok=True)
    command = _command(work, args.steps)
    kills, attempts, rows = 0, 0, []
    while kills < args.kills:
        kind = KINDS[attempts % len(KINDS)]
        attempts += 1
        log = logs / f"run_{attempts:02d}.log"
        before = saves_in_progress(work)
        proc = start(command, env, log)
        if kill_moment(kind, proc, work, rng, step_seconds, args.run_timeout):
            kill_group(proc)
            kills += 1
            was_saving = bool(saves_in_progress(work) - before)
        else:
            if proc.poll() is None:  # timed out waiting: a hang
                kill_group(proc)
                sys.exit(f"run {attempts} made no progress in {args.run_timeout:.0f} s ({log})")
            was_saving = False
        row = {"run": attempts, "kind": kind, "killed": proc.returncode == -signal.SIGKILL,
               "during_save": was_saving, "rl_steps_logged": len(rl_records(work)),
               **outcome_of(log)}
        rows.append(row)
        print(json.dumps(row), flush=True)
        if row["errors"] or (not row["killed"] and proc.returncode != 0):
            sys.exit(f"run {attempts} failed (exit {proc.returncode}); see {log}")
        if not row["killed"]:
            break  # the job finished before the moment came: the storm is over

    final_log = logs / "final.log"
    final = subprocess.run(command, cwd=REPO, env=env, stdout=final_log.open("w"),
                           stderr=subprocess.STDOUT, timeout=args.run_timeout)
    last = final_log.read_text().strip().splitlines()
    summary, want = json.loads(last[-1]), json.loads(reference.stdout.strip().splitlines()[-1])
    diffs = differing_steps(rl_records(work), rl_records(root / "reference"))
    resumed_runs = [r for r in rows[1:] + [outcome_of(final_log)] if r["resumed_from"]]
    print(json.dumps({
        "kills": kills, "kills_during_save": sum(r["during_save"] for r in rows),
        "kills_by_kind": {k: sum(r["kind"] == k and r["killed"] for r in rows) for k in KINDS},
        "reruns_resumed": len(resumed_runs), "damaged_checkpoints_skipped":
            sum(r["damaged"] for r in rows) + outcome_of(final_log)["damaged"],
        "failed_loads": sum(bool(r["errors"]) for r in rows) + (final.returncode != 0),
        "final_exit": final.returncode, "metrics_equal_reference": not diffs,
        "accuracy_after": summary.get("accuracy_after"),
        "reference_accuracy_after": want.get("accuracy_after"),
        "differences": diffs[:10], "workdir": str(root),
        "seconds": round(time.monotonic() - began)}))


if __name__ == "__main__":
    main()
