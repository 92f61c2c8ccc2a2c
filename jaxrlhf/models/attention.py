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
`jax.nn.dot_product_attention`; the Pallas kernels in the top-level `kernels/` package (on a
TPU, JAX's splash attention through `kernels/tpu_attention.py`).

Sliding windows and score softcapping (Mistral, Gemma 3) run on XLA's path whatever the
implementation: a call given a `window` or a `softcap` computes `_xla_attention` (or, decoding,
`cached_query_attention`'s XLA products); the CPU decode kernel, the Pallas kernels and cuDNN
take neither. A window masks the keys more than `window - 1` slots before the query (HF's
`kv > q - window`); a windowed model's global layers get a window past every slot.
"""

from __future__ import annotations

import contextlib
import contextvars
import enum
import logging
import math

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxrlhf.models import decode_kv
from jaxrlhf.models.decode_kv import DecodeKV
from jaxrlhf.kernels import (
    cpu_decode_attention, decode_attention, flash_attention, target, tpu_attention,
)

_NEG_INF = -1e30  # finite, so fully masked rows (padding queries) give no NaN


class AttentionImpl(enum.Enum):
    """Which implementation computes attention (config key `models.<role>.attention`)."""

    AUTO = "auto"  # XLA on CPU (a decode step: the C++ kernel), cuDNN on GPU, Pallas on TPU
    XLA = "xla"  # plain einsums + softmax; every backend
    CUDNN = "cudnn"  # jax.nn.dot_product_attention(implementation="cudnn"); GPU only
    PALLAS = "pallas"  # kernels/: flash + ragged decode (GPU; CPU interprets), splash (TPU)


def attention_mask(q_slot_bt, q_seg_bt, k_slot_bs, k_seg_bs, window=None) -> jax.Array:
    """Boolean [batch, 1, 1, q_len, k_len]: causal over slots, same non-zero segment, and with
    a `window` (int, or a traced int scalar) no more than window - 1 slots back."""
    causal = k_slot_bs[:, None, :] <= q_slot_bt[:, :, None]
    if window is not None:
        causal &= k_slot_bs[:, None, :] > q_slot_bt[:, :, None] - window
    same_seg = (q_seg_bt[:, :, None] == k_seg_bs[:, None, :]) & (k_seg_bs[:, None, :] != 0)
    return (causal & same_seg)[:, None, None, :, :]


def _softcapped(scores, softcap: float | None):
    """Gemma's score capping, c * tanh(scores / c), or the scores as they are."""
    return scores if softcap is None else softcap * jnp.tanh(scores / softcap)


def _query_slots(q_offset, batch: int, q_len: int) -> jax.Array:
    """int [batch, q_len] key slot of every query: `q_offset` (scalar, or [batch] one per
    row) + t."""
    slots = jnp.arange(q_len, dtype=jnp.int32)[None, :] + jnp.reshape(q_offset, (-1, 1))
    return jnp.broadcast_to(slots, (batch, q_len))


def _key_slots(q_slot_bt, k_len: int, kv_seg_bs) -> tuple[jax.Array, jax.Array]:
    """(int [b, k_len] the slot each key position holds, the keys' segment ids [b, k_len]):
    position j holds slot j, or in a window's ring shorter than the segment ids (one query
    per row, `models.decode_kv`) slot q - ((q - j) mod k_len); a position with no slot yet
    reads as padding."""
    batch = q_slot_bt.shape[0]
    if k_len == kv_seg_bs.shape[1]:
        return jnp.broadcast_to(jnp.arange(k_len), (batch, k_len)), kv_seg_bs
    if q_slot_bt.shape[1] != 1:
        raise ValueError(f"a ring of {k_len} slots takes one query per row, "
                         f"got {q_slot_bt.shape[1]}")
    k_slot_bs = decode_kv.ring_slots(q_slot_bt[:, 0], k_len)
    kv_seg_bs = jnp.where(k_slot_bs >= 0, jnp.take_along_axis(
        kv_seg_bs, jnp.maximum(k_slot_bs, 0), axis=1), 0)
    return k_slot_bs, kv_seg_bs


def dot_product_attention(
    q_bthd: jax.Array,
    k_bskd: jax.Array,
    v_bskd: jax.Array,
    q_segment_ids_bt: jax.Array,
    kv_segment_ids_bs: jax.Array,
    q_offset: jax.Array | int = 0,
    impl: AttentionImpl = AttentionImpl.XLA,
    window: jax.Array | int | None = None,
    softcap: float | None = None,
) -> jax.Array:
    """Causal, segment-masked grouped-query attention.

    Args:
      q_bthd: [batch, q_len, heads, head_dim] queries (RoPE applied); sets the compute dtype.
      k_bskd, v_bskd: [batch, k_len, kv_heads, head_dim] keys and values (the KV cache when
        decoding; with a window, a ring shorter than kv_segment_ids_bs: `_key_slots`); heads must be a multiple of kv_heads (query head h reads kv head
        h // (heads // kv_heads)).
      q_segment_ids_bt: int [batch, q_len] segment ids of the queries; 0 = padding.
      kv_segment_ids_bs: int [batch, k_len] segment ids of the keys; 0 = padding/unused.
      q_offset: scalar (traced or static) key slot of query 0: 0 without a cache or for
        prefill, the cache index when decoding; or int [batch], each row's own (decode).
      impl: the implementation; AUTO resolves by the default backend.
      window: sliding window in slots (`attention_mask`), or None; with `softcap` (scores
        capped, `_softcapped`), it runs XLA's path (module docstring).

    Returns:
      [batch, q_len, heads, head_dim] in q's dtype.
    """
    if window is not None or softcap is not None:
        return _xla_attention(q_bthd, k_bskd, v_bskd, q_segment_ids_bt, kv_segment_ids_bs,
                              q_offset, window, softcap)
    match resolve_impl(impl):
        case AttentionImpl.XLA:
            return _xla_attention(q_bthd, k_bskd, v_bskd, q_segment_ids_bt, kv_segment_ids_bs,
                                  q_offset)
        case AttentionImpl.CUDNN:
            return _cudnn_attention(q_bthd, k_bskd, v_bskd, q_segment_ids_bt, kv_segment_ids_bs,
                                    q_offset)
        case AttentionImpl.PALLAS:
            return _pallas_attention(q_bthd, k_bskd, v_bskd, q_segment_ids_bt,
                                     kv_segment_ids_bs, q_offset)


def resolve_impl(impl: AttentionImpl, backend: str | None = None) -> AttentionImpl:
    """The concrete implementation AUTO stands for on `backend` (default: the platform of the
    program being traced, `kernels.target.platform`)."""
    if impl is not AttentionImpl.AUTO:
        return impl
    match backend or target.platform():
        case "gpu" | "cuda":  # ("rocm" has no cuDNN: XLA below)
            return AttentionImpl.CUDNN  # falls back to XLA per call where cuDNN cannot
        case "tpu":
            return AttentionImpl.PALLAS
        case _:
            return AttentionImpl.XLA


def unavailable_reason(impl: AttentionImpl, backend: str | None = None) -> str | None:
    """Why `impl` cannot run on `backend` at all (None if it can); for config validation."""
    backend = backend or target.platform()
    if impl is AttentionImpl.CUDNN and backend not in ("gpu", "cuda"):
        return f"cudnn needs an NVIDIA GPU, the backend is {backend}; use auto, xla or pallas"
    return None


def _xla_attention(q_bthd, k_bskd, v_bskd, q_seg_bt, kv_seg_bs, q_offset, window=None,
                   softcap=None) -> jax.Array:
    """Reference implementation: materialises the [b, kv, groups, t, s] score tensor in fp32.

    The heads are moved ahead of the positions first, each keeping the head dim minor
    (q [b, k, g, t, d], keys and values [b, k, s, d]), so both products are batched matmuls
    over (row, kv head) and the output goes back to [b, t, h, d] in one transpose. Why: left
    to choose, XLA:CPU transposed the queries (and, in the backward, the gradients) to a
    layout with the head dim *major* ([b, k, d, g*t]), a strided copy that cost more than the
    products themselves; on W-cpu's train step this layout takes about a seventh off the
    attention's time, and about a third off a forward's.
    """
    batch, q_len, heads, head_dim = q_bthd.shape
    k_len, kv_heads = k_bskd.shape[1], k_bskd.shape[2]
    dtype = q_bthd.dtype
    q_slot_bt = _query_slots(q_offset, batch, q_len)
    k_slot_bs, kv_seg_bs = _key_slots(q_slot_bt, k_len, kv_seg_bs)
    mask = attention_mask(q_slot_bt, q_seg_bt, k_slot_bs, kv_seg_bs, window)

    groups = heads // kv_heads
    q_bkgtd = q_bthd.reshape(batch, q_len, kv_heads, groups, head_dim).transpose(0, 2, 3, 1, 4)
    k_bksd = jnp.swapaxes(k_bskd, 1, 2).astype(dtype)
    v_bksd = jnp.swapaxes(v_bskd, 1, 2).astype(dtype)
    scores_bkgts = jnp.einsum(
        "bkgtd,bksd->bkgts", q_bkgtd, k_bksd, preferred_element_type=jnp.float32,
    ) / math.sqrt(head_dim)
    scores_bkgts = jnp.where(mask, _softcapped(scores_bkgts, softcap), _NEG_INF)
    probs = jax.nn.softmax(scores_bkgts, axis=-1).astype(dtype)
    out_bkgtd = jnp.einsum("bkgts,bksd->bkgtd", probs, v_bksd)
    return out_bkgtd.transpose(0, 3, 1, 2, 4).reshape(batch, q_len, heads, head_dim)


def cached_query_attention(q_b1hd, k_bkcdi, v_bksd, q_seg_b1, kv_seg_bs, q_offset,
                           impl: AttentionImpl = AttentionImpl.XLA, window=None,
                           softcap: float | None = None) -> jax.Array:
    """`dot_product_attention` of one query per row (a decode step) against a layer's own cache
    laid out as `models.decode_kv.DecodeKV`: keys in tiles [b, k, c, d, i], values [b, k, S, d].

    With XLA both products are batched matrix products whose big operand, the cache, lies as
    the dot reads it: the scores q [g, d] x K [d, i] per (row, kv head, tile), each tile one
    contiguous block (the queries broadcast over the tiles: c x g x d per (row, kv head),
    1/32 of the keys at 64-slot tiles); the output p [g, S] x V [S, d] per (row, kv head).
    Scores and softmax in fp32, probabilities rounded to q's dtype, as `_xla_attention`.
    AUTO on a CPU backend runs `kernels.cpu_decode_attention` instead where it takes the
    operands: the same attention, fused and on every core, reading only up to each row's query
    slot (XLA:CPU runs these products on one thread). Other
    implementations get the cache in their own layout (a transpose per call: the Pallas kernels
    in interpret mode on CPU, for tests; splash on a TPU, where the engines decode the stacked
    cache instead, `engine.decoding.decodes_layer_by_layer`). cuDNN has no such layout: CUDNN (AUTO on a GPU) runs
    the XLA products too (one H200, Llama-3.2-1B bf16, batch 64, 768 slots: a decode step of
    1.87 ms layer by layer this way, against 3.68 ms for the scanned stack with cuDNN;
    `benchmarks/gpu_kernels.py --stack`).

    Args:
      q_b1hd: [b, 1, heads, head_dim] one query per row.
      k_bkcdi, v_bksd: the cache, written up to each row's query slot; a windowed layer's
        may be a ring of fewer slots than kv_seg_bs has (`decode_kv`; XLA's path only).
      q_seg_b1, kv_seg_bs, q_offset: as `dot_product_attention`.
      impl: the implementation.
      window, softcap: as `dot_product_attention`; either runs the XLA products below.

    Returns:
      [b, 1, heads, head_dim] in q's dtype.
    """
    plain = window is None and softcap is None
    if (plain and impl is AttentionImpl.AUTO
            and cpu_decode_attention.takes(q_b1hd, k_bkcdi, v_bksd)):
        return cpu_decode_attention.decode_attention(q_b1hd, k_bkcdi, v_bksd, q_seg_b1,
                                                     kv_seg_bs, q_offset)
    if plain and resolve_impl(impl) not in (AttentionImpl.XLA, AttentionImpl.CUDNN):
        k_bskd, v_bskd = DecodeKV(k_bkcdi, v_bksd).stacked()
        return dot_product_attention(q_b1hd, k_bskd, v_bskd, q_seg_b1, kv_seg_bs, q_offset, impl)
    batch, _, heads, head_dim = q_b1hd.shape
    _, kv_heads, tiles, _, tile = k_bkcdi.shape
    k_len = v_bksd.shape[2]
    dtype = q_b1hd.dtype
    q_slot_b1 = _query_slots(q_offset, batch, 1)
    k_slot_bs, kv_seg_bs = _key_slots(q_slot_b1, k_len, kv_seg_bs)
    mask_b11s = attention_mask(q_slot_b1, q_seg_b1, k_slot_bs, kv_seg_bs, window)[:, 0, 0]
    groups = heads // kv_heads
    q_bkcgd = jnp.broadcast_to(q_b1hd.reshape(batch, kv_heads, 1, groups, head_dim),
                               (batch, kv_heads, tiles, groups, head_dim))
    scores_bkcgi = jnp.einsum("bkcgd,bkcdi->bkcgi", q_bkcgd, k_bkcdi.astype(dtype),
                              preferred_element_type=jnp.float32)
    scores_bkgs = jnp.swapaxes(scores_bkcgi, 2, 3).reshape(batch, kv_heads, groups, tiles * tile)
    scores_bkgs = scores_bkgs[..., :k_len] / math.sqrt(head_dim)
    scores_bkgs = jnp.where(mask_b11s[:, None], _softcapped(scores_bkgs, softcap), _NEG_INF)
    # The softmax's division after the product, on the [b, k, g, d] output: one pass over the
    # scores fewer. (Rounded to q's dtype are then the unnormalised weights, in (0, 1].)
    weights_bkgs = jnp.exp(scores_bkgs - jnp.max(scores_bkgs, axis=-1, keepdims=True))
    total_bkg1 = jnp.sum(weights_bkgs, axis=-1, keepdims=True)
    out_bkgd = jnp.einsum("bkgs,bksd->bkgd", weights_bkgs.astype(dtype), v_bksd.astype(dtype),
                          preferred_element_type=jnp.float32) / total_bkg1
    return out_bkgd.astype(dtype).reshape(batch, 1, heads, head_dim)


# --- cuDNN (jax.nn.dot_product_attention) -------------------------------------------------

# JAX's batching rule for cuDNN attention (jax 0.10, `_dot_product_attention_fwd_batcher`)
# reshapes a batched mask to [batch, query heads, T, S], so ours, broadcast over the heads
# [batch, 1, T, S], fails under `jax.vmap` ("cannot reshape array of shape (8, 8, 1, 2048, 2048)
# ... into shape (64, 64, 2048, 2048)"; jax-ml/jax#34920). A pipeline's stages run under it.
_UNDER_VMAP = contextvars.ContextVar("attention_under_vmap", default=False)


@contextlib.contextmanager
def traced_under_vmap():
    """Attention traced inside runs under `jax.vmap` (a pipeline's stages,
    `parallel/pipeline.py`): cuDNN's falls back to XLA's there (`cudnn_fallback_reason`)."""
    token = _UNDER_VMAP.set(True)
    try:
        yield
    finally:
        _UNDER_VMAP.reset(token)


def cudnn_fallback_reason(q_bthd: jax.Array, k_bskd: jax.Array) -> str | None:
    """Why cuDNN flash attention cannot take these operands (None if it can)."""
    if _UNDER_VMAP.get():
        return ("under jax.vmap (a pipeline's stages) JAX's cuDNN attention takes no mask "
                "broadcast over the heads (jax-ml/jax#34920)")
    return cudnn_shape_reason(q_bthd.dtype, q_bthd.shape[-1])


def cudnn_shape_reason(dtype, head_dim: int) -> str | None:
    """Why cuDNN flash attention cannot take queries of `dtype` and `head_dim` (None if it
    can); the memory model asks it too (`plan.memory.scores_live`)."""
    if jnp.dtype(dtype) not in (jnp.bfloat16, jnp.float16):
        return f"cuDNN flash attention needs bf16/fp16, got {jnp.dtype(dtype)}"
    if head_dim % 8 or head_dim > 128:  # 256 on Hopper; 128 is safe on every GPU
        return f"cuDNN flash attention needs head_dim % 8 == 0 and <= 128, got {head_dim}"
    return None


def _cudnn_attention(q_bthd, k_bskd, v_bskd, q_seg_bt, kv_seg_bs, q_offset) -> jax.Array:
    """cuDNN fused attention; the segment/causal mask goes in as a boolean mask.

    Without a cache (q_offset == 0, equal lengths) the causal part is cuDNN's own (it skips the
    masked tiles); with a cache the causal edge is shifted, so it is folded into the mask.
    Falls back to XLA, with a logged reason, where cuDNN cannot take the operands.
    """
    reason = cudnn_fallback_reason(q_bthd, k_bskd)
    if reason is not None:
        logging.warning("attention=cudnn falls back to xla: %s", reason)
        return _xla_attention(q_bthd, k_bskd, v_bskd, q_seg_bt, kv_seg_bs, q_offset)
    batch, q_len = q_seg_bt.shape
    k_len = kv_seg_bs.shape[1]
    own_causal = isinstance(q_offset, int) and q_offset == 0 and q_len == k_len
    same_seg = (q_seg_bt[:, :, None] == kv_seg_bs[:, None, :]) & (kv_seg_bs[:, None, :] != 0)
    if not own_causal:
        q_slot_bt = _query_slots(q_offset, batch, q_len)
        same_seg &= jnp.arange(k_len)[None, None, :] <= q_slot_bt[:, :, None]
    return jax.nn.dot_product_attention(
        q_bthd, k_bskd.astype(q_bthd.dtype), v_bskd.astype(q_bthd.dtype),
        mask=same_seg[:, None], is_causal=own_causal, implementation="cudnn",
    )


# --- Pallas (kernels/) --------------------------------------------------------------------


def _block(length: int, largest: int = 128) -> int:
    """A power-of-two block no longer than needed (short test sequences stay one block)."""
    return min(largest, max(16, 1 << (length - 1).bit_length()))  # GPU matmuls need >= 16


def _pallas_attention(q_bthd, k_bskd, v_bskd, q_seg_bt, kv_seg_bs, q_offset) -> jax.Array:
    """On a TPU, JAX's splash attention (`_tpu_attention`: our kernels below are written for
    Triton and do not lower for Mosaic). Elsewhere the flash kernel for a static q_offset
    (training, prefill), the ragged decode kernel otherwise, in interpret mode on a CPU.

    Queries that see no key (padding) come out as zeros from these two, where XLA returns an
    average of the values; neither is ever read by a real token.
    """
    platform = target.platform()
    if platform == "tpu":
        return _tpu_attention(q_bthd, k_bskd, v_bskd, q_seg_bt, kv_seg_bs, q_offset)
    interpret = platform == "cpu"
    batch, q_len = q_seg_bt.shape
    k_len = kv_seg_bs.shape[1]
    if isinstance(q_offset, int):
        cfg = flash_attention.FlashConfig(block_q=_block(q_len), block_k=_block(k_len),
                                          q_offset=q_offset, interpret=interpret)
        return flash_attention.flash_attention(q_bthd, k_bskd, v_bskd, q_seg_bt, kv_seg_bs, cfg)
    # Decode: every row's valid prefix ends after the newest query; nothing past it is read.
    q_start_b = jnp.broadcast_to(jnp.asarray(q_offset, jnp.int32), (batch,))
    cfg = decode_attention.DecodeConfig(block_k=_block(k_len, 256), interpret=interpret)
    return decode_attention.decode_attention(
        q_bthd, k_bskd, v_bskd, q_seg_bt, kv_seg_bs, q_start_b, q_start_b + q_len, cfg)


def _tpu_attention(q_bthd, k_bskd, v_bskd, q_seg_bt, kv_seg_bs, q_offset) -> jax.Array:
    """JAX's splash attention (`kernels/tpu_attention.py`), each device on its own rows and
    heads as the logical axis rules in scope split them ("batch", "act_heads": no resharding
    around the kernel); XLA, with a logged reason, where splash cannot take the operands.
    Queries that see no key get a finite average of some values, as with XLA."""
    reason = tpu_attention.fallback_reason(q_bthd, q_offset)
    if reason is not None:
        logging.warning("attention=pallas falls back to xla on TPU: %s", reason)
        return _xla_attention(q_bthd, k_bskd, v_bskd, q_seg_bt, kv_seg_bs, q_offset)
    return tpu_attention.attention(q_bthd, k_bskd, v_bskd, q_seg_bt, kv_seg_bs, q_offset,
                                   batch_axes=_rule_axes("batch"),
                                   head_axes=_rule_axes("act_heads") or ())


def _rule_axes(logical: str) -> tuple[str, ...] | None:
    """The mesh axes the flax logical axis rules in scope split `logical` over; None without
    rules (the kernel then picks)."""
    if not nn.get_logical_axis_rules():
        return None
    axes = nn.logical_to_mesh_axes((logical,))[0]
    return () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)
