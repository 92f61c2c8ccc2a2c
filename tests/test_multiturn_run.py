"""configs/grpo_multiturn_tiny.py's smoke variant through the run stack, as
`python -m jaxrlhf.train --config=configs/grpo_multiturn_tiny.py:smoke` runs it (slow: its
compiles take about a minute on two loaded cores; the machinery is tested in the default suite
by tests/test_multiturn.py)."""

import json
import math

import pytest

from configs import grpo_multiturn_tiny
from jaxrlhf.run import rl
from jaxrlhf.run.check import check_config


@pytest.mark.slow
def test_multiturn_config_runs_its_smoke_variant(tmp_path):
    summary = rl.run(check_config(grpo_multiturn_tiny.get_config("smoke"), str(tmp_path)))
    assert summary["steps"] == 2 and not summary["interrupted"], summary
    # held-out: greedy trajectories with the environment (an untrained model never succeeds)
    assert summary["accuracy_before"] == 0.0 and summary["reward_before"] == 0.0
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "reward" in r]
    assert [r["step"] for r in steps] == [0, 1]
    for record in steps:
        for key in ("reward", "actor/loss", "actor/kl", "actor/turns", "actor/tool_error_rate"):
            assert math.isfinite(record[key]), (key, record.get(key))
        assert 1 <= record["actor/turns"] <= 3
