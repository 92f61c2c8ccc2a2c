"""The rollout engine's device programs: pure functions of a `SlotState` (module
`engine.rollout.state`) that `Rollout` (module `engine.rollout.engine`) compiles, one
executable per shape bucket: fill (prefill prompts into free slots and sample their first
tokens), advance (the token loop), resize, compact, abort rows, recompute the cache under new
weights, and fill-and-decode in one program.

A decode step writes each row at its own slot and attends causally from there, so a refilled
slot never sees its predecessor's keys (they lie after its own position until it overwrites
them). Row r of a call with key `rng` samples token i with fold_in(fold_in(rng, i), r),
whatever slot it sits in and whenever it starts.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxrlhf.engine import decode_layers, replay, routes
from jaxrlhf.engine.decode_layers import LayerByLayer
from jaxrlhf.engine.decoding import (
    GenerateConfig, constrain_cache, draw, fresh_cache, prefill,
)
from jaxrlhf.engine.rollout.state import (
    INTS, NO_VERSION, SlotState, cache_len, kv_segments, stacked_len, write_prompts,
)
from jaxrlhf.models.config import ModelConfig
from jaxrlhf.models.decode_kv import fit_length
from jaxrlhf.models.mixed_cache import MixedKVCache
from jaxrlhf.models.transformer import DecodeKV, KVCache, Transformer, decode_lengths


def choose(s: SlotState, cfg: GenerateConfig, version, at=None) -> SlotState:
    """Samples response token `step_b` of every busy slot (generate's `_choose`, per slot);
    `at` (scalar): the step every busy slot is at, in lockstep (`advance`)."""
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


def fill(model: Transformer, cfg: GenerateConfig, vacant, write, params, s, ints, prompts_u2p,
          keys, version) -> SlotState:
    """Prefills u distinct prompts once and puts each target's prompt into its slot with its
    key, then samples the filled slots' first tokens; the other slots are left as they are.

    Args:
      vacant: None, or a function building the state (`empty_state` of its size): `s` is then
        ignored and the state built here, saving an executable and a round of dispatch.
      write: `write_targets` (less `cfg`) where the fill runs on each device alone, else
        `Rollout._routed_writes`: it takes the state, `ints`, the prompts' tokens and masks
        [u, P], logits [u, vocab] and prefilled cache, `keys`, and the prompts' routes
        [u, P, L, k] (a model with experts; else None).
      ints: the targets (`write_targets`'s ints_k5; with `Rollout._routed_writes`, also the
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
    logits_uv, new, routes_uplk = prefill(apply, model, tokens_up, mask_up,
                                          kv_segments(mask_up, 0), s.routes_bslk is not None)
    filled = write(s, ints, tokens_up, mask_up, logits_uv, new, keys, routes_uplk)
    fresh_b = ~filled.done_b
    chosen = choose(filled, cfg, version)
    return chosen._replace(done_b=jnp.where(fresh_b, chosen.done_b, s.done_b),
                           steps_b=s.steps_b, tokens_b=s.tokens_b)  # a prefill is no decode step


def write_targets(cfg: GenerateConfig, s: SlotState, ints_k5, tokens_up, mask_up, logits_uv,
                   new: KVCache | MixedKVCache, keys, routes_uplk=None, take=jnp.take
                   ) -> SlotState:
    """The state with each target's prompt (its tokens, mask, logits and prefilled cache:
    [u, ...] each) and key written into its slot, ready to sample; the other slots are marked
    done (`fill` restores them).

    Args:
      ints_k5: int32 [k, 5] per target, columns as `FillInts` names them.
      keys: a tuple of PRNG keys (the key table).
      routes_uplk: the prompts' experts [u, P, L, k] (`engine.replay`), or None (no experts).
      take: `take(x, src_k, axis=...)`: the targets' prompts' rows of x (`routes.take` where
        some come from other devices).
    """
    slots_k, src_k, key_k, rows_k, limits_k = (ints_k5[:, i] for i in INTS)
    keys_k = jnp.stack(keys)[key_k]
    rows = lambda x, axis=0: take(x, src_k, axis=axis)
    prompt_len = s.prompt_tokens_bp.shape[1]
    put = lambda x, value: x.at[slots_k].set(jnp.broadcast_to(value, (len(slots_k),)
                                                              + x.shape[1:]).astype(x.dtype),
                                             mode="drop")
    return s._replace(
        step_b=put(s.step_b, 0), logits_bv=put(s.logits_bv, rows(logits_uv)),
        last_token_b=put(s.last_token_b, 0), done_b=~put(jnp.zeros_like(s.done_b), True),
        cache=constrain_cache(write_prompts(s.cache, jax.tree.map(lambda x: rows(x, 1), new),
                                             slots_k, prompt_len)),
        response_bn=put(s.response_bn, cfg.pad_token_id), logprobs_bn=put(s.logprobs_bn, 0.0),
        mask_bn=put(s.mask_bn, False), versions_bn=put(s.versions_bn, NO_VERSION),
        prompt_tokens_bp=put(s.prompt_tokens_bp, rows(tokens_up)),
        prompt_mask_bp=put(s.prompt_mask_bp, rows(mask_up)),
        keys_b=s.keys_b.at[slots_k].set(keys_k, mode="drop"), row_b=put(s.row_b, rows_k),
        limit_b=put(s.limit_b, limits_k),
        routes_bslk=None if routes_uplk is None else put(s.routes_bslk, _prompt_routes(
            rows(routes_uplk), s.routes_bslk.shape[1])))


def _prompt_routes(routes_kplk, length: int):
    """A filled row's routes [k, P + N, L, k]: its prompt's, then NO_ROUTE (none fed yet)."""
    k, prompt_len, *rest = routes_kplk.shape
    none = jnp.full((k, length - prompt_len, *rest), replay.NO_ROUTE, routes_kplk.dtype)
    return jnp.concatenate([routes_kplk, none], axis=1)


def without_state(fill, params, *args) -> SlotState:
    """`fill` of a vacant state: it takes no state argument (it builds its own)."""
    return fill(params, None, *args)


def advance(model: Transformer, cfg: GenerateConfig, lockstep: bool, params, s: SlotState,
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
    segments_bs = kv_segments(s.prompt_mask_bp, cache_len(model.config, s) - prompt_len)

    # In lockstep the busy rows' step is one scalar, found once (not a reduction over the
    # rows, across devices, every token).
    first = jnp.max(jnp.where(s.done_b, 0, s.step_b)) if lockstep else None

    def body(carry: tuple[SlotState, jax.Array]) -> tuple[SlotState, jax.Array]:
        r, t = carry
        fed_b = r.step_b - 1  # each row's response token being fed (free slots: harmless)
        at = None if first is None else first + t
        slot = prompt_len + (fed_b if at is None else at - 1)
        record = r.routes_bslk is not None
        out = apply(r.last_token_b[:, None], (prompt_lengths_b + fed_b)[:, None],
                    jnp.ones((slots, 1), jnp.int32), r.cache, slot, segments_bs,
                    **({"mutable": ["intermediates"]} if record else {}))
        (logits_b1v, cache), sown = out if record else (out, None)
        r = r._replace(logits_bv=logits_b1v[:, 0], cache=constrain_cache(cache))
        if record:  # the fed token's experts, at its own slot (a finished row's: dropped)
            at_b = jnp.where(r.done_b, r.routes_bslk.shape[1], prompt_len + fed_b)
            routes_blk = replay.sown_routes(sown, r.routes_bslk.dtype)[:, 0]
            r = r._replace(routes_bslk=r.routes_bslk.at[jnp.arange(slots), at_b].set(
                routes_blk, mode="drop"))
        return choose(r, cfg, version, at), t + 1

    def cond(carry: tuple[SlotState, jax.Array]) -> jax.Array:
        busy = jnp.sum(~carry[0].done_b, dtype=jnp.int32)
        return (carry[1] < num_steps) & (busy > jnp.maximum(stop_busy, 0))
    s, _ = jax.lax.while_loop(cond, body, (s, jnp.zeros((), jnp.int32)))
    return s


def fill_and_decode(fill, advance, finish, params, ints, prompts, table, version, num_steps):
    """A state built and filled (`fill`: `fill` of a vacant state), decoded in lockstep until
    every row is done or `num_steps` (traced) more tokens (`advance`: `advance`), then read
    out: (finish(state), work_b2 int32 [S, 2]: each slot's decode steps and tokens sampled)."""
    s = fill(params, None, ints, prompts, table, version)
    s = advance(params, s, num_steps, jnp.zeros((), jnp.int32), version)
    return finish(s), jnp.stack([s.steps_b, s.tokens_b], axis=1)


def resize(config: ModelConfig, s: SlotState, length: int) -> SlotState:
    """The state with a cache of `length` slots: zero-padded, or cut (the caller knows no busy
    row reaches past the cut); a windowed layer's ring to at most its window (a ring that has
    not wrapped holds slot s at position s, so padding or cutting keeps every slot)."""
    if isinstance(s.cache, MixedKVCache):
        rings = min(length, config.sliding_window)
        cache = MixedKVCache(*(KVCache(*(fit_length(c, n, 2) for c in stack))
                               for stack, n in zip(s.cache, (rings, length))))
    elif isinstance(s.cache, KVCache):
        cache = KVCache(*(fit_length(c, stacked_len(config, length), 2) for c in s.cache))
    else:
        cache = tuple(c.resized(n) for c, n in zip(s.cache, decode_lengths(config, length)))
    return s._replace(cache=constrain_cache(cache))


def compact(axes: tuple[str, ...], s: SlotState, send_1q, at_m) -> SlotState:
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
    if isinstance(s.cache, MixedKVCache):
        cache = s.cache.map(lambda c: jax.lax.map(move, c))
    elif isinstance(s.cache, KVCache):
        cache = KVCache(*(jax.lax.map(move, c) for c in s.cache))
    else:
        cache = tuple(DecodeKV(*map(move, c)) for c in s.cache)
    fields = {name: None if x is None else move(x) for name, x in s._asdict().items()
              if name != "cache"}
    zeros = jnp.zeros(at_m.shape, jnp.int32)
    return SlotState(**{**fields, "steps_b": zeros, "tokens_b": zeros}, cache=cache)


def abort(s: SlotState, abort_b) -> tuple[SlotState, jax.Array]:
    """The rows of `abort_b` (bool [S]) dropped, their slots free (done) as a finished row's;
    (the state, int32: the tokens the busy ones among them had sampled)."""
    dropped_b = abort_b & ~s.done_b
    return (s._replace(done_b=s.done_b | abort_b),
            jnp.sum(jnp.where(dropped_b, s.step_b, 0), dtype=jnp.int32))


def recompute_cache(model: Transformer, n_new: int, params, s: SlotState) -> SlotState:
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
    segments_bs = kv_segments(s.prompt_mask_bp, n_new)
    fresh = constrain_cache(fresh_cache(model, slots, prompt_len + n_new))
    _, fresh = apply(tokens_bs, positions_bs, segments_bs, fresh, 0, segments_bs, last_only=True)
    everyone = jnp.arange(slots)
    # A windowed layer's ring takes each row's latest slots: up to its last sampled token's.
    last_b = prompt_len - 1 + jnp.clip(s.step_b, 0, n_new)
    return s._replace(cache=constrain_cache(
        write_prompts(s.cache, fresh, everyone, prompt_len + n_new, last_b)))


