"""The rollout engine under the synchronous generate call (jaxrlhf.engine.generate.Generator on
jaxrlhf.engine.rollout): with the same keys it computes what the static-batch `generate`
computes (same tokens, log-probs to fp32 rounding), on forced and EOS-stopped lengths, greedy
and sampled, while it compacts live rows into fewer slots, refills slots from a queue, grows
and cuts the cache's capacity, and prefills each distinct prompt of a group once."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrlhf.engine.generate import (
    GenerateConfig, decode_model, decode_rows, generate, make_generate_fn,
)
from jaxrlhf.engine.rollout import Rollout, capacity_buckets, capacity_for, distinct_prompts
from jaxrlhf.models.sizes import get_size
from jaxrlhf.parallel.layout import init_params, make_layout

P = 8
CONFIG = get_size("tiny", dtype=jnp.float32)
# A quarter of the vocabulary stops a row: sampled rows end at scattered lengths.
STOPS = tuple(range(3, CONFIG.vocab_size, 4))


def _prompts(rows: int, group: int, seed: int = 0):
    """rows left-padded prompts [rows, P] of random lengths, each repeated `group` times in a
    row (a GRPO group)."""
    rng = np.random.default_rng(seed)
    tokens = np.zeros((rows // group, P), np.int32)
    mask = np.zeros((rows // group, P), bool)
    for r in range(rows // group):
        length = int(rng.integers(1, P + 1))
        tokens[r, P - length:] = rng.integers(3, CONFIG.vocab_size, length)
        mask[r, P - length:] = True
    return np.repeat(tokens, group, 0), np.repeat(mask, group, 0)


@functools.cache
def _setup(spec: str):
    layout = make_layout(spec, model=CONFIG)
    return layout, init_params(CONFIG, layout, jax.random.key(1))


def _reference(layout, params, cfg, tokens, mask, rng):
    run = jax.jit(functools.partial(generate, decode_model(CONFIG, layout), cfg))
    return jax.tree.map(np.asarray, run(params, tokens, mask, rng))


def _assert_same(got, want):
    for name in ("sequences_bs", "response_bn", "response_mask_bn", "response_lengths_b"):
        np.testing.assert_array_equal(np.asarray(getattr(got, name)), getattr(want, name),
                                      err_msg=name)
    np.testing.assert_allclose(np.asarray(got.logprobs_bn), want.logprobs_bn, rtol=1e-5,
                               atol=1e-5)


CASES = {  # name: (GenerateConfig overrides)
    "forced-sampled": dict(temperature=1.0, force_max_length=True),
    "eos-sampled": dict(temperature=1.0),
    "eos-greedy": dict(temperature=0.0),
    "eos-top-k": dict(temperature=0.7, top_k=20),
}


# In the default suite: forced lengths on one device, sampled lengths on the per-device (d2)
# path and the GSPMD (t2) path with top-k (greedy is every other engine test's case); every
# pair with -m slow.
DEFAULT_PAIRS = {("0:d1", "forced-sampled"), ("0-1:d2", "eos-sampled"), ("0-1:t2", "eos-top-k")}
PAIRS = [pytest.param(spec, case, marks=() if (spec, case) in DEFAULT_PAIRS else pytest.mark.slow)
         for spec in ("0:d1", "0-1:d2", "0-1:t2") for case in CASES]


@pytest.mark.parametrize("spec,case", PAIRS)
def test_engine_equals_the_static_batch(spec, case):
    """16 rows (4 prompts x 4), 40 new tokens, decoded in chunks of 4: the capacity grows
    chunk by chunk, and EOS-stopped rows leave slots to be compacted."""
    layout, params = _setup(spec)
    cfg = GenerateConfig(40, STOPS, 0, **CASES[case])
    tokens, mask = _prompts(16, group=4)
    rng = jax.random.key(7)
    gen = make_generate_fn(CONFIG, cfg, layout, prompt_buckets=(P,), chunk_tokens=4)
    got = gen(params, tokens, mask, rng)
    want = _reference(layout, params, cfg, tokens, mask, rng)
    _assert_same(got, want)
    lengths = want.response_lengths_b
    if case.startswith("eos") and spec == "0:d1":
        assert lengths.min() < lengths.max()  # the case tests what it says
        # Compaction: fewer slot-steps than 16 rows decoding until the longest stops.
        assert gen.occupancy.slot_steps < 16 * (lengths.max() - 1)
    assert gen.occupancy.tokens == lengths.sum() - 16  # the prefill samples each first token


@pytest.mark.parametrize("spec", ["0:d1", "0-1:d2"])
def test_a_call_within_one_chunk_runs_as_one_executable(spec):
    """16 rows in 16 slots, at most 6 new tokens in chunks of 8 (the main job's shape): one
    executable fills, decodes and reads out every row on the device, with the static batch's
    tokens and log-probs, its output shardings and the decode work counted."""
    layout, params = _setup(spec)
    cfg = GenerateConfig(6, STOPS, 0, temperature=1.0)
    tokens, mask = _prompts(16, group=4, seed=5)
    rng = jax.random.key(9)
    gen = make_generate_fn(CONFIG, cfg, layout, prompt_buckets=(P,), chunk_tokens=8)
    got = gen(params, tokens, mask, rng)
    want = _reference(layout, params, cfg, tokens, mask, rng)
    _assert_same(got, want)
    assert [None if x is None else x.sharding for x in got] == list(gen._out_shardings)
    lengths = want.response_lengths_b
    assert lengths.min() < lengths.max()  # EOS ends some rows early
    assert gen.compiles == 1
    # Row i in slot i; each device decodes its own slots until they are done.
    per_device = lengths.reshape(layout.dp_size, -1)
    steps = per_device.shape[1] * (per_device.max(axis=1) - 1).sum()
    assert gen.occupancy == (steps, lengths.sum() - 16)


def test_a_queue_smaller_than_the_batch_decodes_every_row_alike():
    """4 slots for 12 rows, chunks of 3 tokens: rows wait, then take the slots of finished
    ones; every row is what the static batch gives it."""
    layout, params = _setup("0:d1")
    cfg = GenerateConfig(24, STOPS, 0, temperature=1.0)
    tokens, mask = _prompts(12, group=3, seed=1)
    rng = jax.random.key(3)
    engine = Rollout(CONFIG, cfg, layout, P, 4)
    out, work = decode_rows(engine, params, tokens, mask, [rng] * 12,
                            np.arange(12, dtype=np.int32), slots=4, chunk_tokens=3)
    want = _reference(layout, params, cfg, tokens, mask, rng)
    np.testing.assert_array_equal(out["sequences_bs"][:, P:], want.response_bn)
    np.testing.assert_array_equal(out["response_mask_bn"], want.response_mask_bn)
    np.testing.assert_allclose(out["logprobs_bn"], want.logprobs_bn, rtol=1e-5, atol=1e-5)
    assert work.tokens == want.response_lengths_b.sum() - 12
    assert want.response_lengths_b.max() < 24 and work.slot_steps <= 4 * 24 * 3


def test_capacity_follows_the_live_rows():
    """Small chunks grow the cache bucket by bucket, each chunk ending at its bucket's end
    (same tokens); a state whose long rows left is cut back."""
    layout, params = _setup("0:d1")
    cfg = GenerateConfig(100, STOPS, 0, temperature=1.0, force_max_length=True)
    tokens, mask = _prompts(4, group=1, seed=2)
    rng = jax.random.key(5)
    engine = Rollout(CONFIG, cfg, layout, P, 4)
    out, _ = decode_rows(engine, params, tokens, mask, [rng] * 4, np.arange(4, dtype=np.int32),
                         slots=4, chunk_tokens=20)
    want = _reference(layout, params, cfg, tokens, mask, rng)
    np.testing.assert_array_equal(out["sequences_bs"][:, P:], want.response_bn)
    np.testing.assert_allclose(out["logprobs_bn"], want.logprobs_bn, rtol=1e-5, atol=1e-5)
    assert capacity_buckets(100) == (16, 24, 32, 48, 64, 96, 100)
    assert [capacity_for(n, 100) for n in (1, 17, 33, 97)] == [16, 24, 48, 100]
    state = engine.fit(engine.empty(4), 100)
    assert engine.size(state) == (4, 100)
    assert engine.size(engine.fit(state, 60)) == (4, 100)  # within 2x: kept
    assert engine.size(engine.fit(state, 30)) == (4, 32)  # cut
    # A chunk ends where its rows outgrow the bucket holding their next token (16: 15 steps
    # from token 1, one from 15; 24 from 16), or the state's larger cache that fit keeps.
    small = engine.empty(4)
    assert [engine.chunk_steps(small, n, 32) for n in (1, 15, 16)] == [15, 1, 8]
    assert engine.chunk_steps(state, 60, 32) == 32 and engine.chunk_steps(state, 40, 32) == 8


def test_a_group_is_prefilled_once():
    """distinct_prompts finds each group's prompt (padding included in the comparison), and a
    fill of 16 rows of 4 distinct prompts compiles a prefill of 4 rows, not 16."""
    tokens, mask = _prompts(16, group=4)
    first, src = distinct_prompts(tokens, mask)
    assert len(first) == 4
    np.testing.assert_array_equal(tokens[first][src], tokens)
    np.testing.assert_array_equal(mask[first][src], mask)
    shifted = mask.copy()
    shifted[0, -1] = False  # same tokens, other mask: another prompt
    assert len(distinct_prompts(tokens, shifted)[0]) == 5
    layout, params = _setup("0:d1")
    engine = Rollout(CONFIG, GenerateConfig(8, STOPS, 0), layout, P, 16)
    engine.fill(engine.empty(), params, 0, np.arange(16), tokens, mask,
                [jax.random.key(0)] * 16, np.arange(16))
    fills = [key for key in engine.compile_cache._executables if key[1] == "fill"]
    # (P, fill, built here, slots, capacity, distinct prompts, rows, distinct keys)
    assert fills == [(P, "fill", False, 16, 8, 4, 16, 1)]



@pytest.mark.parametrize("spec", ["0:d1", "0-1:d2"])
def test_micro_batches_queue_for_a_fraction_of_the_slots(spec):
    """micro_batches=4: 16 rows in 4 slots, rows j::4 sampling as the static batch of
    micro-batch j with fold_in(rng, j); every row as there, in its place."""
    layout, params = _setup(spec)
    cfg = GenerateConfig(24, STOPS, 0, temperature=1.0)
    tokens, mask = _prompts(16, group=2, seed=3)
    rng = jax.random.key(11)
    gen = make_generate_fn(CONFIG, cfg, layout, prompt_buckets=(P,), chunk_tokens=4)
    got = gen(params, tokens, mask, rng, micro_batches=4)
    for j in range(4):
        want = _reference(layout, params, cfg, tokens[j::4], mask[j::4],
                          jax.random.fold_in(rng, j))
        np.testing.assert_array_equal(np.asarray(got.response_bn)[j::4], want.response_bn)
        np.testing.assert_array_equal(np.asarray(got.response_mask_bn)[j::4],
                                      want.response_mask_bn)
        np.testing.assert_allclose(np.asarray(got.logprobs_bn)[j::4], want.logprobs_bn,
                                   rtol=1e-5, atol=1e-5)
    assert got.response_bn.shape == (16, 24)


def test_a_chunk_ends_when_finished_rows_can_leave_their_slots():
    """16 rows, 12 of them 3 tokens long and 4 of them 24, in chunks of 16: the first chunk
    stops after the short rows' last step (2 decode steps of 16 slots; the prefill samples
    each first token), the long rows go on in 4 slots (21 steps), rather than 16 slots
    decoding finished rows to the chunk's end."""
    layout, params = _setup("0:d1")
    cfg = GenerateConfig(24, STOPS, 0, temperature=1.0, force_max_length=True)
    tokens, mask = _prompts(16, group=4, seed=4)
    rng = jax.random.key(2)
    limits = np.array([24, 3, 3, 3] * 4, np.int32)
    engine = Rollout(CONFIG, cfg, layout, P, 16)
    out, work = decode_rows(engine, params, tokens, mask, [rng] * 16,
                            np.arange(16, dtype=np.int32), slots=16, chunk_tokens=16,
                            limits_b=limits)
    np.testing.assert_array_equal(out["response_mask_bn"].sum(1), limits)
    want = _reference(layout, params, cfg, tokens, mask, rng)
    np.testing.assert_array_equal(np.where(out["response_mask_bn"], out["sequences_bs"][:, P:], 0),
                                  np.where(out["response_mask_bn"], want.response_bn, 0))
    assert work == (16 * 2 + 4 * 21, limits.sum() - 16)
