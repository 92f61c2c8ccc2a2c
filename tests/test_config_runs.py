"""Every shipped RL config's own job runs in the default suite: its `:smoke` variant (the same
graph, placement and code path as the full config, 2 steps) through the run stack exactly as
`python -m jaxrlhf.train --config=configs/NAME.py:smoke` runs it (`check_config` = the entry's
`prepare(run_spec(config))`, then `rl.run`).

Where the other configs run: ppo_tiny's full run in tests/test_entry_train.py, ppo_7b:smoke and
ppo_70b:smoke in tests/test_big_configs.py, sft_tiny, dpo_tiny and rw_tiny's smoke runs in
tests/test_offline_resume.py. The learning runs of these algorithms are slow-marked
(tests/test_entry_algorithms.py). The runs share the test session's persistent compilation cache
(tests/conftest.py): programs such as the warm start's and the evaluation's are the same across
the tiny configs.
"""

import importlib
import json
import math

import pytest

from jaxrlhf.run import rl
from jaxrlhf.run.check import check_config

# config, the per-step metrics its algorithm must log (beyond the reward)
RUNS = {
    "grpo_tiny": ("actor/loss", "actor/kl"),
    "remax_tiny": ("actor/loss",),
    "safe_rlhf_tiny": ("actor/loss", "critic/loss", "actor/cost", "actor/lambda"),
    "grpo_bench_cpu": ("actor/loss", "actor/kl"),
}


# The benchmark's config is the longest smoke run: -m slow.
@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n == "grpo_bench_cpu"
                                  else n for n in RUNS])
def test_shipped_config_runs_its_smoke_variant(name, tmp_path):
    config = importlib.import_module(f"jaxrlhf.configs.{name}").get_config("smoke")
    summary = rl.run(check_config(config, str(tmp_path)))
    assert summary["steps"] == 2 and not summary["interrupted"], summary
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "reward" in r]
    assert [r["step"] for r in steps] == [0, 1]
    for record in steps:
        for key in ("reward", *RUNS[name]):
            assert math.isfinite(record[key]), (name, key, record.get(key))
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir() if p.name.isdigit()) == [
        "2"]
