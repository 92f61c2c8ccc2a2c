"""A stop signal during a multi-turn rollout whose environment is slow (issue: Reliability IV):
the real `python -m jaxrlhf.train` on multiturn_tiny's smoke job, its environment made to take
5 s a turn (inside env.timeout=10) with one worker, so the step under way holds minutes of
environment calls. SIGTERM to the process group during them stops the run within 60 s: the
step is abandoned, its environment calls cancelled, the previous checkpoint kept; the same
command then resumes there and repeats that step, and the ones after, exactly as an
uninterrupted run computes them. (Before, the stop waited for the whole step: 121 s in the
probe.)
"""

import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest

from test_reliability_signals import _rl_steps, _wait
from test_resume import _assert_same_steps, _rl_records

REPO = pathlib.Path(__file__).resolve().parent.parent
ENV = f"{REPO / 'tests/fixtures/envs.py'}:SlowLookup"
STEPS, STOPPED_IN = 4, 2  # SIGTERM during step 2's rollout
DELAY_S = 5.0


def _command(workdir: pathlib.Path) -> list[str]:
    return [sys.executable, "-m", "jaxrlhf.train", "--config=configs/multiturn_tiny.py:smoke",
            f"--config.steps={STEPS}", "--config.warm_start.sft_steps=0",
            "--config.eval.max_prompts=0", "--config.checkpoint.every=1",
            f"--config.env.name={ENV}", "--config.env.workers=1", "--config.env.timeout=10",
            f"--workdir={workdir}"]


def _run(workdir: pathlib.Path, control: pathlib.Path, log: pathlib.Path) -> subprocess.Popen:
    """The job in a session of its own; `control` is its environment's directory (DELAY)."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "SLOW_ENV_DIR": str(control)}
    return subprocess.Popen(_command(workdir), cwd=REPO, env=env, stdout=log.open("w"),
                            stderr=subprocess.STDOUT, start_new_session=True)


def _finish(proc: subprocess.Popen, log: pathlib.Path, seconds: float = 600) -> str:
    try:
        proc.wait(timeout=seconds)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    out = log.read_text()
    assert proc.returncode == 0, out[-3000:]
    return out


@pytest.mark.slow  # three runs of the multi-turn smoke job (about 2 minutes on 2 loaded cores)
def test_sigterm_in_a_slow_environment_abandons_the_step_and_the_rerun_repeats_it(tmp_path):
    fast, slow = tmp_path / "fast", tmp_path / "slow"
    fast.mkdir()
    slow.mkdir()
    want = tmp_path / "want"
    _finish(_run(want, fast, tmp_path / "want.log"), tmp_path / "want.log")

    work, log = tmp_path / "work", tmp_path / "first.log"
    first = _run(work, slow, log)
    try:
        _wait(first, log, lambda: STOPPED_IN - 1 in _rl_steps(work))
        saved = work / "checkpoints" / str(STOPPED_IN) / "commit_success.txt"
        _wait(first, log, saved.exists)
        (slow / "DELAY").write_text(str(DELAY_S))  # step 2's environment calls: 5 s each
        _wait(first, log, (slow / "CALLS").exists)
        kept = saved.stat().st_mtime_ns
        sent = time.monotonic()
        os.killpg(first.pid, signal.SIGTERM)
        first.wait(timeout=60)
        seconds = time.monotonic() - sent
    finally:
        if first.poll() is None:
            os.killpg(first.pid, signal.SIGKILL)
            first.wait()
    out = log.read_text()
    calls = len((slow / "CALLS").read_text().split())
    print(f"stopped {seconds:.1f} s after SIGTERM; {calls} slow environment call(s) started "
          f"of the step's {8 * 4}")
    assert first.returncode == 0, out[-3000:]
    assert seconds < 60
    assert "Traceback" not in out, out[-3000:]
    assert f"RL step {STOPPED_IN} abandoned (its environment calls cancelled)" in out
    assert (f"interrupted after RL step {STOPPED_IN - 1}: checkpoint {STOPPED_IN} saved in "
            f"{work / 'checkpoints'}") in out
    assert saved.stat().st_mtime_ns == kept  # the previous checkpoint, as it was
    assert not (work / "checkpoints" / str(STOPPED_IN + 1)).exists()
    assert _rl_steps(work) == list(range(STOPPED_IN))
    assert calls <= 2  # the one running when the stop came (and at most one more): cancelled

    (slow / "DELAY").unlink()
    rerun = _finish(_run(work, slow, tmp_path / "rerun.log"), tmp_path / "rerun.log")
    assert f"resuming from checkpoint {STOPPED_IN} in" in rerun  # the same run (fingerprint)
    _assert_same_steps(_rl_records(work), _rl_records(want))
