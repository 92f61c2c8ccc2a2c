"""Continuous, interruptible generation: decode slots refilled as rows finish, new weights
swapped in mid-sequence.

AReaL's rollout workers wait neither for the trainer (sequences being decoded continue under
new weights) nor for a batch's longest response (a slot whose row finished takes the next
prompt). This module keeps `slots` rows on the device, each at its own response position, and
runs the `generate` call kind's prefill, sampling and KV-cache layout
(jaxrlhf/engine/generate.py) on them:

  empty()                                     every slot free
  fill(state, params, version, slots, rows)   prefills prompts into free slots; first tokens
  advance(state, params, version, k)          up to k more tokens in every busy slot
  poll(state)                                 which slots are done (host)
  rows(state)                                 every slot's sequence so far (host)

Slot s's response token i sits in cache slot P + i of row s. A decode step writes each row at
its own slot (`Transformer` with a per-row `cache_index`) and attends causally from there, so
a refilled slot never sees its predecessor's keys: they lie after its own position until it
overwrites them. `advance` with weights of another version than the cache's first recomputes
every slot's cache from its prompt and response so far (an "interruption"): keys and values of
the old policy must not be mixed with the new one's. Every sampled token records the policy
version whose logits it was drawn from, so a sequence's versions can change part-way.

Sampling keys are the synchronous `generate` call's: a row with key `rng` and index r in its
(micro-)batch samples token i with fold_in(fold_in(rng, i), r), whatever slot it sits in and
whenever it starts, so a batch decoded on its own computes exactly what one `generate` call
does.
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

from jaxrlhf.engine import decode_layers
from jaxrlhf.engine.buckets import CompileCache, bucket_length, power_of_two_buckets
from jaxrlhf.engine.decode_layers import LayerByLayer
from jaxrlhf.engine.generate import (
    _CACHE_AXES, GenerateConfig, _constrain_cache, _prefill, decode_model, draw,
)
from jaxrlhf.models.config import HeadKind, ModelConfig
from jaxrlhf.models.transformer import KVCache, Transformer
from jaxrlhf.parallel.layout import Layout, check_batch_divisible
from jaxrlhf.parallel.pipeline import Pipeline
from jaxrlhf.parallel.reshard import fetch

NO_VERSION = -1  # versions_bn where no token was sampled


class SlotState(NamedTuple):
    """The rows being generated, one per slot (a pytree on the generation layout).

    Attributes:
      step_b: int32 [S] index of each slot's next response token.
      logits_bv: float32 [S, vocab] the model's prediction of that token.
      last_token_b: int32 [S] response token step - 1.
      done_b: bool [S] nothing to decode: the row stopped (EOS or N tokens) or the slot is free.
      cache: KVCache [L, S, P + N, kv_heads, head_dim].
      response_bn: int32 [S, N] sampled tokens (pad_token_id after the end).
      logprobs_bn: float32 [S, N] each token's log-prob (0 where none).
      mask_bn: bool [S, N] sampled tokens.
      versions_bn: int32 [S, N] policy version that sampled each token (NO_VERSION: none).
      prompt_tokens_bp: int32 [S, P] left-padded prompts.
      prompt_mask_bp: bool [S, P].
      keys_b: PRNG keys [S]: each row's (micro-)batch key.
      row_b: int32 [S] each row's index in its (micro-)batch (its sampling stream).
      steps_b: int32 [S] decode steps run over each slot, busy or not; tokens_b: int32 [S]
        tokens each slot sampled in them (the slots' occupancy; per slot, so a step needs no
        reduction across devices, and each device may stop when its own slots are done).
    """

    step_b: jax.Array
    logits_bv: jax.Array
    last_token_b: jax.Array
    done_b: jax.Array
    cache: KVCache
    response_bn: jax.Array
    logprobs_bn: jax.Array
    mask_bn: jax.Array
    versions_bn: jax.Array
    prompt_tokens_bp: jax.Array
    prompt_mask_bp: jax.Array
    keys_b: jax.Array
    row_b: jax.Array
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


def _segments_bs(prompt_mask_bp, n_new: int) -> jax.Array:
    """kv segment ids [b, P + N]: real prompt tokens and every response slot (causality hides
    slots not written yet), as `generate` sets them."""
    batch = prompt_mask_bp.shape[0]
    return jnp.concatenate([prompt_mask_bp.astype(jnp.int32), jnp.ones((batch, n_new), jnp.int32)],
                           axis=1)


def _choose(s: SlotState, cfg: GenerateConfig, version) -> SlotState:
    """Samples response token `step_b` of every busy slot (generate's `_choose`, per slot)."""
    n_new = s.response_bn.shape[1]
    stream = lambda key, i, r: jax.random.fold_in(jax.random.fold_in(key, i), r)
    keys_b = jax.vmap(stream)(s.keys_b, s.step_b, s.row_b)
    active_b = ~s.done_b
    token_b, logp_b, stopped_b = draw(s.logits_bv, keys_b, active_b, cfg)
    at_bn = (jnp.arange(n_new)[None, :] == s.step_b[:, None]) & active_b[:, None]
    put = lambda x_bn, value_b: jnp.where(at_bn, value_b[:, None], x_bn)
    step_b = s.step_b + active_b
    return s._replace(
        step_b=step_b,
        last_token_b=jnp.where(active_b, token_b, s.last_token_b),
        done_b=s.done_b | stopped_b | (step_b >= n_new),
        response_bn=put(s.response_bn, token_b),
        logprobs_bn=put(s.logprobs_bn, logp_b),
        mask_bn=s.mask_bn | at_bn,
        versions_bn=put(s.versions_bn, jnp.broadcast_to(version, step_b.shape).astype(jnp.int32)),
        steps_b=s.steps_b + 1,
        tokens_b=s.tokens_b + active_b,
    )


def _empty(config: ModelConfig, cfg: GenerateConfig, slots: int, prompt_len: int) -> SlotState:
    n_new = cfg.max_new_tokens
    return SlotState(
        step_b=jnp.zeros((slots,), jnp.int32),
        logits_bv=jnp.zeros((slots, config.vocab_size), jnp.float32),
        last_token_b=jnp.zeros((slots,), jnp.int32),
        done_b=jnp.ones((slots,), bool),
        cache=_constrain_cache(KVCache.zeros(config, slots, prompt_len + n_new)),
        response_bn=jnp.full((slots, n_new), cfg.pad_token_id, jnp.int32),
        logprobs_bn=jnp.zeros((slots, n_new), jnp.float32),
        mask_bn=jnp.zeros((slots, n_new), bool),
        versions_bn=jnp.full((slots, n_new), NO_VERSION, jnp.int32),
        prompt_tokens_bp=jnp.zeros((slots, prompt_len), jnp.int32),
        prompt_mask_bp=jnp.zeros((slots, prompt_len), bool),
        keys_b=jax.random.split(jax.random.key(0), slots),
        row_b=jnp.zeros((slots,), jnp.int32),
        steps_b=jnp.zeros((slots,), jnp.int32),
        tokens_b=jnp.zeros((slots,), jnp.int32),
    )


def _fill(model: Transformer, cfg: GenerateConfig, params, s: SlotState, slots_k, tokens_kp,
          mask_kp, keys_k, rows_k, version) -> SlotState:
    """Prefills k prompts into slots `slots_k` (an index >= S is padding, dropped) and samples
    their first tokens; the other slots are left as they are."""
    apply = functools.partial(model.apply, {"params": params})
    prompt_len = s.prompt_tokens_bp.shape[1]
    mask_kp = mask_kp.astype(bool)
    # The prompt part of the cache only: later slots keep the old row's keys, hidden by
    # causality until this row's tokens overwrite them.
    new = _prefill(apply, model.config, cfg, tokens_kp, mask_kp, _segments_bs(mask_kp, 0))
    put = lambda x, value: x.at[slots_k].set(jnp.broadcast_to(value, (len(slots_k),)
                                                              + x.shape[1:]).astype(x.dtype),
                                             mode="drop")
    cache = KVCache(*(c.at[:, slots_k, :prompt_len].set(v.astype(c.dtype), mode="drop")
                      for c, v in zip(s.cache, new.cache)))
    fresh_b = put(jnp.zeros_like(s.done_b), True)
    filled = s._replace(
        step_b=put(s.step_b, 0), logits_bv=put(s.logits_bv, new.logits_bv),
        last_token_b=put(s.last_token_b, 0), done_b=~fresh_b, cache=_constrain_cache(cache),
        response_bn=put(s.response_bn, cfg.pad_token_id), logprobs_bn=put(s.logprobs_bn, 0.0),
        mask_bn=put(s.mask_bn, False), versions_bn=put(s.versions_bn, NO_VERSION),
        prompt_tokens_bp=put(s.prompt_tokens_bp, tokens_kp),
        prompt_mask_bp=put(s.prompt_mask_bp, mask_kp),
        keys_b=s.keys_b.at[slots_k].set(keys_k, mode="drop"), row_b=put(s.row_b, rows_k))
    chosen = _choose(filled, cfg, version)
    return chosen._replace(done_b=jnp.where(fresh_b, chosen.done_b, s.done_b),
                           steps_b=s.steps_b, tokens_b=s.tokens_b)  # a prefill is no decode step


def _advance(model: Transformer, cfg: GenerateConfig, num_steps: int, n_new: int, params,
             s: SlotState, version) -> SlotState:
    """Up to `num_steps` more tokens in every busy slot (generate's loop body, per slot), on
    the cache's first P + n_new slots (n_new >= every busy slot's step_b + num_steps - 1).

    Why the cut: a step attends over its whole cache array, written or not (as generate's
    growing segments, `decode_layers.segment_ends`); slots past every busy row's end are
    neither read nor written this call. A free slot's write past the cut is dropped.
    """
    full = s.cache
    prompt_len = s.prompt_tokens_bp.shape[1]
    cache = KVCache(*(c[:, :, :prompt_len + n_new] for c in full))
    layer_by_layer = isinstance(model.layer_stack, LayerByLayer)
    if layer_by_layer:  # as in generate: the loop reads each layer's own weights and cache
        params = decode_layers.split_params(params)
        cache = decode_layers.split_cache(cache)
    s = s._replace(cache=_constrain_cache(cache))
    apply = functools.partial(model.apply, {"params": params})
    slots = s.prompt_tokens_bp.shape[0]
    prompt_lengths_b = jnp.sum(s.prompt_mask_bp, axis=1, dtype=jnp.int32)
    segments_bs = _segments_bs(s.prompt_mask_bp, n_new)

    def body(carry: tuple[SlotState, jax.Array]) -> tuple[SlotState, jax.Array]:
        r, t = carry
        fed_b = r.step_b - 1  # each row's response token being fed (free slots: harmless)
        logits_b1v, cache = apply(
            r.last_token_b[:, None], (prompt_lengths_b + fed_b)[:, None],
            jnp.ones((slots, 1), jnp.int32), r.cache, prompt_len + fed_b, segments_bs)
        r = r._replace(logits_bv=logits_b1v[:, 0], cache=_constrain_cache(cache))
        return _choose(r, cfg, version), t + 1

    cond = lambda carry: (carry[1] < num_steps) & ~jnp.all(carry[0].done_b)
    s, _ = jax.lax.while_loop(cond, body, (s, jnp.zeros((), jnp.int32)))
    # Back into the whole (donated) cache in place, layer by layer or at once.
    cut = s.cache if layer_by_layer else (s.cache,)
    for layer, c in enumerate(cut):
        at = (layer,) if layer_by_layer else (0,)
        full = KVCache(*(jax.lax.dynamic_update_slice(
            whole, (part[None] if layer_by_layer else part), at + (0,) * (whole.ndim - 1))
            for whole, part in zip(full, c)))
    return s._replace(cache=_constrain_cache(full))


def _recompute_cache(model: Transformer, cfg: GenerateConfig, n_new: int, params,
                     s: SlotState) -> SlotState:
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
    cache = _constrain_cache(KVCache.zeros(model.config, slots, prompt_len + n_new))
    _, cache = apply(tokens_bs, positions_bs, segments_bs, cache, 0, segments_bs, last_only=True)
    cache = KVCache(*(jax.lax.dynamic_update_slice(old, new.astype(old.dtype), (0,) * old.ndim)
                      for old, new in zip(s.cache, cache)))
    return s._replace(cache=_constrain_cache(cache))


def _rows(cfg: GenerateConfig, s: SlotState) -> Rows:
    prompt_bp = jnp.where(s.prompt_mask_bp, s.prompt_tokens_bp, cfg.pad_token_id)
    return Rows(jnp.concatenate([prompt_bp.astype(jnp.int32), s.response_bn], axis=1),
                jnp.concatenate([s.prompt_mask_bp, s.mask_bn], axis=1), s.mask_bn,
                s.logprobs_bn, s.versions_bn)


def _response_bucket(n: int, n_max: int) -> int:
    """Response slots to compute for rows up to n long: a power of two >= 8 (few compiles),
    at most n_max."""
    return bucket_length(min(int(n), n_max), power_of_two_buckets(n_max, min_len=8))


def _fill_size(k: int, dp: int, slots: int) -> int:
    """Rows of a fill call for k prompts: dp x a power of two, at most `slots` (few compiles;
    the rows stay spread over the data-parallel devices)."""
    per_device = -(-k // dp)
    return min(slots, dp * (1 << (per_device - 1).bit_length()))


class Rollout:
    """Continuous, interruptible generation of one model on one layout (module docstring).

    Args:
      model_config: an LM-head model.
      gen_config: sampling settings (as for `make_generate_fn`).
      layout: where generation runs; not a pipeline (its stages decode all rows at one slot).
      prompt_len: the (bucketed) prompt length P every prompt is padded to.
      slots: rows decoded at once (a multiple of the layout's data-parallel size).
    """

    def __init__(self, model_config: ModelConfig, gen_config: GenerateConfig, layout: Layout,
                 prompt_len: int, slots: int):
        if model_config.head is not HeadKind.LM:
            raise ValueError(f"generate needs an LM head, got {model_config.head}")
        self.model = decode_model(model_config, layout)  # as Generator's
        if isinstance(self.model.layer_stack, Pipeline):
            raise ValueError(f"asynchronous generation decodes each row at its own position, "
                             f"which a pipelined layout ({layout}) cannot: give actor_gen "
                             "a layout without pipeline stages")
        check_batch_divisible(layout, slots, "rollout slots")
        self.cfg, self.layout = gen_config, layout
        self.prompt_len, self.slots = prompt_len, slots
        self.compile_cache = CompileCache("rollout")
        self._scalar = layout.replicated()
        self._state = self._shardings()
        # Each data-parallel device can decode its own slots alone when it holds all weights.
        strategy = layout.strategy
        self._per_device = strategy.fsdp == 1 and strategy.tensor == 1
        self._rows = jax.jit(functools.partial(_rows, gen_config))
        self._poll = jax.jit(lambda s: (s.done_b, jnp.stack([
            jnp.sum(s.steps_b), jnp.sum(s.tokens_b), jnp.max(jnp.where(s.done_b, 0, s.step_b))])))

    @property
    def compiles(self) -> int:
        return self.compile_cache.compiles

    def _shardings(self) -> SlotState:
        """Out-shardings of the state: rows over the data axes, the cache as generate's."""
        lay, n, c = self.layout, self.cfg.max_new_tokens, self.model.config
        cache_shape = (c.num_layers, self.slots, self.prompt_len + n, c.num_kv_heads, c.head_dim)
        cache = lay.sharding(_CACHE_AXES, cache_shape)
        rows1, rows2 = lay.batch_sharding(1), lay.batch_sharding(2)
        return SlotState(rows1, rows2, rows1, rows1, KVCache(cache, cache), rows2, rows2, rows2,
                         rows2, rows2, rows2, rows1, rows1, rows1, rows1)

    def _run(self, key: tuple, fn, *args, donate: tuple[int, ...] = ()) -> SlotState:
        """Compiles `fn(*args)` once per `key` under the layout's context; the arguments
        `donate` (the state: it is replaced by the result) lend their buffers to the result."""
        jitted = jax.jit(fn, out_shardings=self._state, donate_argnums=donate)

        def lower():
            with self.layout.activation_context():
                return jitted.lower(*args)

        return self.compile_cache.get(key, lower)(*args)

    def _version(self, version: int) -> jax.Array:
        return jax.device_put(np.int32(version), self._scalar)

    def empty(self) -> SlotState:
        """Every slot free."""
        fn = functools.partial(_empty, self.model.config, self.cfg, self.slots, self.prompt_len)
        return self._run(("empty",), fn)

    def fill(self, state: SlotState, params, version: int, slots_k, prompt_tokens_kp,
             prompt_mask_kp, keys, rows_k) -> SlotState:
        """Prefills k left-padded prompts [k, P] into free slots `slots_k` under `params` (of
        policy `version`) and samples their first tokens.

        Args:
          slots_k: int [k] free slots.
          prompt_tokens_kp, prompt_mask_kp: [k, P] host arrays.
          keys: k PRNG keys: each row's (micro-)batch key.
          rows_k: int [k] each row's index in its (micro-)batch.
        """
        k, prompt_len = np.shape(prompt_tokens_kp)
        if prompt_len != self.prompt_len:
            raise ValueError(f"rollout prompts must be padded to {self.prompt_len}, got "
                             f"{prompt_len}")
        if self._per_device:
            return self._fill_on_each_device(state, params, version, np.asarray(slots_k),
                                             prompt_tokens_kp, prompt_mask_kp, keys, rows_k)
        size = _fill_size(k, self.layout.dp_size, self.slots)
        # Padding rows repeat the last one into slot S: out of range, their writes are dropped.
        pad = lambda x: np.concatenate([x, np.repeat(x[-1:], size - k, 0)])
        rows = self.layout.batch_sharding(1), self.layout.batch_sharding(2)
        tokens_kp, mask_kp = jax.device_put(
            (pad(np.asarray(prompt_tokens_kp, np.int32)), pad(np.asarray(prompt_mask_kp, bool))),
            rows[1])
        keys_k = jax.device_put(jnp.stack(list(keys) + [keys[-1]] * (size - k)), rows[0])
        rows_k = jax.device_put(pad(np.asarray(rows_k, np.int32)), rows[0])
        slots_k = jax.device_put(np.concatenate([np.asarray(slots_k, np.int32),
                                                 np.full(size - k, self.slots, np.int32)]),
                                 self._scalar)
        fn = functools.partial(_fill, self.model, self.cfg)
        return self._run(("fill", size), fn, params, state, slots_k, tokens_kp, mask_kp, keys_k,
                         rows_k, self._version(version), donate=(1,))

    def _fill_on_each_device(self, state: SlotState, params, version: int, slots_k,
                             prompt_tokens_kp, prompt_mask_kp, keys, rows_k) -> SlotState:
        """`fill` with each prompt prefilled on its slot's own device (`shard_map`).

        Why: SPMD, the prompts lie spread over the devices whatever slots they go to, so the
        fill gathered them (five all-gathers per call) for the slot writes.

        Each device takes m rows (a power of two: few compiles): its prompts, then padding rows
        (a copy of prompt 0) aimed at a local slot out of range, whose writes are dropped.
        """
        per_device = self.slots // self.layout.dp_size
        device_k = slots_k // per_device
        m = 1 << (int(np.bincount(device_k).max()) - 1).bit_length()
        pick = np.zeros(self.layout.dp_size * m, np.int64)
        local = np.full(self.layout.dp_size * m, per_device, np.int32)
        for device in np.unique(device_k):
            mine = np.flatnonzero(device_k == device)
            at = slice(device * m, device * m + len(mine))
            pick[at], local[at] = mine, slots_k[mine] - device * per_device
        row, rows = self.layout.batch_sharding(1), self.layout.batch_sharding(2)
        tokens_kp, mask_kp = jax.device_put(
            (np.asarray(prompt_tokens_kp, np.int32)[pick], np.asarray(prompt_mask_kp, bool)[pick]),
            rows)
        keys_k = jax.device_put(jnp.stack([keys[i] for i in pick]), row)
        rows_k, local_k = jax.device_put((np.asarray(rows_k, np.int32)[pick], local), row)
        fn = self._on_each_device(functools.partial(_fill, self.model, self.cfg),
                                  row.spec, rows.spec, rows.spec, row.spec, row.spec)
        return self._run(("fill", m), fn, params, state, local_k, tokens_kp, mask_kp, keys_k,
                         rows_k, self._version(version), donate=(1,))

    def spread(self, free: list[int]) -> list[int]:
        """Free slots in the order to fill them: taking turns over the devices (a fill
        prefills as many rows on every device as on its busiest)."""
        per_device = self.slots // self.layout.dp_size
        taken = collections.Counter()
        order = []
        for slot in sorted(free):
            device = slot // per_device
            order.append((taken[device], device, slot))
            taken[device] += 1
        return [slot for *_, slot in sorted(order)]

    def reload(self, state: SlotState, params, longest: int | None = None) -> SlotState:
        """Every slot's cache recomputed under new weights (an interruption).

        Args:
          longest: at least every busy slot's response length so far (`poll`'s third count);
            the cache is recomputed that far, rounded up to a power of two (few compiles).
            None: all max_new_tokens slots.
        """
        n_max = self.cfg.max_new_tokens
        n_new = n_max if longest is None else _response_bucket(longest, n_max)
        fn = functools.partial(_recompute_cache, self.model, self.cfg, n_new)
        return self._run(("reload", n_new), fn, params, state, donate=(1,))

    def advance(self, state: SlotState, params, version: int, num_steps: int,
                longest: int | None = None) -> SlotState:
        """Up to `num_steps` more tokens in every busy slot under `params` (of policy `version`,
        the weights its cache was computed with: `reload` first after new weights).

        Args:
          longest: at least every busy slot's response length so far (`poll`'s third count;
            a slot filled since has 1): the steps attend over as many cache slots as such rows
            can reach in this call, rounded up to a power of two. None: all of them.
        """
        n_max = self.cfg.max_new_tokens
        n_new = (n_max if longest is None
                 else _response_bucket(max(int(longest), 1) + num_steps, n_max))
        fn = functools.partial(_advance, self.model, self.cfg, num_steps, n_new)
        if self._per_device:
            fn = self._on_each_device(fn)
        return self._run(("advance", num_steps, n_new), fn, params, state,
                         self._version(version), donate=(1,))

    def _on_each_device(self, fn, *arg_specs: PartitionSpec):
        """`fn(params, state, *args, version)` run by each device on its own slots
        (`shard_map`; the weights are replicated), `args` split as `arg_specs` say.

        Why: SPMD, advance's loop condition (are all slots done?) is an all-reduce across the
        data-parallel devices every decode step, where a device that got ahead waits for the
        other; on XLA:CPU that rendezvous cost more than the step itself (tiny model, 16 slots,
        2 devices): each device's own loop stops when its own slots are done. A fill gathered
        its prompts (five all-gathers per call) for the slot writes.
        """
        specs = jax.tree.map(lambda sharding: sharding.spec, self._state)

        def local(*args):
            with nn.logical_axis_rules(()):  # local shapes: no sharding constraints inside
                return fn(*args)

        return jax.shard_map(local, mesh=self.layout.mesh, out_specs=specs,
                             in_specs=(PartitionSpec(), specs, *arg_specs, PartitionSpec()))

    def poll(self, state: SlotState) -> tuple[np.ndarray, np.ndarray]:
        """(done_b bool [S], counts int32 [3]: slot-steps decoded, tokens sampled in them, the
        longest busy slot's response so far) on the host (a sync point on small arrays)."""
        return tuple(np.asarray(x) for x in fetch(self._poll(state)))

    def rows(self, state: SlotState) -> Rows:
        """Every slot's sequence so far, on the host."""
        return Rows(*(np.asarray(x) for x in fetch(self._rows(state))))
