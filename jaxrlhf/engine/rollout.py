"""The rollout engine: rows decoded in slots, each at its own position, refilled as rows finish,
compacted as they thin out, over a KV cache sized to what the live rows can reach.

Every generation runs here: the synchronous `generate` call kind (jaxrlhf/engine/generate.py
drives it through `decode_rows`, or `decode_at_once`) and the asynchronous rollout workers
(jaxrlhf/run/rollout_worker.py). The engine keeps S rows ("slots") on the device, each at its
own response position, and offers:

  empty(slots, capacity)                      every slot free
  fill(state, params, version, slots, rows)   prefills prompts into free slots (each distinct
                                              prompt once: a GRPO group's n rows share its
                                              prefill) and samples their first tokens
  advance(state, params, version, k, longest) up to k more tokens in every busy slot
  compact(state, keep)                        the slots `keep` only, as a smaller state
  poll(state) / rows(state)                   which slots are done / every slot's row (host)
  reload(state, params, longest)              every cache recomputed under new weights
  decode_at_once(params, version, rows, ...)  a batch that fits in the slots and ends within
                                              a chunk: fill, token loop and read-out in one
                                              executable (no host look in between)

Over 800 lines because the slot state, its device programs and the engine class still share one
file; they become the package `engine/rollout/` (state, programs, engine, one scheduler) when
the three drivers move onto one scheduler, and this file goes.

Slot s's response token i sits in cache slot P + i of row s; a decode step writes each row at
its own slot and attends causally from there, so a refilled slot never sees its predecessor's
keys (they lie after its own position until it overwrites them).

Why the cache has a capacity: a decode step's XLA products read the whole cache array, a
static shape (on XLA:CPU the C++ kernel reads each row only up to its slot,
`kernels/cpu_decode_attention.py`; there the capacity bounds memory and copies). The state's
cache holds P + C slots, C a bucket (`capacity_buckets`: two per octave) just above
what the busy rows reach in the next `advance`; `advance` grows it (or shrinks it, when long
rows have left) before decoding, one copy each time; the synchronous call ends a chunk where
the busy rows outgrow that bucket (`chunk_steps`), rather than read a larger cache for the
whole chunk. A
step then reads at most ~1.5x the live slots, and the engine compiles one `advance` per
(slots, capacity) bucket. On XLA:CPU each
layer keeps its own cache laid out for one-query attention (`models.decode_kv.DecodeKV`,
`engine.decode_layers`); elsewhere the stacked [L, S, P + C, k, d] cache is written by scatter.

`advance` with weights of another version than the cache's first recomputes every slot's cache
from its prompt and response so far (an "interruption"): keys and values of the old policy must
not be mixed with the new one's. Every sampled token records the policy version whose logits it
was drawn from, so a sequence's versions can change part-way.

Sampling keys are the synchronous `generate` call's: a row with key `rng` and index r in its
(micro-)batch samples token i with fold_in(fold_in(rng, i), r), whatever slot it sits in and
whenever it starts, so the engine computes what one static-batch `generate` call computes.

Why one module of over 800 lines: the device-side state (`SlotState`) and the executables that
transform it (fill, advance, compact, resize, reload, decode_at_once) share its layout and
shardings; split, each half would reach into the other's private layout.
"""

from __future__ import annotations

import collections
import functools
from typing import NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec

from jaxrlhf.engine import decode_layers, routes
from jaxrlhf.engine.buckets import CompileCache, bucket_length
from jaxrlhf.engine.call import abstract
from jaxrlhf.engine.decode_layers import LayerByLayer
from jaxrlhf.engine.decoding import (
    CACHE_AXES, DECODE_AXES, GenerateConfig, constrain_cache, decode_model, draw, prefill,
)
from jaxrlhf.models.config import HeadKind, ModelConfig
from jaxrlhf.models.decode_kv import fit_length
from jaxrlhf.models.transformer import DecodeKV, KVCache, Transformer
from jaxrlhf.parallel.layout import Layout, check_batch_divisible
from jaxrlhf.parallel.pipeline import Pipeline
from jaxrlhf.parallel.reshard import fetch, transfer

_REPLICATED = PartitionSpec()
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
        when the model decodes layer by layer, else one stacked
        KVCache [L, S, P + C, k, d].
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


class Rows(NamedTuple):
    """Every slot's sequence so far, on the host (`Rollout.rows`).

    sequences_bs int32 [S, P + N] (prompt padding and response end as pad_token_id),
    sequence_mask_bs bool [S, P + N], response_mask_bn bool [S, N], logprobs_bn float32
    [S, N], versions_bn int32 [S, N].
    """

    sequences_bs: np.ndarray
    sequence_mask_bs: np.ndarray
    response_mask_bn: np.ndarray
    logprobs_bn: np.ndarray
    versions_bn: np.ndarray


class Vacant(NamedTuple):
    """A state of `slots` free slots and a cache of `capacity` response slots, not built yet:
    the first `fill` builds it in the same executable (`Rollout.vacant`)."""

    slots: int
    capacity: int


def _cache_len(cache) -> int:
    return cache.k_lbskd.shape[2] if isinstance(cache, KVCache) else cache[0].length


def _segments_bs(prompt_mask_bp, n_new: int) -> jax.Array:
    """kv segment ids [b, P + n_new]: real prompt tokens and every response slot (causality
    hides slots not written yet), as `generate` sets them."""
    batch = prompt_mask_bp.shape[0]
    return jnp.concatenate([prompt_mask_bp.astype(jnp.int32), jnp.ones((batch, n_new), jnp.int32)],
                           axis=1)


def _choose(s: SlotState, cfg: GenerateConfig, version, at=None) -> SlotState:
    """Samples response token `step_b` of every busy slot (generate's `_choose`, per slot);
    `at` (scalar): the step every busy slot is at, in lockstep (`_advance`)."""
    n_new = s.response_bn.shape[1]
    stream = lambda key, i, r: jax.random.fold_in(jax.random.fold_in(key, i), r)
    keys_b = jax.vmap(stream)(s.keys_b, s.step_b, s.row_b)
    active_b = ~s.done_b
    token_b, logp_b, stopped_b = draw(s.logits_bv, keys_b, active_b, cfg)
    if at is not None:  # one column for every row, written where the rows lie (as `generate`)
        column = functools.partial(jax.lax.dynamic_index_in_dim, index=at, axis=1,
                                   keepdims=False)
        put = lambda x_bn, value_b: jax.lax.dynamic_update_index_in_dim(
            x_bn, jnp.where(active_b, value_b, column(x_bn)).astype(x_bn.dtype), at, axis=1)
    else:
        # Each active row's column step_b; a finished row's write goes to column N, dropped (a
        # select over the whole [S, N] arrays would rewrite them every token).
        rows_b, at_b = jnp.arange(len(s.step_b)), jnp.where(active_b, s.step_b, n_new)
        put = lambda x_bn, value_b: x_bn.at[rows_b, at_b].set(
            jnp.broadcast_to(value_b, at_b.shape).astype(x_bn.dtype), mode="drop")
    step_b = s.step_b + active_b
    return s._replace(
        step_b=step_b,
        last_token_b=jnp.where(active_b, token_b, s.last_token_b),
        done_b=s.done_b | stopped_b | (step_b >= s.limit_b),
        response_bn=put(s.response_bn, token_b),
        logprobs_bn=put(s.logprobs_bn, logp_b),
        mask_bn=put(s.mask_bn, True),
        versions_bn=put(s.versions_bn, version),
        steps_b=s.steps_b + 1,
        tokens_b=s.tokens_b + active_b,
    )


def _zeros_cache(config: ModelConfig, by_layer: bool, slots: int, length: int):
    stacked = KVCache.zeros(config, slots, length)
    if not by_layer:
        return constrain_cache(stacked)
    return constrain_cache(tuple(
        DecodeKV.zeros(slots, config.num_kv_heads, config.head_dim, length, config.dtype)
        for _ in range(config.num_layers)))


def _empty(config: ModelConfig, by_layer: bool, cfg: GenerateConfig, slots: int, prompt_len: int,
           capacity: int) -> SlotState:
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
    )


def _write_prompts(cache, new: KVCache, slots_k, length: int):
    """`new`'s rows [k] written into the first `length` cache slots of rows `slots_k` (an
    index >= S is padding, dropped); `new` is stacked [L, k, length, kv, d]."""
    if isinstance(cache, KVCache):
        return KVCache(*(c.at[:, slots_k, :length].set(v.astype(c.dtype), mode="drop")
                         for c, v in zip(cache, new)))
    return tuple(c.write_prefix(slots_k, k, v) for c, k, v in zip(cache, new.k_lbskd, new.v_lbskd))


class _FillInts(NamedTuple):
    """Columns of a fill's int32 [k, 5] per-target array (one upload, not five)."""

    slot: int = 0  # the target slot (>= S: padding, dropped)
    src: int = 1  # its distinct prompt
    key: int = 2  # its key's index in the key table
    row: int = 3  # its index in its (micro-)batch
    limit: int = 4  # its most response tokens


_INTS = _FillInts()


def _fill(model: Transformer, cfg: GenerateConfig, vacant, write, params, s, ints, prompts_u2p,
          keys, version) -> SlotState:
    """Prefills u distinct prompts once and puts each target's prompt into its slot with its
    key, then samples the filled slots' first tokens; the other slots are left as they are.

    Args:
      vacant: None, or a function building the state (`_empty` of its size): `s` is then
        ignored and the state built here, saving an executable and a round of dispatch.
      write: `_write_targets` (less `cfg`) where the fill runs on each device alone, else
        `Rollout._routed_writes`: it takes the state, `ints`, the prompts' tokens and masks
        [u, P], logits [u, vocab] and prefilled cache, and `keys`.
      ints: the targets (`_write_targets`'s ints_k5; with `Rollout._routed_writes`, also the
        routes of the prompts' rows to their targets' devices).
      prompts_u2p: int32 [u, 2, P] each distinct prompt's tokens and mask (left-padded).
      keys: a tuple of PRNG keys (the key table).
    """
    if vacant is not None:
        s = vacant()
    tokens_up, mask_up = prompts_u2p[:, 0], prompts_u2p[:, 1].astype(bool)
    apply = functools.partial(model.apply, {"params": params})
    # The prompt part of the cache only: later slots keep the old row's keys, hidden by
    # causality until this row's tokens overwrite them.
    logits_uv, new = prefill(apply, model.config, tokens_up, mask_up, _segments_bs(mask_up, 0))
    filled = write(s, ints, tokens_up, mask_up, logits_uv, new, keys)
    fresh_b = ~filled.done_b
    chosen = _choose(filled, cfg, version)
    return chosen._replace(done_b=jnp.where(fresh_b, chosen.done_b, s.done_b),
                           steps_b=s.steps_b, tokens_b=s.tokens_b)  # a prefill is no decode step


def _write_targets(cfg: GenerateConfig, s: SlotState, ints_k5, tokens_up, mask_up, logits_uv,
                   new: KVCache, keys, take=jnp.take) -> SlotState:
    """The state with each target's prompt (its tokens, mask, logits and prefilled cache:
    [u, ...] each) and key written into its slot, ready to sample; the other slots are marked
    done (`_fill` restores them).

    Args:
      ints_k5: int32 [k, 5] per target, columns as `_FillInts` names them.
      keys: a tuple of PRNG keys (the key table).
      take: `take(x, src_k, axis=...)`: the targets' prompts' rows of x (`routes.take` where
        some come from other devices).
    """
    slots_k, src_k, key_k, rows_k, limits_k = (ints_k5[:, i] for i in _INTS)
    keys_k = jnp.stack(keys)[key_k]
    rows = lambda x, axis=0: take(x, src_k, axis=axis)
    prompt_len = s.prompt_tokens_bp.shape[1]
    put = lambda x, value: x.at[slots_k].set(jnp.broadcast_to(value, (len(slots_k),)
                                                              + x.shape[1:]).astype(x.dtype),
                                             mode="drop")
    return s._replace(
        step_b=put(s.step_b, 0), logits_bv=put(s.logits_bv, rows(logits_uv)),
        last_token_b=put(s.last_token_b, 0), done_b=~put(jnp.zeros_like(s.done_b), True),
        cache=constrain_cache(_write_prompts(s.cache, KVCache(*(rows(x, 1) for x in new)),
                                             slots_k, prompt_len)),
        response_bn=put(s.response_bn, cfg.pad_token_id), logprobs_bn=put(s.logprobs_bn, 0.0),
        mask_bn=put(s.mask_bn, False), versions_bn=put(s.versions_bn, NO_VERSION),
        prompt_tokens_bp=put(s.prompt_tokens_bp, rows(tokens_up)),
        prompt_mask_bp=put(s.prompt_mask_bp, rows(mask_up)),
        keys_b=s.keys_b.at[slots_k].set(keys_k, mode="drop"), row_b=put(s.row_b, rows_k),
        limit_b=put(s.limit_b, limits_k))


def _without_state(fill, params, *args) -> SlotState:
    """`fill` of a vacant state: it takes no state argument (it builds its own)."""
    return fill(params, None, *args)


def _advance(model: Transformer, cfg: GenerateConfig, lockstep: bool, params, s: SlotState,
             num_steps, stop_busy, version) -> SlotState:
    """Up to `num_steps` (traced) more tokens in every busy slot (generate's loop body, per
    slot), on the state's cache as it is (its capacity covers every busy row's reach); it
    stops early once at most `stop_busy` (traced) of its slots are busy.

    `lockstep`: every busy row is at the same step (they started together), so a step writes
    every row's keys at one cache slot (a dynamic update in place; a finished row's slot past
    its end takes garbage it never reads) instead of scattering each row's to its own; under
    GSPMD with kv heads split over devices the scatter cost more than the step.
    """
    if isinstance(model.layer_stack, LayerByLayer):  # the loop reads each layer's own weights
        params = decode_layers.split_params(params)
    apply = functools.partial(model.apply, {"params": params})
    slots, prompt_len = s.prompt_tokens_bp.shape
    prompt_lengths_b = jnp.sum(s.prompt_mask_bp, axis=1, dtype=jnp.int32)
    segments_bs = _segments_bs(s.prompt_mask_bp, _cache_len(s.cache) - prompt_len)

    # In lockstep the busy rows' step is one scalar, found once (not a reduction over the
    # rows, across devices, every token).
    first = jnp.max(jnp.where(s.done_b, 0, s.step_b)) if lockstep else None

    def body(carry: tuple[SlotState, jax.Array]) -> tuple[SlotState, jax.Array]:
        r, t = carry
        fed_b = r.step_b - 1  # each row's response token being fed (free slots: harmless)
        at = None if first is None else first + t
        slot = prompt_len + (fed_b if at is None else at - 1)
        logits_b1v, cache = apply(
            r.last_token_b[:, None], (prompt_lengths_b + fed_b)[:, None],
            jnp.ones((slots, 1), jnp.int32), r.cache, slot, segments_bs)
        r = r._replace(logits_bv=logits_b1v[:, 0], cache=constrain_cache(cache))
        return _choose(r, cfg, version, at), t + 1

    def cond(carry: tuple[SlotState, jax.Array]) -> jax.Array:
        busy = jnp.sum(~carry[0].done_b, dtype=jnp.int32)
        return (carry[1] < num_steps) & (busy > jnp.maximum(stop_busy, 0))
    s, _ = jax.lax.while_loop(cond, body, (s, jnp.zeros((), jnp.int32)))
    return s


def _fill_and_decode(fill, advance, finish, params, ints, prompts, table, version, num_steps):
    """A state built and filled (`fill`: `_fill` of a vacant state), decoded in lockstep until
    every row is done or `num_steps` (traced) more tokens (`advance`: `_advance`), then read
    out: (finish(state), work_b2 int32 [S, 2]: each slot's decode steps and tokens sampled)."""
    s = fill(params, None, ints, prompts, table, version)
    s = advance(params, s, num_steps, jnp.zeros((), jnp.int32), version)
    return finish(s), jnp.stack([s.steps_b, s.tokens_b], axis=1)


def _resize(s: SlotState, length: int) -> SlotState:
    """The state with a cache of `length` slots: zero-padded, or cut (the caller knows no busy
    row reaches past the cut)."""
    if isinstance(s.cache, KVCache):
        cache = KVCache(*(fit_length(c, length, 2) for c in s.cache))
    else:
        cache = tuple(c.resized(length) for c in s.cache)
    return s._replace(cache=constrain_cache(cache))


def _compact(axes: tuple[str, ...], s: SlotState, send_1q, at_m) -> SlotState:
    """The state of the kept slots only (rows finished or free may be among them to round the
    size up to a bucket), its decode counts (steps_b, tokens_b) restarted at 0; on each device
    (shard_map), its own slots.

    Why not one take of the kept slots from the whole state (indices the same on every
    device): the SPMD partitioner had each device take the kept rows it holds, zeros for the
    others, and add the results up over the data axes, so every device held the whole
    compacted state of all devices: 70B on v5p d16t4 (a 5.4 GB cache per chip), 98.8 GB of
    temporaries on a 95.7 GB chip. Here each kept row goes to its new device only (module
    `engine.routes`): 0.19 GB there. The stacked cache moves a layer at a time (`lax.map`):
    the rows in flight are one layer's.

    Args:
      axes: the mesh axes the slots are split over.
      send_1q: int32 [1, dp * c] the rows this device sends (`routes.Routes.send_dq`).
      at_m: int32 [m] each new slot's row among this device's own and received ones.
    """
    move = functools.partial(routes.take, at_j=at_m, send_q=send_1q[0], axes=axes)
    if isinstance(s.cache, KVCache):
        cache = KVCache(*(jax.lax.map(move, c) for c in s.cache))
    else:
        cache = tuple(DecodeKV(*map(move, c)) for c in s.cache)
    fields = {name: move(x) for name, x in s._asdict().items() if name != "cache"}
    zeros = jnp.zeros(at_m.shape, jnp.int32)
    return SlotState(**{**fields, "steps_b": zeros, "tokens_b": zeros}, cache=cache)


def _recompute_cache(model: Transformer, n_new: int, params, s: SlotState) -> SlotState:
    """Every slot's KV cache of prompt + its first `n_new` response slots, recomputed under
    `params` (n_new >= every busy slot's step_b; the later slots keep the old keys).

    Slots of tokens not sampled yet hold padding's keys, and slots from n_new on the old
    policy's: causality hides both until the decode loop overwrites them (a step writes its
    token's slot before attending to it). The last sampled token's slot is rewritten by the
    next decode step with the same values.
    """
    apply = functools.partial(model.apply, {"params": params})
    slots, prompt_len = s.prompt_tokens_bp.shape
    prompt_lengths_b = jnp.sum(s.prompt_mask_bp, axis=1, dtype=jnp.int32)
    tokens_bs = jnp.concatenate([s.prompt_tokens_bp, s.response_bn[:, :n_new]], axis=1)
    prompt_positions_bp = jnp.maximum(jnp.cumsum(s.prompt_mask_bp, axis=1, dtype=jnp.int32) - 1,
                                      0)
    response_positions_bn = prompt_lengths_b[:, None] + jnp.arange(n_new, dtype=jnp.int32)
    positions_bs = jnp.concatenate([prompt_positions_bp, response_positions_bn], axis=1)
    segments_bs = _segments_bs(s.prompt_mask_bp, n_new)
    fresh = constrain_cache(KVCache.zeros(model.config, slots, prompt_len + n_new))
    _, fresh = apply(tokens_bs, positions_bs, segments_bs, fresh, 0, segments_bs, last_only=True)
    everyone = jnp.arange(slots)
    return s._replace(cache=constrain_cache(
        _write_prompts(s.cache, fresh, everyone, prompt_len + n_new)))


def _rows(cfg: GenerateConfig, s: SlotState) -> Rows:
    prompt_bp = jnp.where(s.prompt_mask_bp, s.prompt_tokens_bp, cfg.pad_token_id)
    return Rows(jnp.concatenate([prompt_bp.astype(jnp.int32), s.response_bn], axis=1),
                jnp.concatenate([s.prompt_mask_bp, s.mask_bn], axis=1), s.mask_bn,
                s.logprobs_bn, s.versions_bn)


def _poll(s: SlotState) -> tuple[jax.Array, jax.Array]:
    return s.done_b, jnp.stack([jnp.sum(s.steps_b), jnp.sum(s.tokens_b),
                                jnp.max(jnp.where(s.done_b, 0, s.step_b))])


def _pow2(n: int) -> int:
    return 1 << (max(int(n), 1) - 1).bit_length()


def _rank(sorted_x: np.ndarray) -> np.ndarray:
    """Each entry's rank among the equal ones before it (`sorted_x` sorted)."""
    return np.arange(len(sorted_x)) - np.searchsorted(sorted_x, sorted_x)


def _by_device(ints_k5: np.ndarray, device_k: np.ndarray, per_device: int, dp: int
               ) -> tuple[np.ndarray, np.ndarray, int]:
    """A fill's k targets dealt to their slots' devices: (ints int32 [dp * m, 5], device i's m
    targets in rows [i * m, (i + 1) * m) with their own slot indices, padding aimed at local
    slot `per_device`, out of range (its writes are dropped); at_k: each target's row in it;
    m, a power of two: few compiles)."""
    m = _pow2(np.bincount(device_k, minlength=dp).max())
    ints = np.zeros((dp * m, len(_INTS)), np.int32)
    ints[:, _INTS.slot] = per_device
    order = np.argsort(device_k, kind="stable")
    at_k = np.empty(len(device_k), np.int64)
    at_k[order] = device_k[order] * m + _rank(device_k[order])
    ints[at_k] = ints_k5
    ints[at_k, _INTS.slot] -= device_k * per_device
    return ints, at_k, m


def _homes(device_k: np.ndarray, src_k: np.ndarray, prompts: int, dp: int, room: int
           ) -> np.ndarray:
    """Where each of `prompts` distinct prompts is prefilled (an SPMD fill's k targets on
    devices `device_k`, of prompts `src_k`), at most `room` on a device: on one of its targets'
    devices where one has room, so that its rows move to its other targets' devices only (none
    where all lie on one), the one that prefills the fewest so far (a GRPO group's rows take
    turns over the devices, `Rollout.spread`); else on the device that prefills the fewest."""
    pairs = np.unique(src_k * dp + device_k)  # distinct (prompt, device), in order of prompt
    prompt_v, device_v = pairs // dp, pairs % dp
    first_g = np.searchsorted(prompt_v, np.arange(prompts))
    spans_g = np.diff(np.append(first_g, len(pairs)))
    home_g = device_v[first_g]
    # A prompt whose targets lie on one device goes there while it has room (all of them, in
    # a PPO fill, whose targets take turns over the devices); the others in turn.
    alone = spans_g == 1
    order = np.argsort(home_g[alone], kind="stable")
    rank_a = np.empty(int(alone.sum()), np.int64)
    rank_a[order] = _rank(home_g[alone][order])
    placed = np.flatnonzero(alone)[rank_a < room]
    load = np.bincount(home_g[placed], minlength=dp)
    for g in np.setdiff1d(np.arange(prompts), placed):
        options = device_v[first_g[g]:first_g[g] + spans_g[g]]
        options = options[load[options] < room]
        pool = options if len(options) else np.arange(dp)
        home_g[g] = pool[np.argmin(load[pool])]
        load[home_g[g]] += 1
    return home_g


def distinct_prompts(tokens_kp: np.ndarray, mask_kp: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(first_u: the index of each distinct prompt's first row, src_k: each row's distinct
    prompt) of k left-padded prompts [k, P]: rows with equal tokens and mask share a prefill."""
    key_kp = np.where(mask_kp, np.asarray(tokens_kp, np.int64) + 1, 0)
    _, first_u, src_k = np.unique(key_kp, axis=0, return_index=True, return_inverse=True)
    return first_u, src_k.reshape(-1)


class Rollout:
    """The rollout engine of one model on one layout (module docstring).

    Args:
      model_config: an LM-head model.
      gen_config: sampling settings (as for `make_generate_fn`).
      layout: where generation runs; not a pipeline (its stages decode all rows at one slot).
      prompt_len: the (bucketed) prompt length P every prompt is padded to.
      slots: rows decoded at once by default (a multiple of the layout's data-parallel size);
        `empty` and `compact` make states of other sizes.
      compile_cache: where its executables are kept and counted (default: its own).
    """

    def __init__(self, model_config: ModelConfig, gen_config: GenerateConfig, layout: Layout,
                 prompt_len: int, slots: int, compile_cache: CompileCache | None = None):
        if model_config.head is not HeadKind.LM:
            raise ValueError(f"generate needs an LM head, got {model_config.head}")
        self.model = decode_model(model_config, layout)  # as Generator's
        if isinstance(self.model.layer_stack, Pipeline):
            raise ValueError(f"the rollout engine decodes each row at its own position, which a "
                             f"pipelined layout ({layout}) cannot: give actor_gen a layout "
                             "without pipeline stages")
        check_batch_divisible(layout, slots, "rollout slots")
        self.cfg, self.layout = gen_config, layout
        self.prompt_len, self.slots = prompt_len, slots
        self.by_layer = isinstance(self.model.layer_stack, LayerByLayer)
        # Prompts (a fill, a reload) run many tokens through each layer once: the scanned stack
        # slices one layer's weights at a time, where layer by layer holds a copy of them all
        # (worth it only inside the token loop, `engine.decode_layers`).
        self.prefill_model = (Transformer(model_config.replace(scan_layers=True))
                              if self.by_layer else self.model)
        self.compile_cache = CompileCache("rollout") if compile_cache is None else compile_cache
        self._scalar = layout.replicated()
        self._scalars: dict[int, jax.Array] = {}
        # Each data-parallel device can decode its own slots alone when it holds all weights
        # (then each stops a chunk on its own: see `advance`'s stop_busy).
        strategy = layout.strategy
        self.per_device = strategy.fsdp == 1 and strategy.tensor == 1
        self._rows = jax.jit(functools.partial(_rows, gen_config))
        self._poll = jax.jit(_poll)
        self._collect = jax.jit(lambda s: (_poll(s), _rows(gen_config, s)))

    @property
    def compiles(self) -> int:
        return self.compile_cache.compiles

    @staticmethod
    def size(state: SlotState | Vacant) -> tuple[int, int]:
        """(slots S, cache capacity C) of a state."""
        if isinstance(state, Vacant):
            return state.slots, state.capacity
        return state.step_b.shape[0], _cache_len(state.cache) - state.prompt_tokens_bp.shape[1]

    def _shardings(self, slots: int, capacity: int) -> SlotState:
        """Out-shardings of a state: rows over the data axes, the cache as generate's."""
        lay, c = self.layout, self.model.config
        length = self.prompt_len + capacity
        if self.by_layer:
            shapes = DecodeKV.shapes(slots, c.num_kv_heads, c.head_dim, length)
            layer = DecodeKV(*(lay.sharding(axes, shape)
                               for axes, shape in zip(DECODE_AXES, shapes)))
            cache = (layer,) * c.num_layers
        else:
            stacked = lay.sharding(CACHE_AXES, (c.num_layers, slots, length, c.num_kv_heads,
                                                 c.head_dim))
            cache = KVCache(stacked, stacked)
        rows1, rows2 = lay.batch_sharding(1), lay.batch_sharding(2)
        return SlotState(rows1, rows2, rows1, rows1, cache, rows2, rows2, rows2,
                         rows2, rows2, rows2, rows1, rows1, rows1, rows1, rows1)

    def _run(self, key: tuple, build, *args, donate: tuple[int, ...] = ()):
        """Runs the executable of `key`, compiled on its first use from `build()` -> (fn, its
        out-shardings) under the layout's context; the arguments `donate` (the state: it is
        replaced by the result) lend their buffers to the result.

        Why `build` is a thunk: a call that hits the cache (every call after warm-up) then
        makes no jit wrapper, shard_map or shardings (~1 ms of host time per call on the main
        job's shape)."""
        lower = lambda: self._lower(build, *args, donate=donate)
        # The prompt length in the key: a Generator's engines share its compile cache.
        return self.compile_cache.get((self.prompt_len, *key), lower)(*args)

    def _lower(self, build, *args, donate: tuple[int, ...] = ()) -> jax.stages.Lowered:
        """`build()`'s function lowered for `args` (arrays or abstract values) under the
        layout's context."""
        with self.layout.activation_context():
            fn, out_shardings = build()
            jitted = jax.jit(fn, out_shardings=out_shardings, donate_argnums=donate)
            return jitted.lower(*args)

    def _state_out(self, fn, slots: int, capacity: int):
        """`_run`'s build of `fn`, whose result is a state of (slots, capacity)."""
        return lambda: (fn, self._shardings(slots, capacity))

    def _scalar_on_devices(self, value: int) -> jax.Array:
        """An int32 scalar on every device, uploaded once per value (a version, a step
        count): each call would otherwise upload it again."""
        if value not in self._scalars:
            if len(self._scalars) >= 64:  # a worker's versions keep counting up
                self._scalars.clear()
            self._scalars[value] = transfer(np.int32(value), self._scalar)
        return self._scalars[value]

    def empty(self, slots: int | None = None, capacity: int | None = None) -> SlotState:
        """Every slot free: `slots` (default the engine's) rows with a cache of `capacity`
        response slots (default the smallest bucket)."""
        vacant = self.vacant(slots, capacity)
        return self._run(("empty", *vacant),
                         self._state_out(self._empty_fn(vacant, local=False), *vacant))

    def vacant(self, slots: int | None = None, capacity: int | None = None) -> Vacant:
        """`empty`'s state, not built until the first `fill` builds it in its own executable."""
        slots = self.slots if slots is None else slots
        check_batch_divisible(self.layout, slots, "rollout slots")
        capacity = capacity_for(1, self.cfg.max_new_tokens) if capacity is None else capacity
        return Vacant(slots, capacity)

    def _empty_fn(self, vacant: Vacant, local: bool):
        """`_empty` of `vacant`'s size (`local`: each data-parallel device's own slots)."""
        slots = vacant.slots // self.layout.dp_size if local else vacant.slots
        return functools.partial(_empty, self.model.config, self.by_layer, self.cfg, slots,
                                 self.prompt_len, vacant.capacity)

    def fill(self, state: SlotState | Vacant, params, version: int, slots_k, prompt_tokens_kp,
             prompt_mask_kp, keys, rows_k, limits_k=None) -> SlotState:
        """Prefills k left-padded prompts [k, P] into free slots `slots_k` under `params` (of
        policy `version`) and samples their first tokens; equal prompts are prefilled once.

        Args:
          state: the slots, or a `Vacant` one (built by this fill).
          slots_k: int [k] free slots.
          prompt_tokens_kp, prompt_mask_kp: [k, P] host arrays.
          keys: k PRNG keys on the layout's devices (replicated): each row's (micro-)batch key.
          rows_k: int [k] each row's index in its (micro-)batch.
          limits_k: int [k] the most response tokens of each row (default N: up to EOS).
        """
        key, build, args, donate = self._fill_program(state, params, version, slots_k,
                                                      prompt_tokens_kp, prompt_mask_kp, keys,
                                                      rows_k, limits_k)
        return self._run(key, build, *args, donate=donate)

    def _fill_program(self, state, params, version: int, slots_k, prompt_tokens_kp,
                      prompt_mask_kp, keys, rows_k, limits_k, put=transfer, scalar=None):
        """`fill`'s (compile key, build, arguments, donated ones), its inputs placed by `put`
        and its scalars made by `scalar` (as `_at_once_program`)."""
        scalar = scalar or self._scalar_on_devices
        slots, capacity = self.size(state)
        ints, prompts, table, specs, compile_key = self._fill_inputs(
            slots, slots_k, prompt_tokens_kp, prompt_mask_kp, keys, rows_k, limits_k, put)
        vacant = isinstance(state, Vacant)

        def build():
            fn = functools.partial(_fill, self.prefill_model, self.cfg,
                                   self._empty_fn(state, self.per_device) if vacant else None,
                                   self._writes())
            if vacant:  # no state argument: the fill builds it
                fn = functools.partial(_without_state, fn)
            if self.per_device:
                state_specs = self._state_specs(slots, capacity)
                fn = self._on_each_device(
                    fn, (_REPLICATED, *(() if vacant else (state_specs,)), *specs, _REPLICATED,
                         _REPLICATED), state_specs)
            return fn, self._shardings(slots, capacity)

        state_args = () if vacant else (state,)
        return (("fill", vacant, slots, capacity, *compile_key, len(table)), build,
                (params, *state_args, ints, prompts, table, scalar(version)),
                () if vacant else (1,))

    def _fill_inputs(self, slots: int, slots_k, prompt_tokens_kp, prompt_mask_kp, keys, rows_k,
                     limits_k, put=transfer):
        """A fill's device inputs (`fill`'s arguments): (ints, prompts, the key table, the
        partition specs of ints and prompts, their compile-key part), placed by `put`
        (`transfer`; `engine.call.abstract` to lower with nothing placed)."""
        k, prompt_len = np.shape(prompt_tokens_kp)
        if prompt_len != self.prompt_len:
            raise ValueError(f"rollout prompts must be padded to {self.prompt_len}, got "
                             f"{prompt_len}")
        prompts_k2p = np.stack([np.asarray(prompt_tokens_kp, np.int32),
                                np.asarray(prompt_mask_kp, np.int32)], axis=1)
        n_max = self.cfg.max_new_tokens
        limits_k = np.full(k, n_max, np.int32) if limits_k is None else np.minimum(
            np.asarray(limits_k, np.int32), n_max)
        # The rows' keys as indices into a table of the distinct ones (a synchronous call has
        # one, a worker one per batch), stacked on the device: no key per row on the host.
        distinct = {id(key): key for key in keys}
        where = {ident: i for i, ident in enumerate(distinct)}
        table = list(distinct.values())
        table = tuple(table + table[-1:] * (_pow2(len(table)) - len(table)))
        ints_k5 = np.zeros((k, len(_INTS)), np.int32)
        ints_k5[:, _INTS.slot] = slots_k
        ints_k5[:, _INTS.key] = [where[id(key)] for key in keys]
        ints_k5[:, _INTS.row] = rows_k
        ints_k5[:, _INTS.limit] = limits_k
        place = self._fill_on_each_device if self.per_device else self._fill_spmd
        ints, prompts, shardings, compile_key = place(slots, ints_k5, prompts_k2p)
        ints, prompts, table = put((ints, prompts, table),
                                   (*shardings, (self._scalar,) * len(table)))
        specs = jax.tree.map(lambda sharding: sharding.spec, shardings)
        return ints, prompts, table, specs, compile_key

    def _fill_spmd(self, slots: int, ints_k5: np.ndarray, prompts_k2p: np.ndarray):
        """`fill`'s inputs for one SPMD program: ((ints [dp * m, 5], the routes' send_dq),
        prompts [dp * u, 2, P], their shardings, their compile-key part). Each distinct prompt
        is prefilled once, on one of its targets' devices (`_homes`), and its rows go to its
        other targets' devices (`_routed_writes`); each device takes its own m targets
        (`_by_device`), whose src is the row of their prompt among its own and received ones.
        u, m and the routes' width are powers of two: few compiles.
        """
        dp = self.layout.dp_size
        per_device = slots // dp
        device_k = ints_k5[:, _INTS.slot] // per_device
        first_g, src_k = distinct_prompts(prompts_k2p[:, 0], prompts_k2p[:, 1])
        # As many prompts on each device as dealing them out evenly would put there: the
        # prefill's shapes (and so its numbers) are the same wherever a prompt goes.
        u = _pow2(-(-len(first_g) // dp))
        home_g = _homes(device_k, src_k, len(first_g), dp, u)
        order = np.argsort(home_g, kind="stable")
        place_g = np.empty(len(first_g), np.int64)  # its row on its device
        place_g[order] = _rank(home_g[order])
        pick_u = np.zeros(dp * u, np.int64)  # distinct prompt -> input row (padding: row 0)
        pick_u[home_g * u + place_g] = first_g
        moves = routes.plan(home_g[src_k], place_g[src_k], device_k, u, dp)
        ints, at_k, m = _by_device(ints_k5, device_k, per_device, dp)
        ints[at_k, _INTS.src] = moves.at_j
        rows = self.layout.batch_sharding(2)
        return ((ints, moves.send_dq), prompts_k2p[pick_u],
                ((rows, rows), self.layout.batch_sharding(3)), (u, m, moves.width))

    def _fill_on_each_device(self, slots: int, ints_k5: np.ndarray, prompts_k2p: np.ndarray):
        """`_fill_spmd`'s parts with each prompt prefilled on its slot's own device
        (`shard_map`), so that no rows move (ints [dp * m, 5], without routes).

        Why: SPMD, the prompts lie spread over the devices whatever slots they go to, so the
        fill gathered them (five all-gathers per call) for the slot writes.

        Each device takes m targets and prefills its u distinct prompts (powers of two: few
        compiles), padding targets aimed at a local slot out of range, whose writes are
        dropped.
        """
        dp = self.layout.dp_size
        per_device = slots // dp
        device_k = ints_k5[:, _INTS.slot] // per_device
        # Each device's distinct prompts: the distinct (device, prompt) pairs, found with one
        # search over all rows (not one per device), in order of device.
        first_g, src_k = distinct_prompts(prompts_k2p[:, 0], prompts_k2p[:, 1])
        pairs, first_q, local_k = np.unique(device_k * len(first_g) + src_k, return_index=True,
                                            return_inverse=True)
        pair_device_q = pairs // len(first_g)
        local_k = local_k.reshape(-1) - np.searchsorted(pair_device_q, device_k)
        u = _pow2(np.bincount(pair_device_q, minlength=dp).max())
        ints, at_k, m = _by_device(ints_k5, device_k, per_device, dp)
        ints[at_k, _INTS.src] = local_k
        pick_u = np.zeros(dp * u, np.int64)  # distinct prompt -> input row
        pick_u[pair_device_q * u + _rank(pair_device_q)] = first_q
        shardings = self.layout.batch_sharding(2), self.layout.batch_sharding(3)
        return ints, prompts_k2p[pick_u], shardings, (u, m)

    def _writes(self):
        """`_fill`'s `write` on this layout."""
        if self.per_device:  # the whole fill runs on each device
            return functools.partial(_write_targets, self.cfg)
        return self._routed_writes

    def _routed_writes(self, s: SlotState, ints, tokens_up, mask_up, logits_uv, new: KVCache,
                       keys) -> SlotState:
        """`_write_targets` of an SPMD fill on each device (shard_map): its own targets, from
        its own prompts' rows and those the other devices sent it (`ints`: the targets and the
        routes' send_dq, as `_fill_spmd` made them).

        Why: as one SPMD program, the writes' indices (the same on every device) gave every
        device every prompt's prefilled cache (each device's rows added up over the data axes,
        module `engine.routes`): 70B on v5p d16t4, 21.6 GB of temporaries per chip for a fill,
        1.5 GB here.
        """
        lay, axes = self.layout, routes.data_axes(self.layout)
        rows = lambda x: lay.batch_sharding(x.ndim).spec
        cache = lay.spec(CACHE_AXES, new.k_lbskd.shape)
        # The logits stay split over the vocabulary as the model made them: the sampling after
        # the writes then reduces over the vocabulary as it did when the writes were SPMD (the
        # same log-probs to the bit), and no device holds a whole vocabulary before it must.
        vocab = lambda x: lay.spec(("batch", "act_vocab"), x.shape)
        state_specs = self._state_specs(*self.size(s))._replace(logits_bv=vocab(s.logits_bv))

        def local(s, ints, tokens_up, mask_up, logits_uv, new, keys):
            ints_k5, send_1q = ints
            take = functools.partial(routes.take, send_q=send_1q[0], axes=axes)
            return _write_targets(self.cfg, s, ints_k5, tokens_up, mask_up, logits_uv, new, keys,
                                  take)

        in_specs = (state_specs, tuple(map(rows, ints)), rows(tokens_up), rows(mask_up),
                    vocab(logits_uv), KVCache(cache, cache), _REPLICATED)
        return self._on_each_device(local, in_specs, state_specs)(
            s, ints, tokens_up, mask_up, logits_uv, new, keys)

    def decode_at_once(self, params, version: int, prompt_tokens_kp, prompt_mask_kp, keys,
                       rows_k, limits_k, finish):
        """Every row decoded to its end in one executable, row i in slot i: the fill, the token
        loop and `finish` of the final state, with no look from the host in between.

        For a batch that fits in the slots and ends within one chunk of tokens (the main job's
        shape): `fill`, `advance` and `collect` would run the same steps with two more
        dispatches, a sync on the host, and the rows fetched to the host and back.

        Args:
          prompt_tokens_kp, prompt_mask_kp, keys, rows_k, limits_k: as `fill`'s, for k rows (a
            multiple of the data-parallel size); the cache holds the longest limit.
          finish: `f(state) -> pytree` of arrays [k, ...] (a module-level function: it is part
            of the compile key), computed on the device.

        Returns:
          (finish(state), work_k2 int32 [k, 2]: each slot's decode steps and tokens sampled in
          them, as `poll`'s counts), on the device, rows split as the state's.
        """
        key, build, args = self._at_once_program(params, version, prompt_tokens_kp,
                                                 prompt_mask_kp, keys, rows_k, limits_k, finish)
        return self._run(key, build, *args)

    def _at_once_program(self, params, version: int, prompt_tokens_kp, prompt_mask_kp, keys,
                         rows_k, limits_k, finish, put=transfer, scalar=None):
        """`decode_at_once`'s (compile key, build, arguments), its inputs placed by `put` and
        its scalars made by `scalar` (default `_scalar_on_devices`)."""
        scalar = scalar or self._scalar_on_devices
        k = len(prompt_tokens_kp)
        check_batch_divisible(self.layout, k, "rollout slots")
        n_max = self.cfg.max_new_tokens
        reach = n_max if limits_k is None else min(int(np.max(limits_k)), n_max)
        vacant = Vacant(k, capacity_for(reach, n_max))
        ints, prompts, table, specs, compile_key = self._fill_inputs(
            k, np.arange(k), prompt_tokens_kp, prompt_mask_kp, keys, rows_k, limits_k, put)
        args = (params, ints, prompts, table, scalar(version), scalar(reach - 1))

        def build():
            fill = functools.partial(_fill, self.prefill_model, self.cfg,
                                     self._empty_fn(vacant, self.per_device), self._writes())
            advance = functools.partial(_advance, self.model, self.cfg, True)
            fn = functools.partial(_fill_and_decode, fill, advance, finish)
            if self.per_device:
                fn = self._on_each_device(fn, (_REPLICATED, *specs) + (_REPLICATED,) * 3,
                                          self.layout.batch_sharding(1).spec)
            rows = lambda x: self.layout.batch_sharding(x.ndim)
            return fn, jax.tree.map(rows, jax.eval_shape(fn, *args))

        return ("at once", *vacant, *compile_key, len(table), finish), build, args

    def lowered_programs(self, params, prompt_tokens_kp, prompt_mask_kp, key, finish,
                         at_once: bool, compact_to: int | None = None
                         ) -> dict[str, jax.stages.Lowered]:
        """The programs a generate call of k prompts in k slots runs, lowered with nothing
        placed (`params` and the PRNG `key` abstract, module `engine.call`): with `at_once`,
        `decode_at_once`'s one program (`finish` as there); else, as `generate.decode_rows`
        runs them, a fill of every slot, a chunk of decode steps at the largest cache
        (`advance`) and, with `compact_to`, a compaction of that state into so many slots.

        Args:
          prompt_tokens_kp, prompt_mask_kp: [k, P] host arrays (distinct prompts are
            prefilled once: give the call's real repetition, a GRPO group's n copies).
        """
        k = len(prompt_tokens_kp)
        rows_k, keys = np.arange(k, dtype=np.int32), [key] * k
        scalar = lambda value: abstract(np.int32(value), self._scalar)
        if at_once:
            _, build, args = self._at_once_program(params, 0, prompt_tokens_kp, prompt_mask_kp,
                                                   keys, rows_k, None, finish, abstract, scalar)
            return {"decode at once": self._lower(build, *args)}
        _, build, args, donate = self._fill_program(
            self.vacant(k), params, 0, rows_k, prompt_tokens_kp, prompt_mask_kp, keys, rows_k,
            None, abstract, scalar)
        out = {"fill": self._lower(build, *args, donate=donate)}
        largest = Vacant(k, capacity_for(self.cfg.max_new_tokens, self.cfg.max_new_tokens))
        full = abstract(jax.eval_shape(self._empty_fn(largest, local=False)),
                        self._shardings(*largest))
        _, build, args = self._advance_program(full, params, 0, 1, False, 0, scalar)
        out["decode chunk"] = self._lower(build, *args, donate=(1,))
        if compact_to is not None:
            _, build, args = self._compact_program(full, self._spread_moves(k, compact_to),
                                                   abstract)
            out["compaction"] = self._lower(build, *args)
        return out

    def spread(self, free: list[int], slots: int | None = None) -> list[int]:
        """Free slots in the order to fill them: taking turns over the devices (a fill
        prefills as many rows on every device as on its busiest)."""
        per_device = (self.slots if slots is None else slots) // self.layout.dp_size
        taken = collections.Counter()
        order = []
        for slot in sorted(free):
            device = slot // per_device
            order.append((taken[device], device, slot))
            taken[device] += 1
        return [slot for *_, slot in sorted(order)]

    def fit(self, state: SlotState, needed: int) -> SlotState:
        """The state with the capacity bucket of `needed` response slots: grown when it holds
        fewer, cut when it holds more than twice as many (long rows have left); as it is
        otherwise."""
        slots, capacity = self.size(state)
        want = self._fitted(capacity, needed)
        if want == capacity:
            return state
        fn = functools.partial(_resize, length=self.prompt_len + want)
        return self._run(("resize", slots, capacity, want), self._state_out(fn, slots, want),
                         state)

    def _fitted(self, capacity: int, needed: int) -> int:
        """`fit`'s capacity for a state of `capacity` whose rows need `needed` slots."""
        want = capacity_for(needed, self.cfg.max_new_tokens)
        return capacity if want <= capacity <= 2 * want else want

    def chunk_steps(self, state: SlotState, longest: int, num_steps: int) -> int:
        """How many of `num_steps` tokens to `advance` from `longest` (>= 1): up to where the
        busy rows outgrow the cache that holds their next token (the capacity bucket above
        it, or the state's own where `fit` keeps that); the next chunk grows it. The
        synchronous call's chunks (`decode_rows`) end there.

        Why: a cache grown for the whole chunk up front is read at the larger size by every
        step of the chunk. On W-cpu d1 (64 rows, 512 forced tokens, chunks of 32) ending
        chunks at the buckets' ends reads 8% fewer cache slots (1.15x the live ones, not
        1.25x), where a step of 64 slots costs about 10.5 ms + 0.024 ms per cache slot
        (process time of a 16-step `advance` of a filled state at capacities 48 to 1024)."""
        longest = max(int(longest), 1)
        room = self._fitted(self.size(state)[1], longest + 1)
        return max(1, min(num_steps, room - longest))

    def reload(self, state: SlotState, params, longest: int | None = None) -> SlotState:
        """Every slot's cache recomputed under new weights (an interruption).

        Args:
          longest: at least every busy slot's response length so far (`poll`'s third count);
            the cache is recomputed that far, rounded up to a capacity bucket. None: all of
            the state's cache.
        """
        slots, capacity = self.size(state)
        n_new = capacity if longest is None else min(
            capacity_for(longest, self.cfg.max_new_tokens), capacity)
        fn = functools.partial(_recompute_cache, self.prefill_model, n_new)
        return self._run(("reload", slots, capacity, n_new),
                         self._state_out(fn, slots, capacity), params, state,
                         donate=(1,))

    def advance(self, state: SlotState, params, version: int, num_steps: int,
                longest: int | None = None, lockstep: bool = False,
                stop_busy: int = 0) -> SlotState:
        """Up to `num_steps` more tokens in every busy slot under `params` (of policy `version`,
        the weights its cache was computed with: `reload` first after new weights).

        Args:
          longest: at least every busy slot's response length so far (`poll`'s third count;
            a slot filled since has 1): the cache is first fitted to what such rows reach in
            this call (`fit`; `chunk_steps` says how many steps stay within the cache bucket
            holding their next token). None: all max_new_tokens response slots.
          lockstep: every busy slot is at the same step (filled together, none since).
          stop_busy: stop as soon as at most this many slots are busy (0: when all are done):
            the caller can then refill the freed slots or compact the state, rather than
            decode finished rows' slots to the end of the chunk. Decoding each device's own
            slots, each device stops when its share (stop_busy / data-parallel size) is met.
        """
        n_max = self.cfg.max_new_tokens
        needed = n_max if longest is None else max(int(longest), 1) + num_steps
        state = self.fit(state, needed)
        key, build, args = self._advance_program(state, params, version, num_steps, lockstep,
                                                 stop_busy)
        return self._run(key, build, *args, donate=(1,))

    def _advance_program(self, state, params, version: int, num_steps: int, lockstep: bool,
                         stop_busy: int, scalar=None):
        """`advance`'s (compile key, build, arguments) on a state already fitted, its scalars
        made by `scalar` (as `_at_once_program`); the state is donated."""
        scalar = scalar or self._scalar_on_devices
        slots, capacity = self.size(state)

        def build():
            fn = functools.partial(_advance, self.model, self.cfg, lockstep)
            if self.per_device:
                state_specs = self._state_specs(slots, capacity)
                fn = self._on_each_device(fn, (_REPLICATED, state_specs) + (_REPLICATED,) * 3,
                                          state_specs)
            return fn, self._shardings(slots, capacity)

        if self.per_device:
            stop_busy //= self.layout.dp_size
        return (("advance", slots, capacity, lockstep), build,
                (params, state, scalar(num_steps), scalar(stop_busy), scalar(version)))

    def compact(self, state: SlotState, keep: list[int]) -> SlotState:
        """The slots `keep` only, in that order, as a state of len(keep) slots (a multiple of
        the data-parallel size); `poll`'s decode counts restart at 0."""
        slots, _ = self.size(state)
        check_batch_divisible(self.layout, len(keep), "compacted slots")
        dp, keep = self.layout.dp_size, np.asarray(keep)
        own = slots // dp
        moves = routes.plan(keep // own, keep % own, np.arange(len(keep)) // (len(keep) // dp),
                            own, dp)
        key, build, args = self._compact_program(state, moves)
        return self._run(key, build, *args)

    def _compact_program(self, state, moves: routes.Routes, put=transfer):
        """`compact`'s (compile key, build, arguments) for the row moves `moves`, its inputs
        placed by `put` (as `_fill_inputs`)."""
        slots, capacity = self.size(state)
        size = len(moves.at_j)
        shardings = self.layout.batch_sharding(2), self.layout.batch_sharding(1)
        send, at = put((moves.send_dq, moves.at_j), shardings)

        def build():
            fn = functools.partial(_compact, routes.data_axes(self.layout))
            in_specs = (self._state_specs(slots, capacity), *(x.spec for x in shardings))
            fn = self._on_each_device(fn, in_specs, self._state_specs(size, capacity))
            return fn, self._shardings(size, capacity)

        return ("compact", slots, capacity, size, moves.width), build, (state, send, at)

    def _spread_moves(self, slots: int, size: int) -> routes.Routes:
        """Row moves (their shapes: the indices are zeros) as wide as compacting a state of
        `slots` into `size` can need when the kept rows are dealt out in `spread`'s order, as
        `generate.decode_rows` does (`lowered_programs`): each device's kept rows, live and
        not, are two runs of that order, which deals rows to the devices in turn, so a device
        sends another at most ceil(slots / dp / dp) + 1 rows."""
        dp = self.layout.dp_size
        own = slots // dp
        width = 0 if dp == 1 else min(_pow2(-(-own // dp) + 1), own)
        return routes.Routes(np.zeros((dp, dp * width), np.int32), np.zeros(size, np.int32),
                             width)

    def _state_specs(self, slots: int, capacity: int) -> SlotState:
        """The partition specs of a state's arrays."""
        return jax.tree.map(lambda sharding: sharding.spec, self._shardings(slots, capacity))

    def _on_each_device(self, fn, in_specs: tuple, out_specs):
        """`fn` run by each device on its own slots (`shard_map`), its arguments and result
        split as `in_specs` and `out_specs` say (the weights, where it takes them, replicated).

        Why: SPMD, advance's loop condition (are all slots done?) is an all-reduce across the
        data-parallel devices every decode step, where a device that got ahead waits for the
        other; on XLA:CPU that rendezvous cost more than the step itself (tiny model, 16 slots,
        2 devices): each device's own loop stops when its own slots are done. A fill gathered
        its prompts (five all-gathers per call) for the slot writes. On every layout, the
        compaction and an SPMD fill's slot writes run here too, moving rows between devices
        only where the host planned it (module `engine.routes`).
        """
        def local(*args):
            with nn.logical_axis_rules(()):  # local shapes: no sharding constraints inside
                return fn(*args)

        # check_vma off: a scanned prefill's fresh cache (zeros, the same on every device)
        # would have to be cast to varying before it may carry each device's own keys.
        return jax.shard_map(local, mesh=self.layout.mesh, in_specs=in_specs,
                             out_specs=out_specs, check_vma=False)

    def poll(self, state: SlotState) -> tuple[np.ndarray, np.ndarray]:
        """(done_b bool [S], counts int32 [3]: slot-steps decoded, tokens sampled in them, the
        longest busy slot's response so far) on the host (a sync point on small arrays)."""
        return tuple(np.asarray(x) for x in fetch(self._poll(state)))

    def rows(self, state: SlotState) -> Rows:
        """Every slot's sequence so far, on the host."""
        return Rows(*(np.asarray(x) for x in fetch(self._rows(state))))

    def collect(self, state: SlotState) -> tuple[np.ndarray, np.ndarray, Rows]:
        """`poll` and `rows` in one fetch (where the caller expects every row done)."""
        (done_b, counts), rows = fetch(self._collect(state))
        return np.asarray(done_b), np.asarray(counts), Rows(*(np.asarray(x) for x in rows))
