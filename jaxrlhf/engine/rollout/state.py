"""The rollout engine's slot state: the rows being decoded, one per slot, as a pytree on the
generation layout (`SlotState`), what the host reads of it (`Rows`, `read_poll`), a state not
built yet (`Vacant`), and the capacity buckets its KV cache comes in.

Slot s's response token i sits in cache slot P + i of row s. The cache holds P + C slots, C a
bucket (`capacity_buckets`: two per octave) just above what the busy rows reach in the next
chunk of tokens (module `engine.rollout.engine`, `Rollout.fit`).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxrlhf.engine import replay
from jaxrlhf.engine.buckets import bucket_length
from jaxrlhf.engine.decoding import GenerateConfig, constrain_cache
from jaxrlhf.models.config import ModelConfig
from jaxrlhf.models.decode_kv import ring_slots
from jaxrlhf.models.mixed_cache import MixedKVCache, splits_cache
from jaxrlhf.models.transformer import DecodeKV, KVCache, decode_lengths

NO_VERSION = -1  # versions_bn where no token was sampled
_MIN_CAPACITY = 16


def capacity_buckets(n_max: int) -> tuple[int, ...]:
    """Response slots a state's cache may hold: 16, 24, 32, 48, 64, 96, ... (two per octave),
    then `n_max` itself; (16, 24, 32, 48, 64, 96, 100) for 100."""
    out, low = [], _MIN_CAPACITY
    while low < n_max:
        out += [low, low * 3 // 2]
        low *= 2
    return tuple(sorted({c for c in out if c < n_max} | {n_max}))


def capacity_for(needed: int, n_max: int) -> int:
    """The smallest capacity bucket >= needed (at most n_max)."""
    return bucket_length(min(max(int(needed), 1), n_max), capacity_buckets(n_max))


class SlotState(NamedTuple):
    """The rows being generated, one per slot (a pytree on the generation layout).

    Attributes:
      step_b: int32 [S] index of each slot's next response token.
      logits_bv: float32 [S, vocab] the model's prediction of that token.
      last_token_b: int32 [S] response token step - 1.
      done_b: bool [S] nothing to decode: the row stopped (EOS or N tokens) or the slot is free.
      cache: the KV cache of P + C slots: one `DecodeKV` per layer (`models.decode_kv`)
        when the model decodes layer by layer, else one stacked KVCache [L, S, P + C, k, d],
        or where the layers differ in their window a `models.mixed_cache.MixedKVCache` (the
        sliding layers' stack apart from the global ones'); a sliding layer's holds at most
        its window, a ring (`transformer.decode_lengths`, `cache_len`).
      response_bn: int32 [S, N] sampled tokens (pad_token_id after the end).
      logprobs_bn: float32 [S, N] each token's log-prob (0 where none).
      mask_bn: bool [S, N] sampled tokens.
      versions_bn: int32 [S, N] policy version that sampled each token (NO_VERSION: none).
      prompt_tokens_bp: int32 [S, P] left-padded prompts.
      prompt_mask_bp: bool [S, P].
      keys_b: PRNG keys [S]: each row's (micro-)batch key.
      row_b: int32 [S] each row's index in its (micro-)batch (its sampling stream).
      limit_b: int32 [S] the most response tokens each row may have (<= N).
      steps_b: int32 [S] decode steps run over each slot, busy or not; tokens_b: int32 [S]
        tokens each slot sampled in them (the slots' occupancy; per slot, so a step needs no
        reduction across devices, and each device may stop when its own slots are done).
      routes_bslk: int8/int16 [S, P + N, L, k] the experts each prompt and response token
        used in each layer when it was generated (`engine.replay`; NO_ROUTE where none was
        recorded); None for a model without experts.
    """

    step_b: jax.Array
    logits_bv: jax.Array
    last_token_b: jax.Array
    done_b: jax.Array
    cache: KVCache | tuple[DecodeKV, ...]
    response_bn: jax.Array
    logprobs_bn: jax.Array
    mask_bn: jax.Array
    versions_bn: jax.Array
    prompt_tokens_bp: jax.Array
    prompt_mask_bp: jax.Array
    keys_b: jax.Array
    row_b: jax.Array
    limit_b: jax.Array
    steps_b: jax.Array
    tokens_b: jax.Array
    routes_bslk: jax.Array | None = None


class Rows(NamedTuple):
    """Every slot's sequence so far, on the host (`Rollout.rows`).

    sequences_bs int32 [S, P + N] (prompt padding and response end as pad_token_id),
    sequence_mask_bs bool [S, P + N], response_mask_bn bool [S, N], logprobs_bn float32
    [S, N], versions_bn int32 [S, N], routes_bslk [S, P + N, L, k] (a model with experts:
    `SlotState.routes_bslk`; else None).
    """

    sequences_bs: np.ndarray
    sequence_mask_bs: np.ndarray
    response_mask_bn: np.ndarray
    logprobs_bn: np.ndarray
    versions_bn: np.ndarray
    routes_bslk: np.ndarray | None = None

    def map(self, fn) -> "Rows":
        """`fn` applied to each field present (a None field stays None)."""
        return Rows(*(None if x is None else fn(x) for x in self))


class Vacant(NamedTuple):
    """A state of `slots` free slots and a cache of `capacity` response slots, not built yet:
    the first `fill` builds it in the same executable (`Rollout.vacant`)."""

    slots: int
    capacity: int


def ring_holds_all(config: ModelConfig, length: int) -> bool:
    """Whether a cache of `length` slots is, in every layer, a ring of its window (every layer
    slides, as Mistral's, and `length` reaches the window): such a cache holds any number of
    slots in the same bytes (`models.decode_kv`), so its state's capacity is N."""
    return (len(config.sliding_layers) == config.num_layers
            and length >= config.sliding_window)


def cache_len(config: ModelConfig, s: SlotState) -> int:
    """The slots P + C the rows of state `s` may fill: its cache's longest layer's, or P + N
    where every layer is a window's ring (`ring_holds_all`), which may hold fewer."""
    match s.cache:
        case MixedKVCache() as cache:
            length = cache.length
        case KVCache() as cache:
            length = cache.k_lbskd.shape[2]
        case layers:
            length = max(c.length for c in layers)
    if ring_holds_all(config, length):
        return s.prompt_tokens_bp.shape[1] + s.response_bn.shape[1]
    return length


def kv_segments(prompt_mask_bp, n_new: int) -> jax.Array:
    """kv segment ids [b, P + n_new]: real prompt tokens and every response slot (causality
    hides slots not written yet), as `generate` sets them."""
    batch = prompt_mask_bp.shape[0]
    return jnp.concatenate([prompt_mask_bp.astype(jnp.int32),
                            jnp.ones((batch, n_new), jnp.int32)], axis=1)


def stacked_len(config: ModelConfig, length: int) -> int:
    """The slots of the stacked cache [L, S, slots, k, d] of `length` slots: one window's ring
    where every layer slides (Mistral), else every slot (a model without windows; one with
    experts whose layers differ keeps its sliding layers' too: `mixed_cache.splits_cache`)."""
    return max(decode_lengths(config, length))


def zeros_stacked(config: ModelConfig, slots: int, length: int) -> KVCache | MixedKVCache:
    """The stacked state's cache of `length` slots, zeros: a `MixedKVCache` where the layers
    differ in their window (`mixed_cache.splits_cache`), else one stack."""
    if splits_cache(config):
        return MixedKVCache.zeros(config, slots, length)
    return KVCache.zeros(config, slots, stacked_len(config, length))


def _zeros_cache(config: ModelConfig, by_layer: bool, slots: int, length: int):
    if not by_layer:
        return constrain_cache(zeros_stacked(config, slots, length))
    return constrain_cache(tuple(
        DecodeKV.zeros(slots, config.num_kv_heads, config.head_dim, n, config.dtype)
        for n in decode_lengths(config, length)))


def empty_state(config: ModelConfig, by_layer: bool, cfg: GenerateConfig, slots: int,
                prompt_len: int, capacity: int) -> SlotState:
    """Every slot free: a state of `slots` rows, prompts of `prompt_len` and a cache of
    `capacity` response slots (traceable)."""
    n_new = cfg.max_new_tokens
    return SlotState(
        step_b=jnp.zeros((slots,), jnp.int32),
        logits_bv=jnp.zeros((slots, config.vocab_size), jnp.float32),
        last_token_b=jnp.zeros((slots,), jnp.int32),
        done_b=jnp.ones((slots,), bool),
        cache=_zeros_cache(config, by_layer, slots, prompt_len + capacity),
        response_bn=jnp.full((slots, n_new), cfg.pad_token_id, jnp.int32),
        logprobs_bn=jnp.zeros((slots, n_new), jnp.float32),
        mask_bn=jnp.zeros((slots, n_new), bool),
        versions_bn=jnp.full((slots, n_new), NO_VERSION, jnp.int32),
        prompt_tokens_bp=jnp.zeros((slots, prompt_len), jnp.int32),
        prompt_mask_bp=jnp.zeros((slots, prompt_len), bool),
        keys_b=jax.random.split(jax.random.key(0), slots),
        row_b=jnp.zeros((slots,), jnp.int32),
        limit_b=jnp.full((slots,), n_new, jnp.int32),
        steps_b=jnp.zeros((slots,), jnp.int32),
        tokens_b=jnp.zeros((slots,), jnp.int32),
        routes_bslk=(None if config.moe is None
                     else replay.empty_routes(config, slots, prompt_len + n_new)),
    )


def write_prompts(cache, new: KVCache | MixedKVCache, slots_k, length: int, last_k=None):
    """`new`'s rows [k] written into the first `length` cache slots of rows `slots_k` (an
    index >= S is padding, dropped); `new` is stacked [L, k, length, kv, d], or for a
    `MixedKVCache` two such stacks (`decoding.fresh_cache`). A windowed layer's ring shorter
    than `length` takes each row's latest slots up to `last_k` [k] (default: the last,
    `length` - 1; `DecodeKV.write_window`)."""
    if isinstance(cache, MixedKVCache):  # each stack from its own layers' stack of `new`
        return MixedKVCache(*(write_prompts(c, part, slots_k, length, last_k)
                              for c, part in zip(cache, new)))
    if isinstance(cache, KVCache):
        ring = cache.k_lbskd.shape[2]
        if ring < length:  # a window's ring (`stacked_len`): each row's latest slots
            last_k = jnp.full((len(slots_k),), length - 1) if last_k is None else last_k
            new = KVCache(*(_latest_slots(x, last_k, ring) for x in new))
            length = ring
        return KVCache(*(c.at[:, slots_k, :length].set(v.astype(c.dtype), mode="drop")
                         for c, v in zip(cache, new)))
    return tuple(c.write_window(slots_k, k, v, last_k)
                 if last_k is not None and c.length < length else c.write_prefix(slots_k, k, v)
                 for c, k, v in zip(cache, new.k_lbskd, new.v_lbskd))


def _latest_slots(x_lkskd: jax.Array, last_k: jax.Array, ring: int) -> jax.Array:
    """[L, k, ring, kv, d]: each row's latest `ring` slots up to `last_k` [k] of x [L, k, s,
    kv, d], each at its ring position (`models.decode_kv`); positions of slots before 0 zero."""
    slots_kr = ring_slots(last_k, ring)
    index = jnp.maximum(slots_kr, 0)[None, :, :, None, None]
    taken = jnp.take_along_axis(x_lkskd, index, axis=2)
    return jnp.where((slots_kr >= 0)[None, :, :, None, None], taken, 0)


class FillInts(NamedTuple):
    """Columns of a fill's int32 [k, 5] per-target array (one upload, not five)."""

    slot: int = 0  # the target slot (>= S: padding, dropped)
    src: int = 1  # its distinct prompt
    key: int = 2  # its key's index in the key table
    row: int = 3  # its index in its (micro-)batch
    limit: int = 4  # its most response tokens


INTS = FillInts()


def read_rows(cfg: GenerateConfig, s: SlotState) -> Rows:
    prompt_bp = jnp.where(s.prompt_mask_bp, s.prompt_tokens_bp, cfg.pad_token_id)
    return Rows(jnp.concatenate([prompt_bp.astype(jnp.int32), s.response_bn], axis=1),
                jnp.concatenate([s.prompt_mask_bp, s.mask_bn], axis=1), s.mask_bn,
                s.logprobs_bn, s.versions_bn, s.routes_bslk)


def read_poll(s: SlotState) -> tuple[jax.Array, jax.Array]:
    return s.done_b, jnp.stack([jnp.sum(s.steps_b), jnp.sum(s.tokens_b),
                                jnp.max(jnp.where(s.done_b, 0, s.step_b))])


