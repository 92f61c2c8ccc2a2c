"""The multi-turn configs through the run stack, as `python -m jaxrlhf.train` runs them (slow:
their compiles take about a minute on two loaded cores, their learning runs minutes; the
machinery is tested in the default suite by tests/test_multiturn.py):
configs/tool_math_tiny.py (the calculator) and configs/multiturn_tiny.py (facts asked for
turn by turn)."""

import json
import math

import pytest

from jaxrlhf.configs import multiturn_tiny, tool_math_tiny
from jaxrlhf.run import rl
from jaxrlhf.run.check import check_config


def _step_records(workdir):
    records = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in records if "reward" in r]


@pytest.mark.slow
def test_multiturn_config_runs_its_smoke_variant(tmp_path):
    summary = rl.run(check_config(tool_math_tiny.get_config("smoke"), str(tmp_path)))
    assert summary["steps"] == 2 and not summary["interrupted"], summary
    # held-out: greedy trajectories with the environment (2 warm-start steps never succeed)
    assert summary["accuracy_before"] == 0.0 and summary["reward_before"] == 0.0
    steps = _step_records(tmp_path)
    assert [r["step"] for r in steps] == [0, 1]
    for record in steps:
        for key in ("reward", "actor/loss", "actor/kl", "actor/turns", "actor/tool_error_rate"):
            assert math.isfinite(record[key]), (key, record.get(key))
        assert 1 <= record["actor/turns"] <= 3


@pytest.mark.slow
def test_ppo_over_trajectories_runs(tmp_path):
    """multiturn_tiny's smoke variant with algorithm=ppo: the critic values the policy's
    tokens of the trajectories, trained beside the actor."""
    config = multiturn_tiny.get_config("smoke")
    config.algorithm = "ppo"
    summary = rl.run(check_config(config, str(tmp_path)))
    assert summary["steps"] == 2 and not summary["interrupted"], summary
    for record in _step_records(tmp_path):
        for key in ("reward", "actor/loss", "critic/loss", "actor/turns"):
            assert math.isfinite(record[key]), (key, record.get(key))


@pytest.mark.slow
def test_multiturn_config_learns_to_call_the_calculator_right(tmp_path):
    """The warm start's demonstrations subtract 60% of the time, so its greedy trajectories
    fail; GRPO over trajectories moves it to adding (about 2.5 minutes on two cores)."""
    summary = rl.run(check_config(tool_math_tiny.get_config(), str(tmp_path)))
    assert summary["accuracy_before"] <= 0.4, summary
    assert summary["accuracy_after"] >= 0.8, summary
    assert summary["accuracy_after"] - summary["accuracy_before"] >= 0.3, summary
    assert summary["turns_after"] >= 1.5 and summary["tool_error_rate_after"] <= 0.1, summary


@pytest.mark.slow
def test_multiturn_config_learns_to_ask_for_the_second_fact(tmp_path):
    """The warm start's demonstrations take the first reply for the answer 60% of the time,
    so its greedy trajectories stop after one question and fail; GRPO over trajectories moves
    it to asking for the second fact and answering its value."""
    summary = rl.run(check_config(multiturn_tiny.get_config(), str(tmp_path)))
    assert summary["accuracy_before"] <= 0.4, summary
    assert summary["accuracy_after"] >= 0.8, summary
    assert summary["accuracy_after"] - summary["accuracy_before"] >= 0.3, summary
    assert summary["turns_after"] >= 2.5 and summary["tool_error_rate_after"] <= 0.1, summary
    steps = _step_records(tmp_path)
    assert all(math.isfinite(r["actor/turns"]) and math.isfinite(r["actor/tool_error_rate"])
               for r in steps)


@pytest.mark.slow
def test_async_multiturn_keeps_every_trained_token_within_the_staleness_bound(tmp_path):
    """multiturn_tiny's smoke variant under asynchronous RL (η = 1, one process): batch 1 is
    generated while update 0 runs, so its trajectories' first tokens are a version old; no
    trained token is older than η (the loop asserts it from the per-token versions before
    every update), and the decoupled objective weighs each token by its own behaviour
    log-prob."""
    config = multiturn_tiny.get_config("smoke")
    config.async_rl.max_staleness = 1
    summary = rl.run(check_config(config, str(tmp_path)))
    assert summary["steps"] == 2 and not summary["interrupted"], summary
    steps = _step_records(tmp_path)
    assert [r["step"] for r in steps] == [0, 1]
    assert [r["async/staleness_max"] for r in steps] == [0.0, 1.0]
    for record in steps:
        assert math.isfinite(record["actor/behav_imp_weight"]) and record["actor/turns"] >= 1
        fracs = [record[f"async/staleness_frac_{k}"] for k in range(2)]
        assert math.isclose(sum(fracs), 1.0, rel_tol=1e-6), fracs
