"""The tiny training job the storms stop (`kill_storm.py`, `term_storm.py`), and its process group.

The job is `python -m jaxrlhf.train` on `configs/ppo_tiny.py` with a short warm start and a
reward pool, run in a session of its own so that one signal to its process group reaches every
process of it (the trainer, its reward workers, the multiprocessing helpers), as `timeout`'s,
Slurm's and Kubernetes' signals do. The storms watch it through its workdir: the records of
`metrics.jsonl` and orbax's temporary directories of a save in progress.
"""

from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import sys
import time

REPO = pathlib.Path(__file__).resolve().parent.parent
WARM_START_STEPS = 20


def train_command(workdir: pathlib.Path, steps: int, *, reward_workers: int,
                  checkpoint_every: int) -> list[str]:
    """The tiny PPO job: a warm start, a reward pool, the last two checkpoints kept."""
    return [sys.executable, "-m", "jaxrlhf.train", "--config=configs/ppo_tiny.py",
            f"--config.steps={steps}", f"--config.warm_start.sft_steps={WARM_START_STEPS}",
            "--config.warm_start.batch_size=16", "--config.rollout.batch_size=16",
            "--config.data.task.num_eval=16", f"--config.reward.workers={reward_workers}",
            f"--config.checkpoint.every={checkpoint_every}", "--config.checkpoint.keep=2",
            f"--workdir={workdir}"]


def job_env(root: pathlib.Path) -> dict[str, str]:
    """The environment of every run of a storm: one compilation cache of its own under `root`,
    shared by its runs (each rerun then starts in seconds)."""
    return {**os.environ, "JAX_COMPILATION_CACHE_DIR": str(root / "jax_cache"),
            "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0"}


def start(command: list[str], env: dict[str, str], log: pathlib.Path) -> subprocess.Popen:
    """Starts `command` in a session (and process group) of its own, output to `log`."""
    return subprocess.Popen(command, cwd=REPO, env=env, start_new_session=True,
                            stdout=log.open("w"), stderr=subprocess.STDOUT)


def kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL to the whole process group of `proc` (started by `start`), then reaps it."""
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def left_in_session(sid: int, seconds: float = 5.0) -> list[str]:
    """The process ids still in session `sid` after up to `seconds` (helpers exit once the
    trainer is gone, given a moment)."""
    deadline = time.monotonic() + seconds
    while True:
        left = subprocess.run(["pgrep", "-s", str(sid)], capture_output=True,
                              text=True).stdout.split()
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.1)


def records(workdir: pathlib.Path) -> list[dict]:
    """metrics.jsonl's records (a line being written is skipped)."""
    path, rows = workdir / "metrics.jsonl", []
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                pass
    return rows


def rl_records(workdir: pathlib.Path) -> list[dict]:
    """The RL steps' records (the warm start's and evaluations' have no reward)."""
    return [r for r in records(workdir) if "reward" in r]


def saves_in_progress(workdir: pathlib.Path) -> set[str]:
    """Orbax's temporary checkpoint directories, the warm start's too: a save in progress (or
    one a kill cut short)."""
    found = set()
    for directory in (workdir / "checkpoints", workdir / "checkpoints/warm_start"):
        if directory.exists():
            found |= {str(p) for p in directory.iterdir() if "tmp" in p.name}
    return found
