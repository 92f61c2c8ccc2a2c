"""configs/tool_math_tiny.py's smoke variant through the run stack, as
`python -m jaxrlhf.train --config=configs/tool_math_tiny.py:smoke` runs it (slow: its
compiles take about a minute on two loaded cores; the machinery is tested in the default suite
by tests/test_multiturn.py)."""

import json
import math

import pytest

from configs import tool_math_tiny
from jaxrlhf.run import rl
from jaxrlhf.run.check import check_config


@pytest.mark.slow
def test_multiturn_config_runs_its_smoke_variant(tmp_path):
    summary = rl.run(check_config(tool_math_tiny.get_config("smoke"), str(tmp_path)))
    assert summary["steps"] == 2 and not summary["interrupted"], summary
    # held-out: greedy trajectories with the environment (2 warm-start steps never succeed)
    assert summary["accuracy_before"] == 0.0 and summary["reward_before"] == 0.0
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "reward" in r]
    assert [r["step"] for r in steps] == [0, 1]
    for record in steps:
        for key in ("reward", "actor/loss", "actor/kl", "actor/turns", "actor/tool_error_rate"):
            assert math.isfinite(record[key]), (key, record.get(key))
        assert 1 <= record["actor/turns"] <= 3


@pytest.mark.slow
def test_multiturn_config_learns_to_call_the_calculator_right(tmp_path):
    """The warm start's demonstrations subtract 60% of the time, so its greedy trajectories
    fail; GRPO over trajectories moves it to adding (about 2.5 minutes on two cores)."""
    summary = rl.run(check_config(tool_math_tiny.get_config(), str(tmp_path)))
    assert summary["accuracy_before"] <= 0.4, summary
    assert summary["accuracy_after"] >= 0.8, summary
    assert summary["accuracy_after"] - summary["accuracy_before"] >= 0.3, summary
    assert summary["turns_after"] >= 1.5 and summary["tool_error_rate_after"] <= 0.1, summary
