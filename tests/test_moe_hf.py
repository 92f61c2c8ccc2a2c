"""Mixture-of-experts checkpoints against transformers: tiny random Qwen3MoeForCausalLM and
MixtralForCausalLM saved in the Hub's per-expert layout give our logits (fp32, 1e-4), the same
16 greedy tokens through `python -m jaxrlhf.generate`, and export back to that layout."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from safetensors import safe_open

from hf_fixtures import hf_logits, make_tiny_hf_model, padded_batch, positions_from_mask
from jaxrlhf.models import hf_io
from jaxrlhf.models.hf_config import (
    HfFamily, hf_config_to_model_config, model_config_to_hf_config,
)
from jaxrlhf.models.sizes import abstract_params
from jaxrlhf.models.transformer import Transformer
from jaxrlhf.parallel.layout import make_layout
from tests.test_generate_cli import greedy_tokens_and_hf

ATOL = 1e-4
LENGTHS, LEFT_PAD, SEQ_LEN = [7, 4, 10, 1], [True, False, True, False], 10

# (fixture family, config overrides): every layer sparse (Qwen3-MoE, Mixtral), and Qwen3-MoE
# with dense layers from decoder_sparse_step=2 (0 and 2) and mlp_only_layers (3), so only layer
# 1 is sparse, with un-normalised top-k weights.
CASES = {
    "qwen3_moe": ("qwen3_moe", {}),
    "qwen3_moe_mixed": ("qwen3_moe", dict(num_hidden_layers=4, decoder_sparse_step=2,
                                          mlp_only_layers=[3], norm_topk_prob=False)),
    "mixtral": ("mixtral", {}),
}
# Where each family's checkpoint keeps layer 0's expert 1 (the Hub's per-expert layout).
EXPERT_TENSORS = {
    "qwen3_moe": ["model.layers.1.mlp.gate.weight", "model.layers.1.mlp.experts.1.gate_proj.weight",
                  "model.layers.1.mlp.experts.1.up_proj.weight",
                  "model.layers.1.mlp.experts.1.down_proj.weight"],
    "mixtral": ["model.layers.1.block_sparse_moe.gate.weight",
                "model.layers.1.block_sparse_moe.experts.1.w1.weight",
                "model.layers.1.block_sparse_moe.experts.1.w2.weight",
                "model.layers.1.block_sparse_moe.experts.1.w3.weight"],
}


def _model(tmp_path, case):
    family, overrides = CASES[case]
    path, hf_model = make_tiny_hf_model(tmp_path, family, **overrides)
    with safe_open(path / hf_io.SINGLE_FILE, framework="numpy") as f:
        names = set(f.keys())
    assert set(EXPERT_TENSORS[family]) <= names, "fixture: not the Hub's per-expert layout"
    assert not any("gate_up_proj" in n for n in names)
    return path, hf_model


def _ours(config, params, tokens_bt, mask_bt):
    fwd = jax.jit(lambda p, t, pos, seg: Transformer(config).apply({"params": p}, t, pos, seg)[0])
    return np.asarray(fwd(params, tokens_bt, positions_from_mask(mask_bt), mask_bt))


def _assert_valid_close(ours, ref, mask_bt):
    valid = mask_bt.astype(bool)
    np.testing.assert_allclose(ours[valid], ref[valid], atol=ATOL, rtol=0)


def _batch(config):
    return padded_batch(config.vocab_size, LENGTHS, SEQ_LEN, left_pad=LEFT_PAD)


def test_config_reads_the_sparse_layers():
    family, overrides = CASES["qwen3_moe_mixed"]
    hf = make_config(family, overrides)
    config = hf_config_to_model_config(hf, dtype=jnp.float32)
    moe = config.moe
    assert (moe.num_experts, moe.top_k, moe.expert_intermediate_size) == (8, 2, 32)
    assert moe.dense_layers == (0, 2, 3) and not moe.norm_topk_prob and config.qk_norm
    exported = model_config_to_hf_config(config)
    assert exported["model_type"] == "qwen3_moe"
    assert exported["architectures"] == ["Qwen3MoeForCausalLM"]
    assert hf_config_to_model_config(exported, dtype=jnp.float32) == config
    mixtral = hf_config_to_model_config(make_config("mixtral", {}), dtype=jnp.float32)
    assert mixtral.moe.norm_topk_prob and not mixtral.qk_norm and not mixtral.moe.dense_layers
    assert mixtral.moe.expert_intermediate_size == 48 and mixtral.moe.num_experts == 4
    assert model_config_to_hf_config(mixtral)["model_type"] == "mixtral"
    assert hf_config_to_model_config(model_config_to_hf_config(mixtral),
                                     dtype=jnp.float32) == mixtral
    with pytest.raises(ValueError, match="cannot express moe"):
        model_config_to_hf_config(config, family=HfFamily.QWEN3)
    with pytest.raises(ValueError, match="Mixtral has no dense layers"):
        model_config_to_hf_config(config.replace(qk_norm=False, moe=config.moe.replace(
            norm_topk_prob=True)), family=HfFamily.MIXTRAL)
    with pytest.raises(ValueError, match="router_jitter_noise"):
        hf_config_to_model_config({**make_config("mixtral", {}), "router_jitter_noise": 0.1})


def make_config(family, overrides) -> dict:
    from hf_fixtures import tiny_hf_config

    hf = tiny_hf_config(family, **overrides).to_dict()
    hf["architectures"] = [{"qwen3_moe": "Qwen3MoeForCausalLM",
                            "mixtral": "MixtralForCausalLM"}[family]]
    return hf


@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_hf(tmp_path, case):
    path, hf_model = _model(tmp_path, case)
    config, params = hf_io.load_hf(path, dtype=jnp.float32)
    tokens_bt, mask_bt = _batch(config)
    _assert_valid_close(_ours(config, params, tokens_bt, mask_bt),
                        hf_logits(hf_model, tokens_bt, mask_bt), mask_bt)
    # The routing is not degenerate: the batch's tokens use every expert somewhere.
    _, inter = Transformer(config).apply({"params": params}, tokens_bt,
                                         positions_from_mask(mask_bt), mask_bt,
                                         mutable=["intermediates"])
    (routes_lbtk,) = inter["intermediates"]["layers"]["routes"]
    sparse = [i for i in range(config.num_layers) if i not in config.moe.dense_layers]
    used = np.unique(np.asarray(routes_lbtk)[sparse][:, mask_bt.astype(bool)])
    assert len(used) == config.moe.num_experts


@pytest.mark.devices(8)
@pytest.mark.parametrize("case", ["qwen3_moe_mixed",
                                  pytest.param("mixtral", marks=pytest.mark.slow)])
def test_export_round_trips_through_transformers(tmp_path, case):
    """Loaded onto a d2f2t2 layout, exported in shards, read back by transformers (every
    tensor equal, in the per-expert layout) and by us (bitwise)."""
    path, hf_model = _model(tmp_path, case)
    config, _ = hf_io.load_hf(path, dtype=jnp.float32)
    layout = make_layout("0-7:d2f2t2", model=config)
    _, params = hf_io.load_hf(path, dtype=jnp.float32,
                              shardings=layout.param_shardings(abstract_params(config)))
    tokens_bt, mask_bt = _batch(config)
    ours = _ours(config, params, tokens_bt, mask_bt)
    _assert_valid_close(ours, hf_logits(hf_model, tokens_bt, mask_bt), mask_bt)
    out = tmp_path / "export"
    hf_io.save_hf(out, config, params, max_shard_bytes=100_000)
    weight_map = json.loads((out / hf_io.INDEX_FILE).read_text())["weight_map"]
    with safe_open(path / hf_io.SINGLE_FILE, framework="numpy") as f:
        assert set(weight_map) == set(f.keys())  # the same tensors, no zero slot among them
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(
        out, attn_implementation="eager", dtype=torch.float32).eval()
    original = hf_model.state_dict()
    for name, tensor in reloaded.state_dict().items():
        torch.testing.assert_close(tensor, original[name], atol=0, rtol=0, msg=name)
    _, again = hf_io.load_hf(out, dtype=jnp.float32)
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)),
                 again, params)


N_NEW = 16
PROMPT = "w5 w17 w42 w9"


@pytest.mark.entry
@pytest.mark.parametrize("case,layout", [
    # ~10 s each: the mixed model (both blocks, dense and sparse layers) in the default suite
    pytest.param("qwen3_moe", "0-1:d2", marks=pytest.mark.slow),
    ("qwen3_moe_mixed", "0-3:d2t2"),
    # expert parallelism: the rollout engine's SPMD decode, tokens to experts by all-to-all
    # (~20 s; tests/test_expert_parallel.py's block test is its default-suite sibling)
    pytest.param("qwen3_moe", "0-3:d2e2", marks=pytest.mark.slow),
    pytest.param("mixtral", "0-1:t2", marks=pytest.mark.slow),
])
def test_generate_greedy_matches_hf(tmp_path, case, layout):
    path, hf_model = _model(tmp_path, case)
    ours, hf_tokens = greedy_tokens_and_hf(path, hf_model, layout, N_NEW, PROMPT)
    assert ours == hf_tokens
