"""Every shipped RL config's own job runs in the default suite: its `:smoke` variant (the same
graph, placement and code path as the full config, 2 steps) through the run stack exactly as
`python -m jaxrlhf.train --config=configs/NAME.py:smoke` runs it (`check_config` = the entry's
`prepare(run_spec(config))`, then `rl.run`).

Where the other configs run: ppo_tiny's full run in tests/test_entry_train.py, ppo_7b:smoke and
ppo_70b:smoke in tests/test_big_configs.py, sft_tiny, dpo_tiny and rw_tiny's smoke runs in
tests/test_offline_resume.py, cispo_tiny's in tests/test_cispo.py; the RLHF pipeline's three
stages here, in order, each from the previous stage's export. The learning runs of these algorithms are slow-marked
(tests/test_entry_algorithms.py). The runs share the test session's persistent compilation cache
(tests/conftest.py): programs such as the warm start's and the evaluation's are the same across
the tiny configs.
"""

import importlib
import json
import math

import pytest

from hf_fixtures import make_tiny_hf_model
from jaxrlhf.data.tokenizer import BYTE_VOCAB_SIZE
from jaxrlhf.run import rl
from jaxrlhf.run.check import check_config

# config, the per-step metrics its algorithm must log (beyond the reward)
RUNS = {
    "grpo_tiny": ("actor/loss", "actor/kl"),
    "remax_tiny": ("actor/loss",),
    "safe_rlhf_tiny": ("actor/loss", "critic/loss", "actor/cost", "actor/lambda"),
    "rloo_tiny": ("actor/loss",),
    "reinforce_pp_tiny": ("actor/loss",),
    "dapo_tiny": ("actor/loss", "actor/informative_group_frac"),
    "gspo_tiny": ("actor/loss",),
    "tool_math_tiny": ("actor/loss", "actor/turns", "actor/tool_error_rate"),
    "multiturn_tiny": ("actor/loss", "actor/turns", "actor/tool_error_rate"),
    "grpo_bench_cpu": ("actor/loss", "actor/kl"),
    "grpo_gemma_tiny": ("actor/loss", "actor/kl"),
    "grpo_moe_tiny": ("actor/loss", "actor/moe_balance_loss", "actor/moe_z_loss",
                      "actor/moe_min_load", "actor/routing_mismatch"),
    "grpo_qwen3_30b_a3b": ("actor/loss", "actor/kl", "actor/moe_balance_loss",
                           "actor/moe_z_loss", "actor/moe_min_load", "actor/routing_mismatch"),
}
# Configs that start every model from its own HF directory (`require_model_paths`): their smoke
# runs load a tiny random one of this family (tests/hf_fixtures.py) for each of their ROLES.
HF_FAMILIES = {"grpo_qwen3_30b_a3b": "qwen3_moe"}
# The benchmark's config is the longest smoke run, and the MoE one compiles programs no other
# config shares (its learning run: tests/test_entry_algorithms.py): -m slow. So is the
# calculator's (46 s in CI): multiturn_tiny's smoke run takes the same multi-turn path here.
# Gemma's (46 s on loaded cores) too: its model is checked against transformers in
# tests/test_gemma_mistral_hf.py (logits, and greedy tokens through the rollout engine).
# Qwen3-30B-A3B's smoke run compiles MoE programs of a searched plan (88 s on loaded cores).
SLOW_RUNS = ("grpo_bench_cpu", "grpo_moe_tiny", "tool_math_tiny", "grpo_gemma_tiny",
             "grpo_qwen3_30b_a3b")


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in SLOW_RUNS
                                  else n for n in RUNS])
def test_shipped_config_runs_its_smoke_variant(name, tmp_path):
    module = importlib.import_module(f"jaxrlhf.configs.{name}")
    config = module.get_config("smoke")
    if name in HF_FAMILIES:
        hf_dir, _ = make_tiny_hf_model(tmp_path / "hf", HF_FAMILIES[name], seed=1,
                                       vocab_size=BYTE_VOCAB_SIZE)
        for role in module.ROLES:
            config.models[role].path = str(hf_dir)
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


def test_rlhf_stages_run_their_smoke_variants_in_order(tmp_path):
    """configs/rlhf_{sft,rw,ppo}_tiny.py:smoke as their docstring runs them: SFT, its export,
    the reward model from the SFT trunk, its export, PPO from both."""
    from jaxrlhf import export
    from jaxrlhf.mfc import Role

    def stage(name: str, **paths):
        config = importlib.import_module(f"jaxrlhf.configs.{name}").get_config("smoke")
        for role, path in paths.items():
            config.models[role].path = str(path)
        summary = rl.run(check_config(config, str(tmp_path / name)))
        assert summary["steps"] == 2 and not summary["interrupted"], (name, summary)
        return summary

    stage("rlhf_sft_tiny")
    export.export(tmp_path / "rlhf_sft_tiny", tmp_path / "sft_hf")
    stage("rlhf_rw_tiny", actor=tmp_path / "sft_hf")
    export.export(tmp_path / "rlhf_rw_tiny", tmp_path / "rm_hf", Role.REWARD)
    summary = stage("rlhf_ppo_tiny", actor=tmp_path / "sft_hf", reward=tmp_path / "rm_hf")
    records = [json.loads(line) for line in
               (tmp_path / "rlhf_ppo_tiny" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "reward" in r] == [0, 1], summary
