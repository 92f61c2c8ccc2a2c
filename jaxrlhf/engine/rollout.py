"""Interruptible generation: decoding in chunks, with new weights swapped in mid-sequence.

AReaL's rollout workers never wait for the trainer: when the trainer publishes new weights,
sequences being decoded continue under them. This module runs the `generate` call kind
(jaxrlhf/engine/generate.py, whose prefill, sampling step and KV-cache layout it reuses) as
a resumable state on the device:

  start(params, version, prompts)      prefill + the first token
  advance(state, params, version, k)   up to k more tokens (a `lax.while_loop` per chunk)
  finish(state)                        the GenerateOutput, plus the version of every token

`advance` with weights of another version than the state's KV cache first recomputes the cache
from the prompt and the response so far under the new weights (an "interruption"): keys and
values of the old policy must not be mixed with the new one's. Every sampled token records the
policy version whose logits it was drawn from, so a sequence's versions can change part-way.

Without interruptions the chunks compute exactly what one `generate` call does: the same
cache slots, the same sampling keys (row r's token i uses fold_in(fold_in(rng, i), r)).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxrlhf.engine import decode_layers
from jaxrlhf.engine.buckets import CompileCache
from jaxrlhf.engine.decode_layers import LayerByLayer
from jaxrlhf.engine.generate import (
    _CACHE_AXES, GenerateConfig, GenerateOutput, _choose, _constrain_cache, _DecodeState,
    _prefill, _unfinished, decode_model,
)
from jaxrlhf.models.config import HeadKind, ModelConfig
from jaxrlhf.models.sizes import abstract_params
from jaxrlhf.models.transformer import KVCache, Transformer
from jaxrlhf.parallel.layout import Layout, check_batch_divisible
from jaxrlhf.parallel.reshard import fetch, transfer

NO_VERSION = -1  # versions_bn where no token was sampled


class RolloutState(NamedTuple):
    """A batch being generated (a pytree on the generation layout).

    Attributes:
      decode: generate's decode state (step, logits, last token, done, KV cache, response,
        log-probs, mask).
      prompt_tokens_bp: int32 [b, P] left-padded prompts.
      prompt_mask_bp: bool [b, P].
      versions_bn: int32 [b, N] policy version that sampled each token (NO_VERSION after EOS).
      rng: the batch's PRNG key.
    """

    decode: _DecodeState
    prompt_tokens_bp: jax.Array
    prompt_mask_bp: jax.Array
    versions_bn: jax.Array
    rng: jax.Array


@dataclasses.dataclass
class InFlight:
    """Host handle of a batch being generated.

    Attributes:
      state: the device state.
      version: the policy version its KV cache was computed with.
      interruptions: weight swaps this batch went through.
      finished: every row has stopped (set by `Rollout.poll`).
    """

    state: RolloutState
    version: int
    interruptions: int = 0
    finished: bool = False


def _record(s: RolloutState, new: _DecodeState, version) -> RolloutState:
    """`s` after `_choose` sampled token `s.decode.step` into `new`: the token's version."""
    token_version_b = jnp.where(~s.decode.done_b, version, NO_VERSION).astype(jnp.int32)
    versions_bn = jax.lax.dynamic_update_index_in_dim(s.versions_bn, token_version_b,
                                                      s.decode.step, axis=1)
    return s._replace(decode=new, versions_bn=versions_bn)


def _segments_bs(prompt_mask_bp, n_new: int) -> jax.Array:
    """kv segment ids [b, P + N]: real prompt tokens and every response slot (causality hides
    slots not written yet), as `generate` sets them."""
    batch = prompt_mask_bp.shape[0]
    return jnp.concatenate([prompt_mask_bp.astype(jnp.int32), jnp.ones((batch, n_new), jnp.int32)],
                           axis=1)


def _start(model: Transformer, cfg: GenerateConfig, params, prompt_tokens_bp, prompt_mask_bp,
           rng, version) -> RolloutState:
    apply = functools.partial(model.apply, {"params": params})
    prompt_mask_bp = prompt_mask_bp.astype(bool)
    segments_bs = _segments_bs(prompt_mask_bp, cfg.max_new_tokens)
    decode = _prefill(apply, model.config, cfg, prompt_tokens_bp, prompt_mask_bp, segments_bs)
    versions_bn = jnp.full(decode.response_bn.shape, NO_VERSION, jnp.int32)
    s = RolloutState(decode, prompt_tokens_bp, prompt_mask_bp, versions_bn, rng)
    return _record(s, _choose(decode, rng, cfg), version)


def _advance(model: Transformer, cfg: GenerateConfig, num_steps: int, params, s: RolloutState,
             version) -> RolloutState:
    """Up to `num_steps` more tokens per row (generate's loop body, bounded)."""
    layer_by_layer = isinstance(model.layer_stack, LayerByLayer)
    if layer_by_layer:  # as in generate: the loop reads each layer's own weights and cache
        params = decode_layers.split_params(params)
        s = _with_cache(s, decode_layers.split_cache(s.decode.cache))
    apply = functools.partial(model.apply, {"params": params})
    batch, prompt_len = s.prompt_tokens_bp.shape
    n_new = cfg.max_new_tokens
    prompt_lengths_b = jnp.sum(s.prompt_mask_bp, axis=1, dtype=jnp.int32)
    segments_bs = _segments_bs(s.prompt_mask_bp, n_new)
    stop = s.decode.step + num_steps

    def body(r: RolloutState) -> RolloutState:
        d = r.decode
        fed = d.step - 1  # index of the response token being fed
        logits_b1v, cache = apply(
            d.last_token_b[:, None], (prompt_lengths_b + fed)[:, None],
            jnp.ones((batch, 1), jnp.int32), d.cache, prompt_len + fed, segments_bs)
        d = d._replace(logits_bv=logits_b1v[:, 0], cache=_constrain_cache(cache))
        return _record(r._replace(decode=d), _choose(d, r.rng, cfg), version)

    cond = lambda r: _unfinished(r.decode, n_new) & (r.decode.step < stop)
    s = jax.lax.while_loop(cond, body, s)
    return _with_cache(s, decode_layers.stack_cache(s.decode.cache)) if layer_by_layer else s


def _with_cache(s: RolloutState, cache) -> RolloutState:
    return s._replace(decode=s.decode._replace(cache=_constrain_cache(cache)))


def _recompute_cache(model: Transformer, cfg: GenerateConfig, params,
                     s: RolloutState) -> RolloutState:
    """The KV cache of prompt + response so far, recomputed under `params`.

    Slots of tokens not sampled yet hold padding's keys; causality hides them until the decode
    loop overwrites them. The last sampled token's slot is rewritten by the next decode step
    with the same values.
    """
    apply = functools.partial(model.apply, {"params": params})
    n_new = cfg.max_new_tokens
    batch, prompt_len = s.prompt_tokens_bp.shape
    prompt_lengths_b = jnp.sum(s.prompt_mask_bp, axis=1, dtype=jnp.int32)
    tokens_bs = jnp.concatenate([s.prompt_tokens_bp, s.decode.response_bn], axis=1)
    prompt_positions_bp = jnp.maximum(jnp.cumsum(s.prompt_mask_bp, axis=1, dtype=jnp.int32) - 1,
                                      0)
    response_positions_bn = prompt_lengths_b[:, None] + jnp.arange(n_new, dtype=jnp.int32)
    positions_bs = jnp.concatenate([prompt_positions_bp, response_positions_bn], axis=1)
    segments_bs = _segments_bs(s.prompt_mask_bp, n_new)
    cache = _constrain_cache(KVCache.zeros(model.config, batch, prompt_len + n_new))
    _, cache = apply(tokens_bs, positions_bs, segments_bs, cache, 0, segments_bs, last_only=True)
    return s._replace(decode=s.decode._replace(cache=_constrain_cache(cache)))


def _finish(cfg: GenerateConfig, s: RolloutState) -> tuple[GenerateOutput, jax.Array]:
    d = s.decode
    prompt_bp = jnp.where(s.prompt_mask_bp, s.prompt_tokens_bp, cfg.pad_token_id).astype(jnp.int32)
    out = GenerateOutput(
        sequences_bs=jnp.concatenate([prompt_bp, d.response_bn], axis=1),
        prompt_mask_bp=s.prompt_mask_bp, response_bn=d.response_bn, response_mask_bn=d.mask_bn,
        logprobs_bn=d.logprobs_bn,
        response_lengths_b=jnp.sum(d.mask_bn, axis=1, dtype=jnp.int32))
    return out, s.versions_bn


class Rollout:
    """Interruptible generation of one model on one layout, for prompts of length `prompt_len`.

    Args:
      model_config: an LM-head model.
      gen_config: sampling settings (as for `make_generate_fn`).
      layout: where generation runs.
      prompt_len: the (bucketed) prompt length P every batch is padded to.
    """

    def __init__(self, model_config: ModelConfig, gen_config: GenerateConfig, layout: Layout,
                 prompt_len: int):
        if model_config.head is not HeadKind.LM:
            raise ValueError(f"generate needs an LM head, got {model_config.head}")
        self.model = decode_model(model_config, layout)  # as Generator's
        self.cfg, self.layout = gen_config, layout
        self.prompt_len = prompt_len
        self.compile_cache = CompileCache("rollout")
        self._params = layout.param_shardings(abstract_params(model_config))
        self._scalar = layout.replicated()
        self._finish = jax.jit(functools.partial(_finish, gen_config))

    @property
    def compiles(self) -> int:
        return self.compile_cache.compiles

    def _shardings(self, batch: int) -> RolloutState:
        """Out-shardings of the state: rows over the data axes, the cache as generate's."""
        lay, n = self.layout, self.cfg.max_new_tokens
        c = self.model.config
        cache_shape = (c.num_layers, batch, self.prompt_len + n, c.num_kv_heads, c.head_dim)
        cache = lay.sharding(_CACHE_AXES, cache_shape)
        rows1, rows2 = lay.batch_sharding(1), lay.batch_sharding(2)
        decode = _DecodeState(self._scalar, rows2, rows1, rows1, KVCache(cache, cache), rows2,
                              rows2, rows2)
        return RolloutState(decode, rows2, rows2, rows2, self._scalar)

    def _run(self, name: str, fn, static: tuple, *args):
        """Compiles `fn(*static, *args)` once per (name, batch) under the layout's context."""
        batch = int(args[1].shape[0]) if name == "start" else int(args[1].prompt_tokens_bp.shape[0])
        out = (self._shardings(batch) if name != "finish" else None)
        jitted = jax.jit(functools.partial(fn, *static), out_shardings=out)

        def lower():
            with self.layout.activation_context():
                return jitted.lower(*args)

        return self.compile_cache.get((name, batch, static[-1:]), lower)(*args)

    def _version(self, version: int) -> jax.Array:
        return jax.device_put(np.int32(version), self._scalar)

    def start(self, params, version: int, prompt_tokens_bp, prompt_mask_bp, rng) -> InFlight:
        """Prefills left-padded prompts [b, P] and samples every row's first token."""
        batch, prompt_len = np.shape(prompt_tokens_bp)
        if prompt_len != self.prompt_len:
            raise ValueError(f"rollout prompts must be padded to {self.prompt_len}, got "
                             f"{prompt_len}")
        check_batch_divisible(self.layout, batch, "rollout batch")
        rows = self.layout.batch_sharding(2)
        tokens_bp, mask_bp = jax.device_put(
            (prompt_tokens_bp.astype(jnp.int32), prompt_mask_bp.astype(bool)), rows)
        rng = transfer(rng, self._scalar)
        state = self._run("start", _start, (self.model, self.cfg), params, tokens_bp, mask_bp,
                          rng, self._version(version))
        return InFlight(state, version)

    def advance(self, inflight: InFlight, params, version: int, num_steps: int) -> InFlight:
        """Up to `num_steps` more tokens under `params` (of policy `version`); weights of a new
        version first recompute the KV cache (an interruption, counted)."""
        state = inflight.state
        if version != inflight.version:
            state = self._run("reload", _recompute_cache, (self.model, self.cfg), params, state)
            inflight = dataclasses.replace(inflight, version=version,
                                           interruptions=inflight.interruptions + 1)
        state = self._run("advance", _advance, (self.model, self.cfg, num_steps), params, state,
                          self._version(version))
        return dataclasses.replace(inflight, state=state)

    def poll(self, inflight: InFlight) -> bool:
        """Whether every row has stopped (a sync point on two scalars)."""
        d = inflight.state.decode
        step, done = fetch((d.step, jnp.all(d.done_b)))
        inflight.finished = bool(done) or int(step) >= self.cfg.max_new_tokens
        return inflight.finished

    def finish(self, inflight: InFlight) -> tuple[GenerateOutput, jax.Array]:
        """(GenerateOutput, versions_bn int32 [b, N]) of a finished batch."""
        return self._finish(inflight.state)
