"""Pipelined decoding that keeps the pipeline full across tokens, as ReaL does.

`generate` on a pipelined layout prefills through the model's GPipe `Pipeline` (every
micro-batch's cache filled, every row's first token sampled) and then hands its decode loop to
`decode_across_tokens` when the pipeline's schedule is `DecodeSchedule.ACROSS_TOKENS`.

Schedule. The batch is cut into M micro-batches (strided rows m, m+M, ..., as the prefill cut
them, so the cache is viewed per micro-batch without moving it). A job is "feed response token
k of micro-batch m" (k = 0 .. N-2; its output samples token k+1). Job (k, m) enters stage 0 at
slot k·R + m with R = max(M, S) and reaches stage s at slot k·R + m + s. Token k+1 of
micro-batch m leaves stage S-1 at slot k·R + m + S - 1 < (k+1)·R + m, so it is sampled before
the slot that feeds it: with M >= S every stage is busy in every slot after the first S - 1
(R = M slots per token, against M + S - 1 when each token is a pipeline pass of its own); with
M < S a micro-batch waits for its token and S - M stages idle each slot.

Each slot is one `Pipeline.iteration`: stage 0 takes the embedding of its job's token, stage s
the output stage s-1 produced last slot, each stage runs its layers against its own micro-batch's
cache (written at slot P + k of its own job), and the model's final norm and head turn stage
S-1's output into the logits of the micro-batch it finished, whose rows then sample their next
token exactly as `generate` does (same per-row keys fold_in(fold_in(rng, token), row), the same
stop handling). The loop ends after the last job or as soon as every row has stopped.
"""

from __future__ import annotations

import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxrlhf.engine.sampling import sample, token_logprobs
from jaxrlhf.models.transformer import KVCache, LayerInputs, Transformer, apply_layer
from jaxrlhf.parallel.pipeline import DecodeSchedule, Pipeline, merge_rows, split_rows


def runs_across_tokens(model: Transformer) -> bool:
    """Whether `generate` with `model` decodes with `decode_across_tokens`."""
    stack = model.layer_stack
    return isinstance(stack, Pipeline) and stack.decode is DecodeSchedule.ACROSS_TOKENS


class _Given:
    """A LayerStack whose output is already known: `Transformer.apply` with it runs only the
    model's own final norm and head on that output (the embedding it also computes is unused,
    so XLA drops it)."""

    def __init__(self, x_btd: jax.Array):
        self.x_btd = x_btd

    def __call__(self, layer_fn, params_l, x_btd, cache, inputs, cache_index, unroll):
        return self.x_btd, cache


def _embed(model: Transformer, params, tokens_bt: jax.Array) -> jax.Array:
    """The model's token embedding [b, t, d] (its own `embed_tokens` module)."""
    cfg = model.config
    embed = nn.Embed(cfg.vocab_size, cfg.hidden_size, dtype=cfg.dtype,
                     param_dtype=cfg.param_dtype)
    x_btd = embed.apply({"params": params["embed_tokens"]}, tokens_bt)
    return nn.with_logical_constraint(x_btd, ("batch", "length", "act_embed"))


def _logits(model: Transformer, params, x_btd: jax.Array) -> jax.Array:
    """float32 [b, vocab] logits of the last layer's output x_btd [b, 1, d]."""
    batch = x_btd.shape[0]
    ones_b1 = jnp.ones((batch, 1), jnp.int32)
    logits_b1v, _ = Transformer(model.config, _Given(x_btd)).apply(
        {"params": params}, ones_b1, ones_b1, ones_b1)
    return logits_b1v[:, 0]


def _choose_rows(cfg, rng, logits_bv, rows_b, token, real, response_bn, logprobs_bn, mask_bn,
                 done_b):
    """Samples response token `token` of rows `rows_b` as `generate._choose` does for a whole
    batch (row r's key is fold_in(fold_in(rng, token), r)); nothing changes unless `real`.

    Returns (response_bn, logprobs_bn, mask_bn, done_b) of those rows.
    """
    keys_b = jax.vmap(functools.partial(jax.random.fold_in, jax.random.fold_in(rng, token)))(
        rows_b)
    token_b = sample(logits_bv, keys_b, cfg.sampling)
    logp_b = token_logprobs(logits_bv, token_b, cfg.sampling.logprob_temperature)
    active_b = ~done_b
    token_b = jnp.where(active_b, token_b, cfg.pad_token_id)
    new_done_b = done_b
    if not cfg.force_max_length:
        new_done_b = done_b | (active_b & jnp.isin(token_b, jnp.asarray(cfg.stop_ids)))

    def write(x_bn, value_b):
        # A bubble slot's (clipped) token index may be a real one: write the old value back.
        old_b = jax.lax.dynamic_index_in_dim(x_bn, token, 1, keepdims=False)
        return jax.lax.dynamic_update_index_in_dim(x_bn, jnp.where(real, value_b, old_b),
                                                   token, 1)

    return (write(response_bn, token_b), write(logprobs_bn, jnp.where(active_b, logp_b, 0.0)),
            write(mask_bn, active_b), jnp.where(real, new_done_b, done_b))


def decode_across_tokens(model: Transformer, cfg, params, state: Any, rng: jax.Array,
                         prompt_lengths_b: jax.Array, prompt_len: int,
                         kv_segment_ids_bs: jax.Array) -> Any:
    """Samples response tokens 1 .. N-1 of every row with the pipeline full across tokens.

    Args:
      model: the LM decoder whose `layer_stack` is a `Pipeline`.
      cfg: the `GenerateConfig`.
      params: the model's (unboxed) parameters.
      state: `generate`'s decode state after the prefill and token 0 (its step is 1).
      rng: the generation's PRNG key.
      prompt_lengths_b: int [B] real prompt tokens per row.
      prompt_len: P, the (bucketed) prompt length: response token k sits in cache slot P + k.
      kv_segment_ids_bs: int [B, P + N] segment ids of every cache slot (as `generate` sets).

    Returns:
      `state` with the response, its log-probs, mask, stop flags and cache filled in.
    """
    pipe: Pipeline = model.layer_stack
    n_new = cfg.max_new_tokens
    if n_new == 1:  # token 0 came from the prefill
        return state
    batch = prompt_lengths_b.shape[0]
    num_micro, num_stages = pipe.num_micro(batch), pipe.stages
    period = max(num_micro, num_stages)  # slots between a micro-batch's tokens
    feeds = n_new - 1  # tokens fed: 0 .. N-2
    slots = (feeds - 1) * period + num_micro + num_stages - 1
    layer_fn = functools.partial(apply_layer, model.config)
    params_s = pipe.stage_params(params["layers"])
    split = functools.partial(split_rows, num_micro=num_micro)
    rows_mb = split(jnp.arange(batch, dtype=jnp.int32))
    plen_mb, kvseg_mbs = split(prompt_lengths_b), split(kv_segment_ids_bs)
    stage_ids = jnp.arange(num_stages, dtype=jnp.int32)
    rows = batch // num_micro

    def jobs(slot):
        """Per stage: (micro-batch, fed token, real) of the job it runs in `slot`."""
        job_s = slot - stage_ids
        token_s, micro_s = job_s // period, job_s % period
        real_s = (job_s >= 0) & (micro_s < num_micro) & (token_s < feeds)
        return (jnp.clip(micro_s, 0, num_micro - 1), jnp.clip(token_s, 0, feeds - 1), real_s)

    def unfinished(carry):
        slot, *_, done_mb = carry
        return (slot < slots) & ~jnp.all(done_mb)

    def one_slot(carry):
        slot, state_sbtd, cache_s, response_mbn, logprobs_mbn, mask_mbn, done_mb = carry
        micro_s, token_s, real_s = jobs(slot)
        fed_b = response_mbn[micro_s[0], :, token_s[0]]
        inputs_s = LayerInputs(
            positions_bt=(plen_mb[micro_s] + token_s[:, None])[..., None],
            segment_ids_bt=jnp.ones((num_stages, rows, 1), jnp.int32),
            kv_segment_ids_bs=kvseg_mbs[micro_s])
        state_sbtd, cache_s = pipe.iteration(
            layer_fn, params_s, _embed(model, params, fed_b[:, None]), state_sbtd, cache_s,
            inputs_s, micro_s, real_s, prompt_len + token_s, not model.config.scan_layers)
        # Stage S-1 finished feeding token k of micro-batch m: sample token k + 1 of its rows.
        m, real = micro_s[-1], real_s[-1]
        chosen = _choose_rows(cfg, rng, _logits(model, params, state_sbtd[-1]), rows_mb[m],
                              token_s[-1] + 1, real, response_mbn[m], logprobs_mbn[m],
                              mask_mbn[m], done_mb[m])
        response_mbn, logprobs_mbn, mask_mbn, done_mb = (
            jax.lax.dynamic_update_index_in_dim(x, new, m, 0)
            for x, new in zip((response_mbn, logprobs_mbn, mask_mbn, done_mb), chosen))
        return (slot + 1, state_sbtd, cache_s, response_mbn, logprobs_mbn, mask_mbn, done_mb)

    init = (jnp.zeros((), jnp.int32),
            pipe.empty_state((rows, 1, model.config.hidden_size), model.config.dtype),
            pipe.stage_cache(state.cache, num_micro), split(state.response_bn),
            split(state.logprobs_bn), split(state.mask_bn), split(state.done_b))
    _, _, cache_s, response_mbn, logprobs_mbn, mask_mbn, done_mb = jax.lax.while_loop(
        unfinished, one_slot, init)
    return state._replace(
        step=jnp.asarray(n_new, jnp.int32), cache=KVCache(*pipe.unstage_cache(cache_s)),
        response_bn=merge_rows(response_mbn), logprobs_bn=merge_rows(logprobs_mbn),
        mask_bn=merge_rows(mask_mbn), done_b=merge_rows(done_mb))
