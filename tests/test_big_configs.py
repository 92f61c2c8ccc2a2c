"""The headline configs are honest: `ppo_7b` plans for its 2 × 8 cluster file and `ppo_70b` for
16 × 8, both need every model's directory and the tokenizer (one-line errors naming the key
otherwise, and the cluster file when the job has another device count), and their `:smoke`
variants run the same graph, placement kind and code path end to end on the CPU: every role
loaded from its own tiny Hugging Face directory, the reward model's inference call, the
planner's searched plan, the RL loop with its before/after evaluation.
"""

import importlib

import numpy as np
import pytest

from hf_fixtures import make_tiny_hf_model
from jaxrlhf.data.tokenizer import BYTE_VOCAB_SIZE
from jaxrlhf.mfc import Role
from jaxrlhf.plan.cluster import load_cluster
from jaxrlhf.run import rl
from jaxrlhf.run.check import check_config
from jaxrlhf.spec import ConfigError

SMALL = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2)


def load(name, arg=None):
    return importlib.import_module(f"jaxrlhf.configs.{name}").get_config(arg)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    """Tiny directories: an actor LM, and classifiers of its size and of a smaller one."""
    root = tmp_path_factory.mktemp("big")
    vocab = dict(vocab_size=BYTE_VOCAB_SIZE)
    return {
        "actor": make_tiny_hf_model(root / "actor", "llama", seed=1, **vocab)[0],
        "same": make_tiny_hf_model(root / "same", "llama", seq_cls=True, seed=2, **vocab)[0],
        "small": make_tiny_hf_model(root / "small", "qwen2", seq_cls=True, seed=3, **vocab,
                                    **SMALL)[0],
    }


def with_paths(config, dirs, critic: str):
    for role, key in (("actor", "actor"), ("ref", "actor"), ("critic", critic),
                      ("reward", critic)):
        config.models[role].path = str(dirs[key])
    return config


@pytest.mark.parametrize("name,cluster,devices", [("ppo_7b", "meshes/a100_2x8.py", 16),
                                                  ("ppo_70b", "meshes/a100_16x8.py", 128)])
def test_big_configs_name_what_is_missing(name, cluster, devices, dirs, tmp_path):
    config = load(name)
    assert config.placement.cluster == cluster
    assert load_cluster(cluster).num_devices == devices
    with pytest.raises(ConfigError, match="^tokenizer: empty"):
        check_config(config, str(tmp_path))
    config.tokenizer = "byte"
    with pytest.raises(ConfigError, match=r"^models.actor.path: empty"):
        check_config(config, str(tmp_path))
    with_paths(config, dirs, "small")
    config.models.reward.path = ""
    with pytest.raises(ConfigError, match=r"^models.reward.path: empty"):
        check_config(config, str(tmp_path))
    with_paths(config, dirs, "small")
    with pytest.raises(ConfigError, match=rf"^placement.cluster='{cluster}': the plan is made "
                                          rf"for its .* = {devices} devices, but this job has 8"):
        check_config(config, str(tmp_path))


# ppo_70b with a smaller critic and reward model (ReaL's graph), ppo_7b with a same-sized one
# (the longer run: -m slow).
@pytest.mark.parametrize("name,critic", [pytest.param("ppo_7b", "same", marks=pytest.mark.slow),
                                         ("ppo_70b", "small")])
def test_smoke_variant_runs_the_big_graph(name, critic, dirs, tmp_path):
    full, config = load(name), with_paths(load(name, "smoke"), dirs, critic)
    assert (config.algorithm, config.reward.kind, config.placement.kind,
            config.require_model_paths) == (full.algorithm, full.reward.kind,
                                            full.placement.kind, full.require_model_paths)
    job = check_config(config, str(tmp_path))
    models = job.spec.models
    assert models[Role.REWARD].config.hidden_size == (64 if critic == "same" else 32)
    assert not job.spec.graph.mfc("reward").host  # the reward model's own inference call
    summary = rl.run(job)
    assert summary["steps"] == 2 and not summary["interrupted"]
    assert 0.0 <= summary["accuracy_after"] <= 1.0
    rows = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert len([r for r in rows if '"reward"' in r]) == 2
    assert np.isfinite(summary["seconds"])


def test_qwen3_smoke_variant_runs_its_graph(dirs, tmp_path):
    """grpo_qwen3_8b:smoke: GRPO with the math reward and a searched plan, from HF
    directories of the actor and the reference, 2 steps on the CPU cluster file."""
    full, config = load("grpo_qwen3_8b"), load("grpo_qwen3_8b", "smoke")
    for role in ("actor", "ref"):
        config.models[role].path = str(dirs["actor"])
    assert (config.algorithm, config.reward.function, config.placement.kind) == (
        full.algorithm, full.reward.function, full.placement.kind)
    summary = rl.run(check_config(config, str(tmp_path)))
    assert summary["steps"] == 2 and not summary["interrupted"], summary
    rows = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert len([r for r in rows if '"reward"' in r]) == 2
