"""Attention math of the decoder: mask + softmax(Q K^T / sqrt(d)) V, with GQA and segment ids.

One entry point, `dot_product_attention`, serves every use of the model:
  * full forward on a padded or packed batch (keys = the queries' own tokens, `q_offset=0`);
  * prefill of a KV cache (keys = the whole cache, `q_offset=0`);
  * decode of one or more tokens against the cache (`q_offset` = the cache slot of query 0).

Slots are implicit: query t sits at slot `q_offset + t`, key s at slot s. A query attends to a
key iff the key's slot is not after the query's (causal) and both carry the same non-zero
segment id (0 marks padding, so padding and packed neighbours never see each other). A query
with no visible key (a padding query) gets a finite, meaningless output, never NaN.

The backend is chosen by `AttentionImpl`: plain XLA einsums here; cuDNN through
`jax.nn.dot_product_attention`; the Pallas kernels in the top-level `kernels/` package.
"""

from __future__ import annotations

import enum
import math

import jax
import jax.numpy as jnp

_NEG_INF = -1e30  # finite, so fully masked rows (padding queries) give no NaN


class AttentionImpl(enum.Enum):
    """Which implementation computes attention (config key `models.<role>.attention`)."""

    AUTO = "auto"  # XLA on CPU, cuDNN on GPU, Pallas on TPU
    XLA = "xla"  # plain einsums + softmax; every backend
    CUDNN = "cudnn"  # jax.nn.dot_product_attention(implementation="cudnn"); GPU only
    PALLAS = "pallas"  # kernels/ (flash attention, ragged decode); interpret mode on CPU


def attention_mask(q_slot_bt, q_seg_bt, k_slot_bs, k_seg_bs) -> jax.Array:
    """Boolean [batch, 1, 1, q_len, k_len]: causal over slots, same non-zero segment."""
    causal = k_slot_bs[:, None, :] <= q_slot_bt[:, :, None]
    same_seg = (q_seg_bt[:, :, None] == k_seg_bs[:, None, :]) & (k_seg_bs[:, None, :] != 0)
    return (causal & same_seg)[:, None, None, :, :]


def dot_product_attention(
    q_bthd: jax.Array,
    k_bskd: jax.Array,
    v_bskd: jax.Array,
    q_segment_ids_bt: jax.Array,
    kv_segment_ids_bs: jax.Array,
    q_offset: jax.Array | int = 0,
    impl: AttentionImpl = AttentionImpl.XLA,
) -> jax.Array:
    """Causal, segment-masked grouped-query attention.

    Args:
      q_bthd: [batch, q_len, heads, head_dim] queries (RoPE applied); sets the compute dtype.
      k_bskd, v_bskd: [batch, k_len, kv_heads, head_dim] keys and values (the KV cache when
        decoding); heads must be a multiple of kv_heads (query head h reads kv head
        h // (heads // kv_heads)).
      q_segment_ids_bt: int [batch, q_len] segment ids of the queries; 0 = padding.
      kv_segment_ids_bs: int [batch, k_len] segment ids of the keys; 0 = padding/unused.
      q_offset: scalar (traced or static) key slot of query 0: 0 without a cache or for
        prefill, the cache index when decoding.
      impl: the implementation; AUTO resolves by the default backend.

    Returns:
      [batch, q_len, heads, head_dim] in q's dtype.
    """
    match resolve_impl(impl):
        case AttentionImpl.XLA:
            return _xla_attention(q_bthd, k_bskd, v_bskd, q_segment_ids_bt, kv_segment_ids_bs,
                                  q_offset)
        case other:
            raise NotImplementedError(f"attention implementation {other.value!r} not built yet")


def resolve_impl(impl: AttentionImpl, backend: str | None = None) -> AttentionImpl:
    """The concrete implementation AUTO stands for on `backend` (default: JAX's default)."""
    if impl is not AttentionImpl.AUTO:
        return impl
    return AttentionImpl.XLA


def _xla_attention(q_bthd, k_bskd, v_bskd, q_seg_bt, kv_seg_bs, q_offset) -> jax.Array:
    """Reference implementation: materialises the [b, kv, groups, t, s] score tensor in fp32."""
    batch, q_len, heads, head_dim = q_bthd.shape
    k_len, kv_heads = k_bskd.shape[1], k_bskd.shape[2]
    dtype = q_bthd.dtype
    q_slot_bt = jnp.broadcast_to(jnp.arange(q_len) + q_offset, (batch, q_len))
    k_slot_bs = jnp.broadcast_to(jnp.arange(k_len), (batch, k_len))
    mask = attention_mask(q_slot_bt, q_seg_bt, k_slot_bs, kv_seg_bs)

    groups = heads // kv_heads
    q_btkgd = q_bthd.reshape(batch, q_len, kv_heads, groups, head_dim)
    scores_bkgts = jnp.einsum(
        "btkgd,bskd->bkgts", q_btkgd, k_bskd.astype(dtype), preferred_element_type=jnp.float32,
    ) / math.sqrt(head_dim)
    scores_bkgts = jnp.where(mask, scores_bkgts, _NEG_INF)
    probs = jax.nn.softmax(scores_bkgts, axis=-1).astype(dtype)
    out_btkgd = jnp.einsum("bkgts,bskd->btkgd", probs, v_bskd.astype(dtype))
    return out_btkgd.reshape(batch, q_len, heads, head_dim)
