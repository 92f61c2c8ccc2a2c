"""The `generate` call kind: batched autoregressive sampling with a KV cache, one jit per layout.

Prompts arrive LEFT-padded to a bucketed length P (so every row's last prompt token sits in the
same slot and one prefill yields every row's first next-token logits). The KV cache has
P + max_new_tokens slots (layer by layer on XLA:CPU it grows to that in a few segments, so a
step attends over fewer unwritten slots); response token i of every row goes to slot P + i.
A `lax.while_loop` (one per segment) decodes one token per iteration and stops as soon as every
row has emitted EOS (or after max_new_tokens). Each row's RoPE positions count only its real
tokens, so a left-padded row is computed exactly like the same prompt without padding.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from jaxrlhf.engine import buckets, decode_layers, pipelined_decode
from jaxrlhf.engine.call import BucketedCall
from jaxrlhf.engine.decode_layers import LayerByLayer
from jaxrlhf.engine.sampling import SamplingParams, sample, token_logprobs
from jaxrlhf.models.config import HeadKind, ModelConfig
from jaxrlhf.models.sizes import abstract_params
from jaxrlhf.models.transformer import KVCache, Transformer
from jaxrlhf.parallel.layout import Layout, check_batch_divisible
from jaxrlhf.parallel.pipeline import layer_stack
from jaxrlhf.parallel.reshard import transfer

# KVCache [l, b, s, k, d]; a pipeline keeps each stage's layers on its own devices.
_CACHE_AXES = ("layers", "batch", None, "act_kv_heads", "head_dim")


@dataclasses.dataclass(frozen=True)
class GenerateConfig:
    """Static generation settings (hashable; closed over by the jitted function).

    Attributes:
      max_new_tokens: response slots N per row.
      eos_token_id: a row is finished after emitting it, or any of them when a tuple (Llama-3
        instruct has several stop ids); the EOS itself is part of the response.
      pad_token_id: fills prompt padding and response slots after a row finished.
      temperature: 0 = greedy; log-probs are then reported at temperature 1.
      top_k: 0 = off.
      top_p: 1.0 = off.
      force_max_length: ignore EOS and always emit N tokens (benchmarks measure this way).
    """

    max_new_tokens: int
    eos_token_id: int | tuple[int, ...]
    pad_token_id: int
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    force_max_length: bool = False

    def __post_init__(self):
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        _ = self.sampling  # validates temperature / top_k / top_p
        # Normalise lists (JSON configs) and numpy ints so the config stays hashable.
        eos = self.eos_token_id
        eos = tuple(int(t) for t in eos) if isinstance(eos, (list, tuple)) else int(eos)
        object.__setattr__(self, "eos_token_id", eos)

    @property
    def sampling(self) -> SamplingParams:
        return SamplingParams(self.temperature, self.top_k, self.top_p)

    @property
    def stop_ids(self) -> tuple[int, ...]:
        eos = self.eos_token_id
        return eos if isinstance(eos, tuple) else (eos,)


class GenerateOutput(NamedTuple):
    """What one generate call returns (a pytree; every array's dim 0 is the batch).

    Attributes:
      sequences_bs: int32 [b, P + N]: left-padded prompt, then the response right-padded with
        pad_token_id.
      prompt_mask_bp: bool [b, P], True on real prompt tokens.
      response_bn: int32 [b, N] sampled tokens (pad_token_id after EOS).
      response_mask_bn: bool [b, N], True up to and including EOS.
      logprobs_bn: float32 [b, N], log-prob of each sampled token under softmax(logits / T)
        (T = 1 for greedy), untruncated; 0 where the mask is False.
      response_lengths_b: int32 [b], number of True entries of response_mask_bn.
    """

    sequences_bs: jax.Array
    prompt_mask_bp: jax.Array
    response_bn: jax.Array
    response_mask_bn: jax.Array
    logprobs_bn: jax.Array
    response_lengths_b: jax.Array

    @property
    def sequence_mask_bs(self) -> jax.Array:
        """bool [b, P + N]: real tokens of prompt + response (segment ids for inference)."""
        return jnp.concatenate([self.prompt_mask_bp, self.response_mask_bn], axis=1)


class _DecodeState(NamedTuple):
    step: jax.Array  # scalar int32: index of the next response token to choose
    logits_bv: jax.Array  # float32 [b, vocab]: the model's prediction of token `step`
    last_token_b: jax.Array  # int32 [b]: response token step-1
    done_b: jax.Array  # bool [b]
    cache: KVCache
    response_bn: jax.Array
    logprobs_bn: jax.Array
    mask_bn: jax.Array


def _unfinished(state: _DecodeState, n_new: int) -> jax.Array:
    return (state.step < n_new) & ~jnp.all(state.done_b)


def draw(logits_bv, keys_b, active_b, cfg: GenerateConfig):
    """One token per row: (token_b (pad_token_id where not active), its log-prob logp_b,
    stopped_b: an active row emitted a stop id (never with force_max_length))."""
    token_b = sample(logits_bv, keys_b, cfg.sampling)
    logp_b = token_logprobs(logits_bv, token_b, cfg.sampling.logprob_temperature)
    token_b = jnp.where(active_b, token_b, cfg.pad_token_id)
    stopped_b = active_b & jnp.isin(token_b, jnp.asarray(cfg.stop_ids))
    return token_b, logp_b, stopped_b & (not cfg.force_max_length)


def _choose(state: _DecodeState, rng, cfg: GenerateConfig) -> _DecodeState:
    """Samples response token `state.step` for every unfinished row and records it."""
    batch = state.logits_bv.shape[0]
    step_key = jax.random.fold_in(rng, state.step)
    keys_b = jax.vmap(functools.partial(jax.random.fold_in, step_key))(jnp.arange(batch))
    active_b = ~state.done_b
    token_b, logp_b, stopped_b = draw(state.logits_bv, keys_b, active_b, cfg)
    done_b = state.done_b | stopped_b
    write = functools.partial(jax.lax.dynamic_update_index_in_dim, index=state.step, axis=1)
    return state._replace(
        step=state.step + 1,
        last_token_b=token_b,
        done_b=done_b,
        response_bn=write(state.response_bn, token_b),
        logprobs_bn=write(state.logprobs_bn, jnp.where(active_b, logp_b, 0.0)),
        mask_bn=write(state.mask_bn, active_b),
    )


def _constrain_cache(cache: KVCache | tuple[KVCache, ...]):
    """The stacked cache, or each layer's own (`decode_layers.split_cache`), sharded alike."""
    if isinstance(cache, KVCache):
        return KVCache(*(nn.with_logical_constraint(x, _CACHE_AXES) for x in cache))
    return tuple(KVCache(*(nn.with_logical_constraint(x, _CACHE_AXES[1:]) for x in c))
                 for c in cache)


def _prefill(apply, config: ModelConfig, cfg: GenerateConfig, prompt_tokens_bp, prompt_mask_bp,
             kv_segment_ids_bs) -> _DecodeState:
    """Runs the prompts through the model, filling a cache as long as `kv_segment_ids_bs`;
    returns the initial state."""
    batch, _ = prompt_tokens_bp.shape
    n_new = cfg.max_new_tokens
    positions_bp = jnp.maximum(jnp.cumsum(prompt_mask_bp, axis=1, dtype=jnp.int32) - 1, 0)
    cache = _constrain_cache(KVCache.zeros(config, batch, kv_segment_ids_bs.shape[1]))
    logits_b1v, cache = apply(
        prompt_tokens_bp, positions_bp, prompt_mask_bp.astype(jnp.int32), cache, 0,
        kv_segment_ids_bs, last_only=True,
    )
    return _DecodeState(
        step=jnp.zeros((), jnp.int32),
        logits_bv=logits_b1v[:, 0],  # left padding: every row's last prompt token is here
        last_token_b=jnp.zeros((batch,), jnp.int32),
        done_b=jnp.zeros((batch,), bool),
        cache=_constrain_cache(cache),
        response_bn=jnp.full((batch, n_new), cfg.pad_token_id, jnp.int32),
        logprobs_bn=jnp.zeros((batch, n_new), jnp.float32),
        mask_bn=jnp.zeros((batch, n_new), bool),
    )


def generate(
    model: Transformer,
    cfg: GenerateConfig,
    params,
    prompt_tokens_bp: jax.Array,
    prompt_mask_bp: jax.Array,
    rng: jax.Array,
) -> GenerateOutput:
    """Samples up to `cfg.max_new_tokens` tokens after each left-padded prompt (traceable).

    Args:
      model: the LM-head decoder.
      cfg: generation settings.
      params: the model's (unboxed) parameters.
      prompt_tokens_bp: int [b, P] left-padded prompts; each row needs >= 1 real token.
      prompt_mask_bp: bool [b, P], True on real tokens (a suffix of each row).
      rng: PRNG key; row r's token i uses fold_in(fold_in(rng, i), r).

    Returns:
      A GenerateOutput.
    """
    batch, prompt_len = prompt_tokens_bp.shape
    n_new = cfg.max_new_tokens
    layer_by_layer = isinstance(model.layer_stack, LayerByLayer)
    if layer_by_layer:  # each layer's weights sliced out once, not once per token
        params = decode_layers.split_params(params)
    apply = functools.partial(model.apply, {"params": params})
    prompt_mask_bp = prompt_mask_bp.astype(bool)
    prompt_lengths_b = jnp.sum(prompt_mask_bp, axis=1, dtype=jnp.int32)
    # Response slots are marked real up front; causality hides the not-yet-written ones.
    kv_segment_ids_bs = jnp.concatenate(
        [prompt_mask_bp.astype(jnp.int32), jnp.ones((batch, n_new), jnp.int32)], axis=1
    )
    # Layer by layer, the caches grow segment by segment (`decode_layers.segment_ends`).
    ends = decode_layers.segment_ends(n_new) if layer_by_layer else (n_new,)
    state = _prefill(apply, model.config, cfg, prompt_tokens_bp, prompt_mask_bp,
                     kv_segment_ids_bs[:, :prompt_len + ends[0]])

    def decode_one(s: _DecodeState, kv_segment_ids_bs) -> _DecodeState:
        fed = s.step - 1  # index of the response token being fed
        logits_b1v, cache = apply(
            s.last_token_b[:, None], (prompt_lengths_b + fed)[:, None],
            jnp.ones((batch, 1), jnp.int32), s.cache, prompt_len + fed, kv_segment_ids_bs,
        )
        s = s._replace(logits_bv=logits_b1v[:, 0], cache=_constrain_cache(cache))
        return _choose(s, rng, cfg)

    # Token 0 comes from the prefill's logits; each iteration feeds the last token and samples
    # the next, so the loop body has no `lax.cond` (whose branches would copy the KV cache).
    state = _choose(state, rng, cfg)
    if layer_by_layer:
        state = state._replace(cache=_constrain_cache(decode_layers.split_cache(state.cache)))
    if pipelined_decode.runs_across_tokens(model):  # ReaL's schedule on a pipelined layout
        state = pipelined_decode.decode_across_tokens(
            model, cfg, params, state, rng, prompt_lengths_b, prompt_len, kv_segment_ids_bs)
    else:
        for end in ends:
            length = prompt_len + end
            cache = decode_layers.grow_cache(state.cache, length) if layer_by_layer else state.cache
            state = jax.lax.while_loop(
                functools.partial(_unfinished, n_new=end),
                functools.partial(decode_one, kv_segment_ids_bs=kv_segment_ids_bs[:, :length]),
                state._replace(cache=_constrain_cache(cache)))
    prompt_bp = jnp.where(prompt_mask_bp, prompt_tokens_bp, cfg.pad_token_id).astype(jnp.int32)
    return GenerateOutput(
        sequences_bs=jnp.concatenate([prompt_bp, state.response_bn], axis=1),
        prompt_mask_bp=prompt_mask_bp,
        response_bn=state.response_bn,
        response_mask_bn=state.mask_bn,
        logprobs_bn=state.logprobs_bn,
        response_lengths_b=jnp.sum(state.mask_bn, axis=1, dtype=jnp.int32),
    )


def decode_model(model_config: ModelConfig, layout: Layout) -> Transformer:
    """The model a generate call runs on `layout`: its layout's layer stack (a pipeline keeps
    stages apart); on XLA:CPU `decode_layers.LayerByLayer`, or with fsdp the scanned stack,
    whatever `scan_layers` says (the parameter tree is the same).

    Why: inside the token loop both the scanned and the unrolled scan copy every layer's
    weights and cache once per token on XLA:CPU; layer by layer on weights sliced out once,
    each layer's cache is read where it lies (`engine.decode_layers`). With fsdp every token
    all-gathers each layer's weights anyway, and unrolled the gathered layers would all be
    live at once: that stays scanned.
    """
    stack = layer_stack(layout)
    if stack is None and layout.mesh.devices.flat[0].platform == "cpu":
        if layout.strategy.fsdp == 1:
            return Transformer(model_config, LayerByLayer())
        model_config = model_config.replace(scan_layers=True)
    return Transformer(model_config, stack)


class Generator(BucketedCall):
    """The generate call kind of one model on one layout (use `make_generate_fn`).

    Calling it left-pads the prompts to the next prompt bucket, then runs the executable
    compiled for (bucket, batch) on this layout, compiling it on first use.
    """

    def __init__(self, model_config: ModelConfig, gen_config: GenerateConfig, layout: Layout,
                 prompt_buckets: Sequence[int]):
        if model_config.head is not HeadKind.LM:
            raise ValueError(f"generate needs an LM head, got {model_config.head}")
        super().__init__("generate", layout)
        self.gen_config = gen_config
        self.prompt_buckets = tuple(sorted(prompt_buckets))
        row, rows = layout.batch_sharding(1), layout.batch_sharding(2)
        self._rows, self._rng_sharding = rows, layout.replicated()
        self._jitted = jax.jit(
            functools.partial(generate, decode_model(model_config, layout),
                              gen_config),
            in_shardings=(
                layout.param_shardings(abstract_params(model_config)), rows, rows,
                self._rng_sharding,
            ),
            out_shardings=GenerateOutput(rows, rows, rows, rows, rows, row),
        )

    def _jit_for(self, *args) -> jax.stages.Wrapped:
        return self._jitted

    def __call__(self, params, prompt_tokens_bp, prompt_mask_bp, rng) -> GenerateOutput:
        """Generates for a batch of left-padded prompts.

        Args:
          params: unboxed parameters, sharded as `layout.param_shardings` says.
          prompt_tokens_bp: int [b, P] left-padded prompts (numpy or jax); b must divide evenly
            over the layout's data-parallel size.
          prompt_mask_bp: bool [b, P], True on real tokens.
          rng: PRNG key.

        Returns:
          GenerateOutput whose prompt part has the bucketed length (>= P).
        """
        batch, prompt_len = np.shape(prompt_tokens_bp)
        check_batch_divisible(self.layout, batch, "generate batch")
        bucket = buckets.bucket_length(prompt_len, self.prompt_buckets)
        pad = functools.partial(buckets.pad_axis, length=bucket, axis=1, left=True)
        tokens_bp = pad(prompt_tokens_bp, value=self.gen_config.pad_token_id)
        mask_bp = pad(prompt_mask_bp, value=False)
        tokens_bp, mask_bp = jax.device_put(
            (tokens_bp.astype(jnp.int32), mask_bp.astype(bool)), self._rows
        )
        rng = transfer(rng, self._rng_sharding)  # device_put refuses keys multi-process
        # Raw uint32 and typed keys need different executables.
        key = (bucket, batch, rng.shape, str(rng.dtype))
        compiled = self._executable(key, params, tokens_bp, mask_bp, rng)
        return compiled(params, tokens_bp, mask_bp, rng)


def make_generate_fn(
    model_config: ModelConfig,
    gen_config: GenerateConfig,
    layout: Layout,
    *,
    prompt_buckets: Sequence[int] | None = None,
) -> Generator:
    """The generate call kind: `(params, prompt_tokens_bp, prompt_mask_bp, rng) -> GenerateOutput`.

    Args:
      model_config: an LM-head model.
      gen_config: static sampling settings.
      layout: devices, mesh and sharding rules to compile for.
      prompt_buckets: allowed prompt lengths; default powers of two from 16, capped at
        `model_config.max_position_embeddings`.
    """
    if prompt_buckets is None:
        prompt_buckets = buckets.power_of_two_buckets(model_config.max_position_embeddings)
    return Generator(model_config, gen_config, layout, prompt_buckets)
