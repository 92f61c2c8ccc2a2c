"""Token-budget micro-batches (`train.micro_batch_tokens`): the count comes from the packed
rows, each micro-batch stays within the budget, shapes come from a few buckets (compiles are
counted), and the update equals one padded micro-batch's."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrlhf.engine import microbatch as mb
from jaxrlhf.engine import optimizer as opt
from jaxrlhf.engine import packing
from jaxrlhf.engine import train_step as ts
from jaxrlhf.models.sizes import get_size
from jaxrlhf.models.transformer import Transformer
from jaxrlhf.parallel.layout import make_layout

MODEL = get_size("tiny", hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2,
                 num_kv_heads=1, dtype=jnp.float32)
OPT = opt.OptimizerConfig(lr=1e-3, warmup_steps=0, total_steps=4, eps=1e-6)


def long_tailed_segments(seed: int, rows: int, width: int) -> np.ndarray:
    """[rows, width] right-padded rows, lengths lognormal (median width/8) clipped to [4, width]:
    most rows short, a few near the width."""
    rng = np.random.default_rng(seed)
    lengths = np.clip(np.exp(rng.normal(np.log(width / 8), 1.0, rows)), 4, width).astype(int)
    lengths[0] = width
    return (np.arange(width)[None] < lengths[:, None]).astype(np.int32)


def test_budget_counts_packed_rows():
    seg = long_tailed_segments(0, 64, 128)
    budget = mb.MicrobatchConfig.by_token_budget(8 * 128)
    padded = mb.plan_microbatches(budget, seg, 2, packing.Rows.PADDED)
    packed = mb.plan_microbatches(budget, seg, 2, packing.Rows.PACKED)
    assert padded.gather_mrt.shape[0] == 8  # 8 padded rows of 128 per micro-batch
    k = packed.gather_mrt.shape[0]
    assert k <= 8 // 2  # the same budget holds at least twice the sequences packed
    assert packed.rows * 128 <= budget.value and packed.rows % 2 == 0
    # the fewest: one micro-batch fewer would need more rows than the budget holds
    fewer = [c for c in range(1, k) if 64 % c == 0 and (64 // c) % 2 == 0]
    for c in fewer:
        assert packing.plan(seg, c, 2, packing.Rows.PACKED).rows * 128 > budget.value
    assert packing.packed_tokens(packed) == seg.sum()
    with pytest.raises(ValueError, match="token budget 100 is below"):
        mb.plan_microbatches(mb.MicrobatchConfig.by_token_budget(100), seg, 2,
                             packing.Rows.PACKED)


def _batch(seed: int, rows: int = 32, width: int = 32):
    seg = long_tailed_segments(seed, rows, width)
    rng = np.random.default_rng(seed)
    tokens = np.where(seg, rng.integers(1, MODEL.vocab_size, seg.shape), 0).astype(np.int32)
    return {"tokens_bt": tokens, "segment_ids_bt": seg,
            "positions_bt": np.where(seg, np.arange(width), 0).astype(np.int32),
            "loss_mask_bt": seg}


def sequence_nll(out, batch):
    """Mean over sequences of their tokens' NLL: a sequence-level aggregation, so a token
    counted in the wrong sequence would show."""
    mask_bt = batch["loss_mask_bt"].astype(jnp.float32).at[:, 0].set(0.0)
    nll_b = -jnp.sum(out.logprobs_bt * mask_bt, axis=1) / jnp.maximum(mask_bt.sum(1), 1.0)
    return jnp.sum(nll_b), jnp.float32(nll_b.shape[0]), {}


@pytest.mark.slow  # ~10 s; token budgets under every parallelism: tests/test_train_step.py
@pytest.mark.devices(2)
def test_token_budget_step_equals_one_padded_micro_batch():
    layout = make_layout("0-1:d2", model=MODEL)
    tokens = jnp.zeros((1, 1), jnp.int32)
    params = jax.tree.map(np.asarray, nn.unbox(Transformer(MODEL).init(
        jax.random.key(0), tokens, tokens, tokens + 1))["params"])
    budget = ts.make_train_step(MODEL, layout, sequence_nll, OPT,
                                mb.MicrobatchConfig.by_token_budget(6 * 32))
    padded = ts.make_train_step(MODEL, layout, sequence_nll, OPT, rows=packing.Rows.PADDED)
    states = {id(s): ts.create_train_state(params, MODEL, layout, OPT) for s in (budget, padded)}
    # Other lengths, the same bucket: (2 micro-batches, 6 packed rows); lengths that dealt
    # evenly over the shards need fewer rows take a spread plan (tests/test_packing.py).
    for seed in (1, 2):
        batch = _batch(seed)
        count, plan = budget.plan(batch)
        assert (count, plan.rows) == (2, 6)  # padded rows in this budget: 8 micro-batches
        metrics = {}
        for step in (budget, padded):
            states[id(step)], metrics[id(step)] = step(states[id(step)], batch)
        got, want = jax.device_get(metrics[id(budget)]), jax.device_get(metrics[id(padded)])
        for key in ("loss", "grad_norm", "num_tokens", "weight"):
            np.testing.assert_allclose(got[key], want[key], rtol=1e-5, err_msg=key)
    assert budget.compiles == 1 and padded.compiles == 1
    for got, want in zip(jax.tree.leaves(states[id(budget)].params),
                         jax.tree.leaves(states[id(padded)].params)):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=0, atol=1e-5)
