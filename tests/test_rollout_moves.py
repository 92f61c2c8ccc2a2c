"""Rows moved between the data-parallel devices (jaxrlhf.engine.routes): the rollout engine's
compaction takes the kept slots exactly and an SPMD fill writes prompts prefilled on another
device, each device sent only the rows it needs; compiled for a v5p slice, the compaction holds
no other device's cache (it held the whole compacted state of every device)."""

import collections
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrlhf.engine import routes
from jaxrlhf.engine.generate import GenerateConfig, decode_model, generate, make_generate_fn
from jaxrlhf.engine.rollout import Rollout
from jaxrlhf.models.sizes import get_size
from jaxrlhf.parallel.layout import init_params, make_layout
from jaxrlhf.parallel.reshard import fetch

P = 8
CONFIG = get_size("tiny", dtype=jnp.float32)
STOPS = tuple(range(3, CONFIG.vocab_size, 4))  # rows end at scattered lengths


def _prompts(rows: int, group: int):
    """rows left-padded prompts [rows, P], each repeated `group` times in a row."""
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, P + 1, rows // group)
    tokens = rng.integers(3, CONFIG.vocab_size, (rows // group, P)).astype(np.int32)
    mask = np.arange(P) >= P - lengths[:, None]
    return np.repeat(np.where(mask, tokens, 0), group, 0), np.repeat(mask, group, 0)


def test_plan_brings_each_row_to_its_device():
    """`plan` simulated on the host: every wanted row read where `take` reads it, a row that
    stays on its device sent nowhere, a row wanted twice on one device sent once."""
    dp, own = 4, 6
    rng = np.random.default_rng(0)
    home_j, row_j = rng.integers(0, dp, 40), rng.integers(0, own, 40)
    dest_j = np.sort(rng.integers(0, dp, 40))
    moves = routes.plan(home_j, row_j, dest_j, own, dp)
    c = moves.width
    assert c & (c - 1) == 0 and moves.send_dq.shape == (dp, dp * c)
    rows_dor = rng.normal(size=(dp, own, 3))
    sent_ddc = rows_dor[np.arange(dp)[:, None], moves.send_dq].reshape(dp, dp, c, 3)
    for j in range(40):  # device d reads its own rows, then block i of c rows from device i
        readable = np.concatenate([rows_dor[dest_j[j]], *sent_ddc[:, dest_j[j]]])
        np.testing.assert_array_equal(readable[moves.at_j[j]], rows_dor[home_j[j], row_j[j]])
    moving = home_j != dest_j
    assert (moves.at_j[~moving] == row_j[~moving]).all()
    # As wide as the most distinct rows one device sends another, rounded up to a power of 2.
    per_pair = collections.Counter(
        (h, d) for h, d, _ in set(zip(home_j[moving], dest_j[moving], row_j[moving])))
    assert max(per_pair.values()) <= c < 2 * max(per_pair.values())
    nothing = routes.plan(dest_j, row_j, dest_j, own, dp)
    assert nothing.width == 0 and nothing.send_dq.shape == (dp, 0)


def _host(state):
    """A state's arrays on the host (PRNG keys as their data)."""
    raw = lambda x: jax.random.key_data(x) if jnp.issubdtype(x.dtype, jax.dtypes.prng_key) else x
    return jax.tree.map(np.asarray, fetch(jax.tree.map(raw, state)))


@pytest.mark.devices(4)
@pytest.mark.parametrize("spec", ["0-3:d2t2", "0-3:d4"])  # SPMD, and each device on its own
def test_compaction_takes_the_kept_slots_exactly(spec):
    """16 slots filled and decoded 3 steps, compacted into 8 taken from every device in a
    shuffled order: every array of the state is the old one's kept slots, bitwise (decode
    counts restarted at 0)."""
    layout = make_layout(spec, model=CONFIG)
    params = init_params(CONFIG, layout, jax.random.key(1))
    engine = Rollout(CONFIG, GenerateConfig(12, STOPS, 0), layout, P, 16)
    tokens, mask = _prompts(16, group=2)
    key = jax.device_put(jax.random.key(7), layout.replicated())
    state = engine.fill(engine.vacant(16), params, 0, engine.spread(list(range(16))), tokens,
                        mask, [key] * 16, np.arange(16))
    state = engine.advance(state, params, 0, 3, 1)
    keep = [int(s) for s in np.random.default_rng(1).permutation(16)[:8]]
    before, after = _host(state), _host(engine.compact(state, keep))
    for name in before._fields:
        if name == "cache":  # a DecodeKV per layer on XLA:CPU: rows first
            for old, new in zip(jax.tree.leaves(before.cache), jax.tree.leaves(after.cache)):
                np.testing.assert_array_equal(new, old[keep], err_msg=name)
        elif name in ("steps_b", "tokens_b"):
            np.testing.assert_array_equal(getattr(after, name), 0, err_msg=name)
        elif getattr(before, name) is None:  # routes_bslk of a model without experts
            assert getattr(after, name) is None, name
        else:
            np.testing.assert_array_equal(getattr(after, name), getattr(before, name)[keep],
                                          err_msg=name)


@pytest.mark.devices(4)
def test_groups_spread_over_devices_decode_as_the_static_batch():
    """d2t2 (one SPMD program per call): 16 rows in groups of 4 through 8 slots, so that the
    fills take turns over the devices (a group's prompt is prefilled on one, its rows sent to
    the other) and finished rows leave slots to compact; every row as one `generate` call."""
    layout = make_layout("0-3:d2t2", model=CONFIG)
    params = init_params(CONFIG, layout, jax.random.key(1))
    cfg = GenerateConfig(24, STOPS, 0, temperature=1.0)
    tokens, mask = _prompts(16, group=4)
    rng = jax.random.key(7)
    gen = make_generate_fn(CONFIG, cfg, layout, prompt_buckets=(P,), chunk_tokens=4)
    got = gen(params, tokens, mask, rng, micro_batches=2)
    run = jax.jit(functools.partial(generate, decode_model(CONFIG, layout), cfg))
    for j in range(2):  # micro-batch j: rows j::2, sampling with fold_in(rng, j)
        want = jax.tree.map(np.asarray, run(params, tokens[j::2], mask[j::2],
                                            jax.random.fold_in(rng, j)))
        for name in ("sequences_bs", "response_mask_bn"):
            np.testing.assert_array_equal(np.asarray(getattr(got, name))[j::2],
                                          getattr(want, name), err_msg=name)
        np.testing.assert_allclose(np.asarray(got.logprobs_bn)[j::2], want.logprobs_bn,
                                   rtol=1e-5, atol=1e-5)


@pytest.mark.tpu_compile
def test_compaction_holds_no_other_devices_cache(libtpu):
    """Compiled for v5p:2x2x2 on d4t2 (64 slots into 48): the compaction's temporaries stay
    below twice a device's share of the cache; taking the kept slots from the whole state (one
    SPMD gather) held every device's, over three times it."""
    from jax.experimental import topologies

    from jaxrlhf.engine.call import abstract
    from jaxrlhf.models.sizes import abstract_params

    topology = topologies.get_topology_desc(platform="tpu", topology_name="v5p:2x2x2")
    # Cache rows as a TPU lays them out (head_dim 128), bf16; few layers, a small vocabulary.
    config = get_size("tiny", hidden_size=1024, num_heads=8, num_kv_heads=4,
                      intermediate_size=1024, dtype=jnp.bfloat16)
    layout = make_layout("0-7:d4t2", model=config, devices=topology.devices)
    prompt_len, n_new, slots = 128, 128, 64
    engine = Rollout(config, GenerateConfig(n_new, 2, 0), layout, prompt_len, slots)
    boxed = abstract_params(config)
    params = abstract(nn.meta.unbox(boxed), layout.param_shardings(boxed))
    with jax.default_device(jax.local_devices(backend="cpu")[0]):
        key = jax.random.key(0)
    tokens = np.ones((slots, prompt_len), np.int32)
    lowered = engine.lowered_programs(params, tokens, tokens.astype(bool), key, None,
                                      at_once=False, compact_to=48)
    temporaries = lowered["compaction"].compile().memory_analysis().temp_size_in_bytes
    share = (2 * config.num_layers * slots * (prompt_len + n_new) * config.num_kv_heads
             * config.head_dim * 2) / layout.num_devices  # keys and values, bf16
    assert temporaries < 2 * share, (temporaries, share)
