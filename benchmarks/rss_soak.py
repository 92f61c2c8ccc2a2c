"""Host-memory soak: the real training command for hundreds of RL steps, its RSS sampled.

Runs `python -m jaxrlhf.train` on the tiny PPO job for `--steps` RL steps and samples, from
/proc, the resident set of the trainer process and of its whole process tree (reward workers
included) as RL steps are logged. Growth is measured from the step `--settle` to the last step: by then
compilation, allocator pools and the checkpointer's first saves (orbax's thread pools and
buffers: ~120 MiB once, measured with saves every 100 steps) have reached their working size,
and a leak of a few KiB per step or per save shows as growth over hundreds of steps. The last line is one JSON object:

    python benchmarks/rss_soak.py --steps=500
"""

from __future__ import annotations

import argparse
import json
import pathlib
import subprocess
import sys
import tempfile
import time

REPO = pathlib.Path(__file__).resolve().parent.parent
PAGE_KIB = 4


def rss_kib(pid: int) -> int:
    """Resident set of one process in KiB (0 if it is gone)."""
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * PAGE_KIB
    except (FileNotFoundError, ProcessLookupError):
        return 0


def tree_pids(root: int) -> list[int]:
    """`root` and its descendants, from /proc's parent links."""
    parents = {}
    for stat in pathlib.Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (FileNotFoundError, ProcessLookupError, IndexError):
            continue
        parents[int(stat.parent.name)] = int(fields[1])
    found, frontier = [root], [root]
    while frontier:
        frontier = [pid for pid, parent in parents.items() if parent in frontier]
        found += frontier
    return found


def logged_rl_steps(metrics: pathlib.Path) -> int:
    """RL step records in metrics.jsonl so far."""
    if not metrics.exists():
        return 0
    return sum('"reward"' in line for line in metrics.read_text().splitlines())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--settle", type=int, default=50,
                        help="RL step from which growth is measured")
    parser.add_argument("--workdir", default="", help="default: a new temporary directory")
    args = parser.parse_args()
    workdir = pathlib.Path(args.workdir or tempfile.mkdtemp(prefix="jaxrlhf-rss-"))
    workdir.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "jaxrlhf.train", "--config=configs/ppo_tiny.py",
               f"--config.steps={args.steps}", "--config.warm_start.sft_steps=20",
               "--config.checkpoint.every=25", f"--workdir={workdir}"]
    began = time.monotonic()
    proc = subprocess.Popen(command, cwd=REPO, stdout=subprocess.DEVNULL,
                            stderr=(workdir / "stderr.log").open("w"))
    samples = []  # (RL steps logged, trainer KiB, tree KiB)
    last_step = -1
    while proc.poll() is None:
        step = logged_rl_steps(workdir / "metrics.jsonl")
        if step != last_step:
            samples.append((step, rss_kib(proc.pid), sum(map(rss_kib, tree_pids(proc.pid)))))
            last_step = step
            if step % 50 == 0:
                print(f"step {step}: trainer {samples[-1][1] / 1024:.0f} MiB, "
                      f"tree {samples[-1][2] / 1024:.0f} MiB", flush=True)
        time.sleep(0.05)
    if proc.returncode != 0:
        sys.exit(f"the run failed (exit {proc.returncode}); see {workdir / 'stderr.log'}")
    # The last sample before the process exits (after the final evaluation it may be gone).
    settled = next(s for s in samples if s[0] >= args.settle)
    end = max((s for s in samples if s[1] > 0), key=lambda s: s[0])
    print(json.dumps({
        "rl_steps": args.steps, "settle_step": settled[0], "end_step": end[0],
        "trainer_rss_mib": [round(settled[1] / 1024, 1), round(end[1] / 1024, 1)],
        "trainer_growth_percent": round(100 * (end[1] - settled[1]) / settled[1], 2),
        "tree_rss_mib": [round(settled[2] / 1024, 1), round(end[2] / 1024, 1)],
        "tree_growth_percent": round(100 * (end[2] - settled[2]) / settled[2], 2),
        "trainer_rss_max_mib": round(max(s[1] for s in samples) / 1024, 1),
        "seconds": round(time.monotonic() - began), "workdir": str(workdir)}))


if __name__ == "__main__":
    main()
