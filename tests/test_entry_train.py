"""The README's first command: the real `python -m jaxrlhf.train` main on the tiny PPO config,
with 20 of its 40 RL steps.

It must learn (held-out accuracy after RL at least double before, or 30 points higher), write
its metrics and timelines, and end with one JSON line. Half the steps keep the same warm start
(accuracy before: 0.28 on the CPU) and still learn far past the bar (0.94 after 20 steps, 0.98
after 40), for 18% less CPU time: the steps themselves and a recompile (a new packed-row count)
that the longer run meets.
"""

import json
import subprocess
import sys

import pytest


@pytest.mark.entry
def test_ppo_tiny_main_learns(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "jaxrlhf.train", "--config=configs/ppo_tiny.py",
         "--config.steps=20", f"--workdir={tmp_path}"],
        capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    before, after = summary["accuracy_before"], summary["accuracy_after"]
    assert after >= 2 * before or after >= before + 0.30, summary
    assert "MFC" in result.stdout and "actor_gen" in result.stdout  # the time table
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    rl_rows = [r for r in rows if "reward" in r]
    assert [r["step"] for r in rl_rows] == list(range(20))
    for key in ("reward", "actor/kl", "actor/entropy", "actor/response_length",
                "throughput/tokens_per_second", "time/actor_gen", "time/host_blocked_seconds",
                "actor/realloc_bytes", "recompiles"):
        assert key in rl_rows[-1], key
    assert (tmp_path / "timeline_0.png").stat().st_size > 0
    assert list((tmp_path / "tensorboard").iterdir())
