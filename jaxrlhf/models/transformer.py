"""Decoder-only transformer of the Llama-2/Llama-3/Qwen2/Qwen3(-MoE)/Mixtral/Mistral/Gemma-3
family, in Flax linen.

Every parameter carries logical axis names (see `LOGICAL_AXES` below) and the main activations
carry logical sharding constraints; the model never sees a mesh. Layer parameters are stacked on
a leading "layers" axis (one `nn.scan`), whether or not the loop is unrolled.

The same `__call__` serves three uses:
  * full forward on a padded or packed batch (`cache=None`);
  * prefill of a KV cache (`cache` given, `cache_index=0`);
  * one-or-more-token decode against the cache (`cache_index>0`).
Attention is causal over *slots* (token index within the row, or cache slot) and restricted to
equal non-zero segment ids, so padding (segment 0) and packed neighbours never see each other.
A sliding layer (Mistral, Gemma 3's local layers) sees only its window's latest slots; a layer
knows whether it is one from its index in the model (`ModelConfig.sliding_layers`).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any, NamedTuple, Protocol

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxrlhf.models import attention, lora, moe
from jaxrlhf.models.config import (
    Activation, HeadKind, ModelConfig, RematPolicy, RopeKind, RopeScaling,
)
from jaxrlhf.models.decode_kv import DecodeKV

# Logical axis names used by parameters and activations. Rules in meshes/ map them to mesh axes.
LOGICAL_AXES = (
    "vocab", "embed", "heads", "kv_heads", "head_dim", "mlp", "layers",  # parameters
    "batch", "length", "act_embed", "act_heads", "act_kv_heads", "act_mlp", "act_vocab",
    "stages",  # a pipelined LayerStack's per-stage activations (parallel/pipeline.py)
    "experts", "experts_router", "expert_mlp",  # mixture-of-experts blocks (models/moe.py)
)

class KVCache(NamedTuple):
    """Per-layer keys and values, stacked over layers.

    k_lbskd, v_lbskd: [layers, batch, cache_len, kv_heads, head_dim].
    """

    k_lbskd: jax.Array
    v_lbskd: jax.Array

    @staticmethod
    def zeros(config: ModelConfig, batch: int, cache_len: int) -> "KVCache":
        shape = (config.num_layers, batch, cache_len, config.num_kv_heads, config.head_dim)
        return KVCache(jnp.zeros(shape, config.dtype), jnp.zeros(shape, config.dtype))


def _init(stddev: float = 0.02):
    return nn.initializers.normal(stddev)


def flat_matmul(x: jax.Array, kernel: jax.Array, contract: int, **dot_kwargs) -> jax.Array:
    """x [..., *kernel.shape[:contract]] times kernel [*in, *out] -> [..., *out], as ONE 2-D dot.

    The leading dims of `x` (batch, length) are merged into one row dim and the kernel into
    [in, out] (both bitcasts), so the dot and its gradients are plain matrix products. Why: for
    a dot whose rows span two dims, XLA:CPU computes the weight gradient (a contraction over
    batch *and* length) by first transposing the incoming gradient in an elementwise loop
    fusion with strided reads; on W-cpu those transposes took about a quarter of the train
    step. With the rows merged, the backward dots read their operands as they are.
    """
    lead = x.shape[:x.ndim - contract]
    in_size = math.prod(kernel.shape[:contract])
    out_shape = kernel.shape[contract:]
    y = jnp.dot(x.reshape(-1, in_size), kernel.reshape(in_size, -1), **dot_kwargs)
    return y.reshape(*lead, *out_shape)


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None) -> jax.Array:
    """Inverse frequencies [head_dim/2], with Llama-3 or linear scaling when given (as in HF)."""
    inv_freq = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
    if scaling is None:
        return inv_freq
    if scaling.kind is RopeKind.LINEAR:
        return inv_freq / scaling.factor
    old_ctx = scaling.original_max_position_embeddings
    low_wavelen = old_ctx / scaling.low_freq_factor
    high_wavelen = old_ctx / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = jnp.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (old_ctx / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return jnp.where(is_medium, smoothed, scaled)


def rope_tables(positions_bt: jax.Array, inv_freq: jax.Array, dtype,
                positions_below: int | None = None) -> tuple[jax.Array, jax.Array]:
    """(cos, sin) [b, t, 1, head_dim] in `dtype` of the RoPE angles (computed in fp32), HF's
    "rotate half" layout.

    `positions_below`: every position is known to be below it (a forward without a cache: a
    row's positions restart with each of its sequences); the tables are then computed for
    positions 0 .. positions_below - 1 and gathered. Why: XLA fuses an elementwise producer into
    each of its consumers, so the [b, t, head_dim] sines and cosines were evaluated in every
    rotation of the queries and keys, forward and backward, of every layer (20 times each in
    W-cpu's unrolled train step); a gather reads each table entry many times, so XLA keeps the
    small table whole and fuses only the gather.
    """
    if positions_below is None:
        angles_btf = positions_bt[..., None].astype(jnp.float32) * inv_freq
        angles_btd = jnp.concatenate([angles_btf, angles_btf], axis=-1)[:, :, None, :]
        return jnp.cos(angles_btd).astype(dtype), jnp.sin(angles_btd).astype(dtype)
    angles_pf = jnp.arange(positions_below, dtype=jnp.float32)[:, None] * inv_freq
    angles_pd = jnp.concatenate([angles_pf, angles_pf], axis=-1)
    pick = lambda table_pd: jnp.take(table_pd.astype(dtype), positions_bt, axis=0,
                                     mode="clip")[:, :, None, :]
    return pick(jnp.cos(angles_pd)), pick(jnp.sin(angles_pd))


def rotate(x_bthd: jax.Array, cos_bt1d: jax.Array, sin_bt1d: jax.Array) -> jax.Array:
    """Rotary embedding of x [b, t, heads, head_dim] by `rope_tables`' (cos, sin)."""
    x1, x2 = jnp.split(x_bthd, 2, axis=-1)
    rotated = jnp.concatenate([-x2, x1], axis=-1)
    return x_bthd * cos_bt1d + rotated * sin_bt1d


def apply_rope(x_bthd: jax.Array, positions_bt: jax.Array, inv_freq: jax.Array) -> jax.Array:
    """Rotary embedding, HF "rotate half" convention; angles computed in fp32."""
    return rotate(x_bthd, *rope_tables(positions_bt, inv_freq, x_bthd.dtype))


class RMSNorm(nn.Module):
    """x [..., n] -> x / rms(x) * w, the mean over the last axis in fp32; `offset` (Gemma):
    times (1 + w) instead, the product in fp32 before the cast (w then starts at zero)."""

    eps: float
    dtype: type
    param_dtype: type
    axis: str = "embed"  # logical name of the normalised axis (q/k norms: "head_dim")
    offset: bool = False

    @nn.compact
    def __call__(self, x):
        init = nn.initializers.zeros if self.offset else nn.initializers.ones
        scale = self.param(
            "scale", nn.with_logical_partitioning(init, (self.axis,)),
            (x.shape[-1],), self.param_dtype,
        )
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        if self.offset:
            return (normed * (1.0 + scale.astype(jnp.float32))).astype(self.dtype)
        return normed.astype(self.dtype) * scale.astype(self.dtype)


def _norm(cfg: ModelConfig, name: str | None = None, axis: str = "embed") -> RMSNorm:
    """The model's RMSNorm over logical axis `axis` (Gemma's (1 + w) one for `gemma_block`)."""
    return RMSNorm(cfg.rms_norm_eps, cfg.dtype, cfg.param_dtype, axis=axis,
                   offset=cfg.gemma_block, name=name)


_NO_WINDOW = 2**30  # a global layer's window in a model whose layers differ: past every slot


def layer_window(cfg: ModelConfig, layer_id) -> jax.Array | int | None:
    """The sliding window of model layer `layer_id` (an int, or traced in a layer scan): None
    where no layer has one; a static int where every layer has the same; else an int32
    scalar, `_NO_WINDOW` for a global layer."""
    if cfg.sliding_window is None:
        return None
    if not cfg.layers_differ:
        return cfg.sliding_window
    if isinstance(layer_id, int):
        return cfg.sliding_window if layer_id in cfg.sliding_layers else None
    sliding = jnp.any(jnp.asarray(cfg.sliding_layers, jnp.int32) == layer_id)
    return jnp.where(sliding, jnp.int32(cfg.sliding_window), jnp.int32(_NO_WINDOW))


def decode_lengths(cfg: ModelConfig, length: int) -> tuple[int, ...]:
    """Each layer's slots in a token loop's caches of `length` slots (one `DecodeKV` per
    layer, or one stacked `KVCache` where every layer's is the same): a sliding layer keeps
    only its window (a ring, `models.decode_kv`), a global layer every slot. Where every layer
    slides (Mistral) the whole cache is the ring (`engine.rollout.state.ring_holds_all`)."""
    window = cfg.sliding_window
    return tuple(min(length, window) if i in cfg.sliding_layers else length
                 for i in range(cfg.num_layers))


def layer_inv_freq(cfg: ModelConfig, layer_id) -> jax.Array:
    """RoPE inverse frequencies [head_dim/2] of model layer `layer_id` (int or traced): a
    sliding layer's from `rope_local_theta` unscaled where the config sets one (Gemma 3)."""
    global_f = rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
    if cfg.rope_local_theta is None or not cfg.sliding_layers:
        return global_f
    local_f = rope_inv_freq(cfg.head_dim, cfg.rope_local_theta, None)
    if isinstance(layer_id, int) or not cfg.layers_differ:
        sliding = not cfg.layers_differ or layer_id in cfg.sliding_layers
        return local_f if sliding else global_f
    sliding = jnp.any(jnp.asarray(cfg.sliding_layers, jnp.int32) == layer_id)
    return jnp.where(sliding, local_f, global_f)


def _adapted(module: nn.Module, kernel: jax.Array, axes: tuple[str, ...], x: jax.Array,
             contract: int) -> jax.Array | float:
    """The LoRA term of projection `module` (kernel [*in, *out], `contract` in axes) when the
    config adapts it (models/lora.py), else 0."""
    cfg = module.config
    if cfg.lora is None or not cfg.lora.adapts(module.name):
        return 0.0
    return lora.adapter_delta(module, cfg.lora, x, kernel.shape, axes, contract, cfg.dtype,
                              cfg.param_dtype)


class HeadProjection(nn.Module):
    """x [b, t, embed] -> [b, t, heads, head_dim], kernel [embed, heads, head_dim] (+ bias).

    A plain param + einsum rather than nn.DenseGeneral: DenseGeneral initialises a 2-D kernel
    and reshapes it, which trips the 3-axis logical sharding constraint under a mesh.
    """

    config: ModelConfig
    heads: int
    head_axis: str

    @nn.compact
    def __call__(self, x_btd):
        cfg = self.config
        kernel = self.param(
            "kernel", nn.with_logical_partitioning(_init(), ("embed", self.head_axis, "head_dim")),
            (cfg.hidden_size, self.heads, cfg.head_dim), cfg.param_dtype,
        )
        out = flat_matmul(x_btd, kernel.astype(cfg.dtype), 1)
        out = out + _adapted(self, kernel, ("embed", self.head_axis, "head_dim"), x_btd, 1)
        if cfg.qkv_bias:
            bias = self.param(
                "bias", nn.with_logical_partitioning(nn.initializers.zeros, (self.head_axis, "head_dim")),
                (self.heads, cfg.head_dim), cfg.param_dtype,
            )
            out = out + bias.astype(cfg.dtype)
        return out


class OutProjection(nn.Module):
    """[b, t, heads, head_dim] -> [b, t, embed], kernel [heads, head_dim, embed]."""

    config: ModelConfig

    @nn.compact
    def __call__(self, x_bthk):
        cfg = self.config
        kernel = self.param(
            "kernel", nn.with_logical_partitioning(_init(), ("heads", "head_dim", "embed")),
            (cfg.num_heads, cfg.head_dim, cfg.hidden_size), cfg.param_dtype,
        )
        return (flat_matmul(x_bthk, kernel.astype(cfg.dtype), 2)
                + _adapted(self, kernel, ("heads", "head_dim", "embed"), x_bthk, 2))


class Attention(nn.Module):
    config: ModelConfig

    def _proj(self, name, heads, head_axis, x_btd):
        return HeadProjection(self.config, heads, head_axis, name=name)(x_btd)

    @nn.compact
    def __call__(self, x_btd, positions_bt, segment_ids_bt, layer_cache, cache_index,
                 kv_segment_ids_bs, layer_id=0):
        """`layer_id`: the layer's index in the model (int, or traced in a scan), for its
        window and RoPE base where the layers differ (`layer_window`, `layer_inv_freq`)."""
        cfg = self.config
        q = self._proj("q_proj", cfg.num_heads, "heads", x_btd)
        k = self._proj("k_proj", cfg.num_kv_heads, "kv_heads", x_btd)
        v = self._proj("v_proj", cfg.num_kv_heads, "kv_heads", x_btd)
        if cfg.qk_norm:  # Qwen3, Gemma 3: one RMSNorm over head_dim shared by all heads
            q = _norm(cfg, "q_norm", "head_dim")(q)
            k = _norm(cfg, "k_norm", "head_dim")(k)
        q = nn.with_logical_constraint(q, ("batch", "length", "act_heads", "head_dim"))
        k = nn.with_logical_constraint(k, ("batch", "length", "act_kv_heads", "head_dim"))
        cos_bt1d, sin_bt1d = rope_tables(positions_bt, layer_inv_freq(cfg, layer_id), q.dtype,
                                         _positions_below(layer_cache, q.shape[1],
                                                          kv_segment_ids_bs))
        q, k = rotate(q, cos_bt1d, sin_bt1d), rotate(k, cos_bt1d, sin_bt1d)
        if cfg.query_pre_attn_scalar is not None:
            # Every implementation scales the scores by head_dim ** -1/2: the queries carry the
            # rest of Gemma's query_pre_attn_scalar ** -1/2 (multiplied in fp32).
            extra = cfg.attention_scale * math.sqrt(cfg.head_dim)
            q = (q.astype(jnp.float32) * extra).astype(q.dtype)
        window = layer_window(cfg, layer_id)

        if layer_cache is None:
            k_all, v_all, new_cache = k, v, None
            kv_segment_ids_bs, cache_index = segment_ids_bt, 0
        else:
            new_cache, k_all, v_all = _write_cache(layer_cache, k, v, cache_index)
        if isinstance(new_cache, DecodeKV):  # one token against this layer's own cache
            out_bthd = attention.cached_query_attention(
                q, new_cache.k_bkcdi, new_cache.v_bksd, segment_ids_bt, kv_segment_ids_bs,
                cache_index, impl=cfg.attention, window=window, softcap=cfg.attn_softcap)
        else:
            out_bthd = attention.dot_product_attention(
                q, k_all, v_all, segment_ids_bt, kv_segment_ids_bs, q_offset=cache_index,
                impl=cfg.attention, window=window, softcap=cfg.attn_softcap,
            )
        out_bthd = nn.with_logical_constraint(out_bthd, ("batch", "length", "act_heads", "head_dim"))
        out = OutProjection(cfg, name="o_proj")(out_bthd)
        return out, new_cache


def _positions_below(layer_cache, q_len: int, kv_segment_ids_bs) -> int | None:
    """A bound on the positions of a layer's queries, for `rope_tables`: the queries' own length
    without a cache, with a `DecodeKV` its slots' count (a token's position is at most its cache
    slot; the segment ids' length, which a windowed layer's ring may be shorter than), else
    none. Why a bound for a `DecodeKV`: its attention broadcasts the rotated query over the key
    tiles, and XLA fused the rotation's sines and cosines into that broadcast (once per tile:
    a fifth of a decode step at 1,056 slots); gathered from a table, they are not recomputed."""
    if layer_cache is None:
        return q_len
    return kv_segment_ids_bs.shape[1] if isinstance(layer_cache[0], DecodeKV) else None


def _write_cache(layer_cache, k_btkd, v_btkd, cache_index):
    """Writes this layer's new keys/values into its cache, in place.

    Args:
      layer_cache: (KVCache of every layer [l, b, S, k, d], this layer's index): the stacked
        cache rides in the layer scan's carry, so XLA updates the written slots in place;
        scanning over per-layer slices instead (xs -> ys) rebuilds the whole cache every
        decode step. Or (DecodeKV of this layer only, None): a token loop's stack that keeps
        each layer's cache apart (`engine.decode_layers`).
      k_btkd, v_btkd: [b, t, k, d] keys and values of the t new tokens.
      cache_index: slot of the first new token: a scalar, or int [b] (one token per row,
        row r's at slot cache_index[r]; continuous batching, `engine.rollout`). One token per
        row goes to its slot's position in a window's ring (`models.decode_kv`).

    Returns:
      (updated cache as given, this layer's keys [b, S, k, d], its values [b, S, k, d]; both
      None for a DecodeKV, which attention reads as it lies).
    """
    cache, layer = layer_cache
    if isinstance(cache, DecodeKV):
        return _write_decode(cache, k_btkd, v_btkd, cache_index), None, None
    if k_btkd.shape[1] == 1:  # a decode step: a window's ring holds slot s at s % R
        cache_index = cache_index % cache.k_lbskd.shape[2]
    if jnp.ndim(cache_index):  # one token per row, each at its own slot
        return _write_rows(cache, layer, k_btkd, v_btkd, cache_index)
    start = (layer, 0, cache_index, 0, 0)
    k_lbskd = jax.lax.dynamic_update_slice(cache.k_lbskd, k_btkd[None].astype(cache.k_lbskd.dtype),
                                           start)
    v_lbskd = jax.lax.dynamic_update_slice(cache.v_lbskd, v_btkd[None].astype(cache.v_lbskd.dtype),
                                           start)
    k_all = jax.lax.dynamic_index_in_dim(k_lbskd, layer, 0, keepdims=False)
    v_all = jax.lax.dynamic_index_in_dim(v_lbskd, layer, 0, keepdims=False)
    return KVCache(k_lbskd, v_lbskd), k_all, v_all


def _write_decode(cache: DecodeKV, k_b1kd, v_b1kd, cache_index) -> DecodeKV:
    """One new token per row into a layer's `DecodeKV`, in place (`DecodeKV.write_token`)."""
    if k_b1kd.shape[1] != 1:
        raise ValueError(f"a DecodeKV cache takes one token per row, got {k_b1kd.shape[1]}")
    return cache.write_token(k_b1kd[:, 0], v_b1kd[:, 0], cache_index)


def _write_rows(cache: KVCache, layer, k_b1kd, v_b1kd, index_b):
    """`_write_cache` of one token per row at per-row slots `index_b` [b] (the batch dim maps
    onto the cache's, so a data-parallel cache is written where it lies)."""
    if k_b1kd.shape[1] != 1:
        raise ValueError(f"per-row cache slots take one token per row, got {k_b1kd.shape[1]}")
    # The stacked cache [l, b, S, k, d]: a scatter writes in place (a select would rewrite
    # every layer's cache for each layer).
    where = (layer, jnp.arange(k_b1kd.shape[0]), index_b)
    k_all, v_all = (c.at[where].set(x[:, 0].astype(c.dtype))
                    for c, x in ((cache.k_lbskd, k_b1kd), (cache.v_lbskd, v_b1kd)))
    pick = lambda c: jax.lax.dynamic_index_in_dim(c, layer, 0, keepdims=False)
    return KVCache(k_all, v_all), pick(k_all), pick(v_all)


class Dense(nn.Module):
    """x [..., in] -> [..., features], no bias; the parameter tree of `nn.Dense` ("kernel"
    [in, features], same initialiser), computed as one 2-D dot (see `flat_matmul`)."""

    config: ModelConfig
    features: int
    axes: tuple[str, str]  # logical names of the kernel's (in, out) axes

    @nn.compact
    def __call__(self, x):
        cfg = self.config
        kernel = self.param(
            "kernel", nn.with_logical_partitioning(_init(), self.axes),
            (x.shape[-1], self.features), cfg.param_dtype,
        )
        return (flat_matmul(x.astype(cfg.dtype), kernel.astype(cfg.dtype), 1)
                + _adapted(self, kernel, self.axes, x, 1))


_ACTIVATIONS = {
    Activation.SILU: nn.silu,
    Activation.GELU_TANH: functools.partial(jax.nn.gelu, approximate=True),
}


class MLP(nn.Module):
    config: ModelConfig

    @nn.compact
    def __call__(self, x_btd):
        cfg = self.config

        def dense(name, features, axes):
            return Dense(cfg, features, axes, name=name)

        gate = dense("gate_proj", cfg.intermediate_size, ("embed", "mlp"))(x_btd)
        up = dense("up_proj", cfg.intermediate_size, ("embed", "mlp"))(x_btd)
        act = _ACTIVATIONS[cfg.activation]
        h_btf = nn.with_logical_constraint(act(gate) * up, ("batch", "length", "act_mlp"))
        return dense("down_proj", cfg.hidden_size, ("mlp", "embed"))(h_btf)


class DecoderLayer(nn.Module):
    """Pre-norm attention + gated MLP block (a mixture of experts where `config.moe` says);
    with `config.gemma_block`, each block's output normed again before the residual add.

    Scanned: (carry=(x, whole KVCache or None), xs=(layer index, routes or None)) ->
    ((x, updated cache), None). `layer_id`: the layer's index in the model where `layer` is
    not it (a layer-by-layer stack's own caches); a mixed dense/sparse model asks it.
    `routes_btk`: int [b, t, k] experts this layer must use (routing replay), or None.

    A sparse layer sows its `moe.RouterStats` as intermediates "router" and its chosen experts
    int32 [b, t, k] as "routes" (read by a caller that applies with mutable intermediates);
    replaying, also "route_changed" bool [b, t] (`moe.routes_differ`; `engine.replay.changed_counts`).
    """

    config: ModelConfig

    @nn.compact
    def __call__(self, carry, layer, positions_bt, segment_ids_bt, cache_index,
                 kv_segment_ids_bs, routes_btk=None, layer_id=None):
        cfg = self.config
        x_btd, cache = carry
        norm = functools.partial(_norm, cfg)
        model_layer = layer if layer_id is None else layer_id
        attn_out, new_cache = Attention(cfg, name="self_attn")(
            norm("input_layernorm")(x_btd), positions_bt, segment_ids_bt,
            None if cache is None else (cache, layer), cache_index, kv_segment_ids_bs,
            model_layer,
        )
        if cfg.gemma_block:  # Gemma: post_attention_layernorm norms the attention's output
            x_btd = x_btd + norm("post_attention_layernorm")(attn_out)
            h_btd = norm("pre_feedforward_layernorm")(x_btd)
        else:  # Llama: post_attention_layernorm is the MLP's input norm
            x_btd = x_btd + attn_out
            h_btd = norm("post_attention_layernorm")(x_btd)
        if cfg.moe is None:
            y_btd = MLP(cfg, name="mlp")(h_btd)
        else:
            y_btd = self._sparse(h_btd, segment_ids_bt, routes_btk, model_layer)
        x_btd = x_btd + (norm("post_feedforward_layernorm")(y_btd) if cfg.gemma_block else y_btd)
        x_btd = nn.with_logical_constraint(x_btd, ("batch", "length", "act_embed"))
        return (x_btd, new_cache), None

    def _sparse(self, h_btd, segment_ids_bt, routes_btk, layer_id):
        """The feed-forward of a model with experts: the MoE block, or for a mixed model the
        dense MLP where `layer_id` is a dense layer. A mixed model's layers hold both blocks
        (one parameter stack); with the index traced (a scan) both run and one is selected."""
        cfg = self.config
        dense = cfg.moe.dense_layers
        static = isinstance(layer_id, int)
        if static and layer_id in dense:
            y_btd = MLP(cfg, name="mlp")(h_btd)
            stats = moe.zero_stats(cfg.moe.num_experts)
            experts_btk = jnp.zeros((*h_btd.shape[:2], cfg.moe.top_k), jnp.int32)
            changed_bt = jnp.zeros(h_btd.shape[:2], bool)
        else:
            y_btd, stats, experts_btk, changed_bt = moe.MoeBlock(cfg, name="moe")(
                h_btd, segment_ids_bt != 0, routes_btk)
            if dense and not static:
                is_sparse = jnp.all(jnp.asarray(dense, jnp.int32) != layer_id)
                y_btd = jnp.where(is_sparse, y_btd, MLP(cfg, name="mlp")(h_btd))
                stats = jax.tree.map(lambda s: s * is_sparse, stats)
                changed_bt = None if changed_bt is None else changed_bt & is_sparse
        self.sow("intermediates", "router", stats)
        self.sow("intermediates", "routes", experts_btk)
        if routes_btk is not None:  # replayed: where the router would have chosen otherwise
            self.sow("intermediates", "route_changed", changed_bt)
        return y_btd


_REMAT_POLICIES = {
    RematPolicy.DOTS: jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    RematPolicy.FULL: jax.checkpoint_policies.nothing_saveable,
}


def _layer_stack(cfg: ModelConfig):
    layer = DecoderLayer
    if cfg.remat is not RematPolicy.NONE:
        layer = nn.remat(layer, policy=_REMAT_POLICIES[cfg.remat], prevent_cse=False)
    return nn.scan(
        layer,
        variable_axes={"params": 0, "intermediates": 0},
        split_rngs={"params": True},
        in_axes=(0, nn.broadcast, nn.broadcast, nn.broadcast, nn.broadcast, 0),
        length=cfg.num_layers,
        unroll=1 if cfg.scan_layers else cfg.num_layers,
        metadata_params={nn.PARTITION_NAME: "layers"},
    )


class LayerInputs(NamedTuple):
    """What every layer reads besides its carry; dim 0 of each array is the batch.

    positions_bt, segment_ids_bt: int [b, t]; kv_segment_ids_bs: int [b, S] or None.
    """

    positions_bt: jax.Array
    segment_ids_bt: jax.Array
    kv_segment_ids_bs: jax.Array | None


# (one layer's params, carry (x_btd, stacked KVCache of the layers run or None), layer index
#  into that cache, LayerInputs, cache_index) -> new carry.
LayerFn = Callable[[Any, tuple, jax.Array, LayerInputs, Any], tuple]


class LayerStack(Protocol):
    """Runs the stacked decoder layers another way than the plain scan (e.g. as a pipeline,
    `jaxrlhf/parallel/pipeline.py`). The parameter tree is the same either way.
    """

    def __call__(self, layer_fn: LayerFn, params_l, x_btd: jax.Array, cache: KVCache | None,
                 inputs: LayerInputs, cache_index, unroll: bool
                 ) -> tuple[jax.Array, KVCache | None]:
        """params_l: every layer's params stacked on dim 0 [L, ...]; x_btd [b, t, d]; cache
        [L, b, S, k, d] or None. Returns (x_btd after all L layers, updated cache or None)."""
        ...


def apply_layer(cfg: ModelConfig, params, carry, layer, inputs: LayerInputs, cache_index,
                layer_id=None):
    """One decoder layer as a pure function of its own (unstacked) parameters: the body a
    `LayerStack` runs, with the same remat policy as the plain scan. `layer_id`: the layer's
    index in the model when `layer` (an index into the cache given) is not it."""

    def run(params, carry):
        (carry, _) = DecoderLayer(cfg, parent=None).apply(
            {"params": params}, carry, layer, inputs.positions_bt, inputs.segment_ids_bt,
            cache_index, inputs.kv_segment_ids_bs, None, layer_id,
        )
        return carry

    if cfg.remat is not RematPolicy.NONE:
        run = jax.checkpoint(run, policy=_REMAT_POLICIES[cfg.remat], prevent_cse=False)
    return run(params, carry)


class Transformer(nn.Module):
    """Token ids -> logits [b, t, vocab] (HeadKind.LM) or values [b, t] (HeadKind.SCALAR).

    `layer_stack`, when given, runs the decoder layers in `apply` (init always uses the plain
    scan, so the parameters are the same with or without it).
    """

    config: ModelConfig
    layer_stack: LayerStack | None = None

    @nn.compact
    def __call__(
        self,
        tokens_bt: jax.Array,
        positions_bt: jax.Array,
        segment_ids_bt: jax.Array,
        cache: KVCache | None = None,
        cache_index: jax.Array | int = 0,
        kv_segment_ids_bs: jax.Array | None = None,
        last_only: bool = False,
        with_head: bool = True,
        routes_lbtk: jax.Array | None = None,
    ) -> tuple[jax.Array, KVCache | None]:
        """Forward pass.

        Args:
          tokens_bt: int [batch, len] token ids.
          positions_bt: int [batch, len] RoPE positions (restart at 0 per packed sequence).
          segment_ids_bt: int [batch, len]; 0 marks padding, equal ids attend to each other.
          cache: optional KVCache of length S; new keys/values are written at `cache_index`.
          cache_index: scalar slot where `tokens_bt[:, 0]` goes in the cache, or int [batch]
            (len 1: each row's token at its own slot; causality then follows each row's).
          kv_segment_ids_bs: int [batch, S] segment ids of every cache slot *after* this write.
          last_only: apply the head to the last position only (prefill needs just the next
            token's logits; the [batch, len, vocab] array would dominate its memory).
          with_head: False returns the last layer's output x_btd [batch, len, embed] (compute
            dtype; `last_only` aside) instead of the head's, for a caller that applies
            `final_norm` and `head_out` itself, e.g. in row chunks (`engine.inference`).
          routes_lbtk: int [layers, batch, len, top_k] experts every sparse layer must use
            (routing replay, models/moe.py; a dense layer's rows are ignored), or None: each
            layer's router chooses. Read by the plain layer scan only.

        Returns:
          (logits_btv float32 or values_bt float32, or x_btd without the head; updated cache
          or None).
        """
        cfg = self.config
        embed = nn.Embed(
            cfg.vocab_size, cfg.hidden_size, dtype=cfg.dtype, param_dtype=cfg.param_dtype,
            embedding_init=nn.with_logical_partitioning(_init(), ("vocab", "embed")),
            name="embed_tokens",
        )
        x_btd = embed(tokens_bt)
        if cfg.gemma_block:  # Gemma: the embedding times sqrt(hidden), in the compute dtype
            x_btd = x_btd * jnp.asarray(math.sqrt(cfg.hidden_size), cfg.dtype)
        x_btd = nn.with_logical_constraint(x_btd, ("batch", "length", "act_embed"))
        if self.layer_stack is None or self.is_initializing():
            layers_l = jnp.arange(cfg.num_layers, dtype=jnp.int32)
            (x_btd, new_cache), _ = _layer_stack(cfg)(cfg, name="layers")(
                (x_btd, cache), layers_l, positions_bt, segment_ids_bt, cache_index,
                kv_segment_ids_bs, routes_lbtk,
            )
        else:
            if routes_lbtk is not None:
                raise ValueError("routing replay runs on the plain layer scan, not a LayerStack")
            if cfg.layers_differ and getattr(self.layer_stack, "stages", 1) > 1:
                # A pipeline's stages index their own layers: a layer's window would be wrong.
                raise ValueError("a model whose layers differ in their sliding window "
                                 "(Gemma 3) does not run as a pipeline")
            x_btd, new_cache = self.layer_stack(
                functools.partial(apply_layer, cfg), self.variables["params"]["layers"], x_btd,
                cache, LayerInputs(positions_bt, segment_ids_bt, kv_segment_ids_bs),
                cache_index, not cfg.scan_layers,
            )
        if not with_head and not self.is_initializing():
            # Before the final norm: the caller normalises its row chunks one at a time, so
            # no normed copy of the whole batch (nor, training, its gradient) lives beside it.
            return x_btd, new_cache
        x_btd = _norm(cfg, "norm")(x_btd)
        if last_only:
            x_btd = x_btd[:, -1:]
        return head_out(cfg, self._head_kernel(embed), x_btd), new_cache

    def _head_kernel(self, embed: nn.Embed) -> jax.Array:
        """The head's weight, declared here unless it is the tied embedding (`head_kernel`)."""
        cfg = self.config
        match cfg.head:
            case HeadKind.LM if cfg.tie_word_embeddings:
                return embed.embedding.T
            case HeadKind.LM:
                return self.param(
                    "lm_head", nn.with_logical_partitioning(_init(), ("embed", "vocab")),
                    (cfg.hidden_size, cfg.vocab_size), cfg.param_dtype,
                )
            case HeadKind.SCALAR:
                return self.param(
                    "score", nn.with_logical_partitioning(nn.initializers.zeros, ("embed", None)),
                    (cfg.hidden_size, 1), cfg.param_dtype,
                )


def head_kernel(cfg: ModelConfig, params) -> jax.Array:
    """The head's weight [embed, vocab] (LM; the embedding's transpose when tied) or
    [embed, 1] (scalar) in the parameter dtype, from the model's (unboxed) parameter tree."""
    match cfg.head:
        case HeadKind.LM if cfg.tie_word_embeddings:
            return params["embed_tokens"]["embedding"].T
        case HeadKind.LM:
            return params["lm_head"]
        case HeadKind.SCALAR:
            return params["score"]


def final_norm(cfg: ModelConfig, scale_d: jax.Array, x_btd: jax.Array) -> jax.Array:
    """The model's final RMSNorm on the last layer's output x_btd [b, t, embed] with its scale
    `scale_d` [embed] (`params["norm"]["scale"]`, of any float dtype: it is cast to the
    compute dtype), as `Transformer` applies it before its head: x_btd [b, t, embed]."""
    return _norm(cfg).apply({"params": {"scale": scale_d}}, x_btd)


def head_out(cfg: ModelConfig, kernel_dv: jax.Array, x_btd: jax.Array) -> jax.Array:
    """The head on final-norm outputs x_btd [b, t, embed] with its weight `kernel_dv`
    (`head_kernel`): logits_btv float32 (LM; softcapped where `final_softcap` says) or
    values_bt float32 (scalar)."""
    out = flat_matmul(x_btd, kernel_dv.astype(cfg.dtype), 1, preferred_element_type=jnp.float32)
    if cfg.head is HeadKind.SCALAR:
        return out[..., 0]
    if cfg.final_softcap is not None:
        out = cfg.final_softcap * jnp.tanh(out / cfg.final_softcap)
    return nn.with_logical_constraint(out, ("batch", "length", "act_vocab"))
