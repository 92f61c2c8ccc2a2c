"""A sliding-window layer's decode cache holds only its window (a ring, `models.decode_kv`) in
the rollout engine's layer-by-layer state and in its stacked one (`models.mixed_cache` where the
layers differ): the bytes it allocates, the memory model's, and rows whose prompts and
responses run past the window decoded, recomputed under new weights and decoded on, with the
log-probs of a full forward."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrlhf.engine.generate import GenerateConfig
from jaxrlhf.engine.rollout import Rollout
from jaxrlhf.mfc import Call
from jaxrlhf.models.mixed_cache import MixedKVCache
from jaxrlhf.models.sizes import get_size
from jaxrlhf.models.transformer import KVCache
from jaxrlhf.parallel.layout import Platform, init_params, make_layout
from jaxrlhf.parallel.strategy import parse_strategy
from jaxrlhf.plan import memory
from jaxrlhf.plan.choice import CallChoice
from jaxrlhf.plan.experiment import Workload
from jaxrlhf.plan.profile import profile_of
from tests.test_rollout import LENGTHS, N, P, _full_forward_logp

WINDOW = 4  # tiny-gemma3's: layer 0 local, layer 1 global; shorter than the longest prompt


def _gen_config(**kw):
    return GenerateConfig(**{"max_new_tokens": N, "eos_token_id": 1, "pad_token_id": 0,
                             "temperature": 1.0, **kw})


# Layer by layer (one DecodeKV per layer), and the stacked cache (fsdp decodes on the layer
# scan: `engine.decoding.decodes_layer_by_layer`).
STACKS = [("0:d1", True), pytest.param("0-1:f2", False, marks=pytest.mark.skipif(
    jax.device_count() < 2, reason="needs 2 devices"))]


def _cache_bytes(state) -> int:
    return sum(x.nbytes for x in jax.tree.leaves(state.cache))


def _layer_slots(cache) -> list[int]:
    """Each layer's cache slots: of the stacked [L, S, slots, k, d] KVCache or per layer."""
    if isinstance(cache, KVCache):
        return [cache.k_lbskd.shape[2]] * cache.k_lbskd.shape[0]
    return [c.length for c in cache]


def test_sliding_layers_allocate_only_their_window():
    """Gemma-3-shaped, 6 layers (5 local with a 32-slot window, 1 global) at 256 slots: the
    engine's cache is 5 x 32 + 256 slots of a layer's keys and values, 27% of every slot."""
    config = get_size("tiny-gemma3", dtype=jnp.float32, num_layers=6, sliding_window=32,
                      sliding_layers=(0, 1, 2, 3, 4))
    layout = make_layout("0:d1", model=config)
    cfg = GenerateConfig(max_new_tokens=224, eos_token_id=1, pad_token_id=0)
    rollout = Rollout(config, cfg, layout, 32, 2)
    if not rollout.by_layer:
        pytest.skip("the stacked cache (accelerators) keeps every slot of every layer")
    state = rollout.empty(capacity=224)
    assert [c.length for c in state.cache] == [32] * 5 + [256]
    per_slot = 2 * 2 * config.num_kv_heads * config.head_dim * 4  # 2 rows, keys and values
    assert _cache_bytes(state) == (5 * 32 + 256) * per_slot  # 32 is a whole key tile
    full = Rollout(config.replace(sliding_window=None, sliding_layers=()), cfg, layout, 32, 2)
    assert _cache_bytes(state) / _cache_bytes(full.empty(capacity=224)) == 416 / 1536


@pytest.mark.skipif(jax.device_count() < 2, reason="needs 2 devices")
def test_stacked_cache_holds_each_sliding_layers_window():
    """Gemma-3-shaped, 7 layers (two periods of sliding, sliding, global, then a sliding one)
    with a 32-slot window at 32 + 224 slots, on the stacked cache (fsdp decodes on the layer
    scan): the sliding layers' stack holds 32 slots, the global layers' 256; as many bytes as
    the layer-by-layer state allocates (each layer its own cache), 3/8 of every slot's, and
    per device what the memory model prices."""
    config = get_size("tiny-gemma3", dtype=jnp.float32, num_layers=7, sliding_window=32,
                      sliding_layers=(0, 1, 3, 4, 6))
    cfg = GenerateConfig(max_new_tokens=224, eos_token_id=1, pad_token_id=0)
    stacked = Rollout(config, cfg, make_layout("0-1:f2", model=config), 32, 2)
    state = stacked.empty(capacity=224)
    assert not stacked.by_layer and isinstance(state.cache, MixedKVCache)
    assert state.cache.sliding.k_lbskd.shape[:3] == (5, 2, 32)
    assert state.cache.full.k_lbskd.shape[:3] == (2, 2, 256)
    by_layer = Rollout(config, cfg, make_layout("0-1:d2", model=config), 32, 2)
    assert by_layer.by_layer
    assert _cache_bytes(state) == _cache_bytes(by_layer.empty(capacity=224))
    full = Rollout(config.replace(sliding_window=None, sliding_layers=()), cfg,
                   make_layout("0-1:f2", model=config), 32, 2)
    assert _cache_bytes(state) / _cache_bytes(full.empty(capacity=224)) == 3 / 8
    per_device = sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(state.cache))
    priced = memory.call_memory(
        profile_of(config), Call.GENERATE, Workload(batch_size=2, prompt_len=32, new_tokens=224),
        CallChoice.of(parse_strategy("0-1:f2"), micro_batches=1), platform=Platform.CPU)
    assert priced.state == per_device == _cache_bytes(state) // 2


def _decode_across_versions(config, spec, by_layer, check_filled):
    """Prompts of up to 6 tokens and 10 sampled ones, on `spec`'s rollout engine: 4 tokens
    under policy a, the cache recomputed under policy b, 2 more, the slots compacted (two rows,
    swapped), the rest; each token's log-prob is its policy's full forward's (window masked).
    `check_filled(state)` looks at the cache after the prompts' fill. Returns the rows and both
    policies' full-forward log-probs [rows, N]."""
    layout = make_layout(spec, model=config)
    params_a = init_params(config, layout, jax.random.key(1))
    params_b = init_params(config, layout, jax.random.key(2))
    rng = np.random.default_rng(0)
    tokens, mask = np.zeros((len(LENGTHS), P), np.int32), np.zeros((len(LENGTHS), P), bool)
    for r, length in enumerate(LENGTHS):
        tokens[r, P - length:] = rng.integers(3, config.vocab_size, length)
        mask[r, P - length:] = True
    rollout = Rollout(config, _gen_config(force_max_length=True), layout, P, len(LENGTHS))
    assert rollout.by_layer == by_layer
    state = rollout.fill(rollout.empty(), params_a, 0, np.arange(len(LENGTHS)), tokens, mask,
                         [jax.random.key(3)] * len(LENGTHS), np.arange(len(LENGTHS)))
    check_filled(state)
    state = rollout.advance(state, params_a, 0, 3, longest=1)
    _, counts = rollout.poll(state)
    state = rollout.reload(state, params_b, counts[2])
    state = rollout.advance(state, params_b, 1, 2)
    state = rollout.compact(state, [2, 0])
    state = rollout.advance(state, params_b, 1, N)
    assert rollout.poll(state)[0].all()
    out = rollout.rows(state)
    logp_a = _full_forward_logp(config, params_a, out.sequences_bs, out.sequence_mask_bs)
    logp_b = _full_forward_logp(config, params_b, out.sequences_bs, out.sequence_mask_bs)
    expected = np.where(out.versions_bn == 0, logp_a, logp_b)
    np.testing.assert_allclose(out.logprobs_bn, expected, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(out.sequences_bs[:, :P], np.where(mask, tokens, 0)[[2, 0]])
    # The window matters: without it the same tokens' log-probs differ.
    unwindowed = config.replace(sliding_window=None, sliding_layers=())
    logp_full = _full_forward_logp(unwindowed, params_b, out.sequences_bs,
                                   out.sequence_mask_bs)
    assert np.abs(np.where(out.versions_bn == 1, logp_full - logp_b, 0)).max() > 1e-3
    return out, logp_a, logp_b


# The stacked ring (18 s) runs in the slow tier; its decode runs in the default suite too
# (test_gemma_mistral_hf.test_stacked_cache_decodes_as_layer_by_layer_and_hf).
@pytest.mark.parametrize("spec, by_layer", [
    STACKS[0], pytest.param(*STACKS[1].values, marks=(*STACKS[1].marks, pytest.mark.slow))])
def test_ring_cache_decodes_recomputes_and_decodes_on(spec, by_layer):
    """Prompts of up to 6 tokens and 10 sampled ones against the 4-slot ring (layer by layer,
    and the stacked cache's ring stack): 4 tokens under one policy, the cache recomputed under
    another (each row's latest slots into the ring), 2 more, the slots compacted (two rows,
    swapped), the rest; each token's log-prob is its policy's full forward's (window
    masked)."""
    config = get_size("tiny-gemma3", dtype=jnp.float32)
    assert config.sliding_window == WINDOW and config.sliding_layers == (0,)

    def check_filled(state):
        if by_layer:
            assert state.cache[0].length == WINDOW < state.cache[1].length
        else:
            assert state.cache.sliding.k_lbskd.shape[2] == WINDOW < state.cache.length

    out, logp_a, logp_b = _decode_across_versions(config, spec, by_layer, check_filled)
    assert (out.versions_bn[:, -1] == 1).all() and np.abs(logp_a - logp_b).max() > 1e-2


def _mistral(window: int):
    """Mistral-shaped: every layer slides through one window."""
    config = get_size("tiny", dtype=jnp.float32)
    return config.replace(sliding_window=window, sliding_layers=tuple(range(config.num_layers)))


@pytest.mark.parametrize("spec, by_layer", STACKS)
def test_mistral_cache_is_one_window(spec, by_layer):
    """Every layer slides (Mistral), a 64-slot window at 32 + 224 slots: each layer's cache is
    the 64-slot ring, a quarter of every slot's bytes, and the state's capacity is still N
    (the ring holds any slot); cut to 16 response slots (48 < 64) it holds those 48."""
    config = _mistral(64)
    layout = make_layout(spec, model=config)
    cfg = GenerateConfig(max_new_tokens=224, eos_token_id=1, pad_token_id=0)
    rollout = Rollout(config, cfg, layout, 32, 2)
    assert rollout.by_layer == by_layer
    state = rollout.empty(capacity=224)
    per_slot = 2 * 2 * config.num_kv_heads * config.head_dim * 4  # 2 rows, keys and values
    assert _cache_bytes(state) == config.num_layers * 64 * per_slot
    full = Rollout(config.replace(sliding_window=None, sliding_layers=()), cfg, layout, 32, 2)
    assert _cache_bytes(state) / _cache_bytes(full.empty(capacity=224)) == 64 / 256
    assert rollout.size(state) == (2, 224)
    assert rollout.size(rollout.fit(state, 100)) == (2, 224)  # the same ring: kept
    cut = rollout.fit(state, 16)
    assert rollout.size(cut) == (2, 16)
    assert _layer_slots(cut.cache) == [48] * config.num_layers


@pytest.mark.slow  # 20 s: fill, advance, reload, compact each compile
@pytest.mark.parametrize("spec, by_layer", STACKS)
def test_mistral_ring_decodes_recomputes_compacts_and_decodes_on(spec, by_layer):
    """Every layer a 4-slot ring, prompts of up to 6 tokens and 10 sampled ones: 4 tokens
    under one policy, the cache recomputed under another, 2 more, the slots compacted (two
    rows, swapped), the rest; each token's log-prob is its policy's full forward's."""
    config = _mistral(WINDOW)

    def check_filled(state):
        assert _layer_slots(state.cache) == [WINDOW] * config.num_layers

    out, _, _ = _decode_across_versions(config, spec, by_layer, check_filled)
    assert (out.versions_bn[:, -1] == 1).all() and (out.versions_bn[:, 0] == 0).all()
