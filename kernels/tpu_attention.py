"""Attention on TPU with the Pallas TPU kernel JAX ships, splash attention
(`jax.experimental.pallas.ops.tpu.splash_attention`): the semantics of
`models.attention.dot_product_attention` (causal over slots from `q_offset`, same non-zero
segment id, GQA; a query that sees no key gets a finite output).

Why splash, for every path: it takes segment ids, a causal mask with a static offset, grouped
query heads, and differentiates (its own custom_vjp: dQ and dK/dV kernels). The other kernels
JAX ships for TPU decode against a paged cache (`paged_attention`, `ragged_paged_attention`):
they mask by each row's length and causality only, with no segment ids, so the left padding
of our prompts (segment 0 at the start of a row's cache) would be attended.

  * Static `q_offset` (training, inference, prefill): splash's `CausalMask` with that offset
    and the segment ids. Segment equality alone suffices: a real query's segment is non-zero,
    so it never matches a key of segment 0.
  * Traced `q_offset`, one query per row (decode): the causal edge moves per row, and
    splash's masks are static; so causality is folded into the keys' segment ids (slots after
    the row's query become segment 0), exact for one query, and the kernel runs unmasked. A
    row's whole GQA group of query heads is stacked as the kernel's query sequence (one kv
    head per kernel head), so each kv head's cache is read once per row, not once per query
    head.
  * Traced `q_offset`, several queries per row (a pipeline's prefill: its stages carry the
    cache index as an array): one segment id per key cannot say which of the queries sees
    it, so each row's queries are placed at their own slots of a sequence as long as the
    cache, padding (segment 0) around them, where the static causal mask of offset 0 is
    theirs; the outputs are taken back from there. Exact and differentiable, at the cost of
    a whole cache's worth of queries.

Shapes the kernel cannot take are padded where that is exact: sequences to whole key blocks
of 128 slots (splash's segment-id and compute tiles: `_LANES`) with segment 0, which no real
query sees; the stacked decode queries to a multiple of 8 (a sublane tile), their outputs
dropped. What stays out (`fallback_reason`): dtypes other than float32 and bfloat16 (Mosaic
fails to compile float16 loads), a negative static `q_offset` (a block of queries before every
key: splash divides by a zero sum there), and float32 at a matmul precision Mosaic lacks
('high', 'tensorfloat32'). Every head_dim compiles (a block spans the whole head; checked for
8 to 256, 100 included), and every length (padded).

Splash reads a head's sequence as one [t, d] matrix, so q, k and v go in heads-major
([b, h, t, d], a transposing copy XLA fuses with the padding). For a decode step that is a copy
of the layer's cache per step, besides the kernel's read of it: what a cache stored
heads-major on TPU would save.

Splash does not scale the scores: the queries are multiplied by 1/sqrt(head_dim) first (in
fp32, then rounded to q's dtype: one rounding more than XLA's in bf16, none in fp32).

Sharding: a Mosaic custom call inside a sharded jit is not partitioned by XLA, which would
gather every operand whole onto each device. So the kernel runs inside `jax.shard_map` over the
mesh in scope, every free (not yet manual) axis made manual, rows split over `batch_axes` and
heads over `head_axes` where they divide. Under a mesh whose splitting axes are all manual
already (the rollout engine's own shard_map) it runs as written. Inside
`jax.vmap(..., spmd_axis_name=...)` (the pipeline's stages) the vmapped axis is manual too,
and vmap adds it to the specs of the stage dimension.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.tpu import splash_attention as splash
from jax.sharding import PartitionSpec

_LANES = 128  # a key block is a multiple of this many slots (splash's tiles)
_SUBLANES = 8  # a query block is a multiple of this many queries
_DTYPES = (jnp.float32, jnp.bfloat16)


def fallback_reason(q_bthd: jax.Array, q_offset) -> str | None:
    """Why splash cannot compute this attention exactly (None if it can)."""
    if q_bthd.dtype not in _DTYPES:
        return f"splash attention takes float32 or bfloat16 on TPU, got {q_bthd.dtype}"
    setting = jax.config.jax_default_matmul_precision
    if q_bthd.dtype == jnp.float32 and setting is not None and _precision(setting) not in (
            jax.lax.Precision.DEFAULT, jax.lax.Precision.HIGHEST):
        return (f"jax_default_matmul_precision={setting!r}: Mosaic multiplies float32 at "
                "'default' or 'highest' precision only")
    if isinstance(q_offset, int) and q_offset < 0:
        return f"q_offset={q_offset} < 0 leaves queries before every key"
    return None


def _precision(setting: str) -> jax.lax.Precision | None:
    """The precision a `jax_default_matmul_precision` value names (None: a dot algorithm)."""
    try:
        return jax.lax.Precision(setting)
    except ValueError:
        return None


def attention(
    q_bthd: jax.Array,
    k_bskd: jax.Array,
    v_bskd: jax.Array,
    q_segment_ids_bt: jax.Array,
    kv_segment_ids_bs: jax.Array,
    q_offset: jax.Array | int = 0,
    *,
    batch_axes: tuple[str, ...] | None = None,
    head_axes: tuple[str, ...] = (),
    interpret: bool = False,
) -> jax.Array:
    """Causal, segment-masked GQA attention by splash, on each device's own rows and heads.

    Args:
      q_bthd: [batch, q_len, heads, head_dim] queries (float32 or bfloat16).
      k_bskd, v_bskd: [batch, k_len, kv_heads, head_dim]; heads % kv_heads == 0.
      q_segment_ids_bt: int [batch, q_len]; kv_segment_ids_bs: int [batch, k_len]; 0 = pad.
      q_offset: static int >= 0, the slot of query 0 (training, prefill); or traced (>= 0),
        a scalar or int [batch]: each row's slot of its query 0 (decode).
      batch_axes: mesh axes the rows are split over (the layout's "batch" rule); None: every
        free axis of the mesh in scope, in its order, while they divide the batch.
      head_axes: mesh axes the query and kv heads are split over (the "act_heads" rule).
      interpret: Pallas interpret mode (runs on CPU, for tests).

    Returns:
      [batch, q_len, heads, head_dim] in q's dtype; finite where a query sees no key.
    """
    reason = fallback_reason(q_bthd, q_offset)
    if reason is not None:
        raise ValueError(reason)
    batch, _, heads, _ = q_bthd.shape
    kv_heads = k_bskd.shape[2]
    if heads % kv_heads:
        raise ValueError(f"heads={heads} is not a multiple of kv_heads={kv_heads}")
    segments = (q_segment_ids_bt.astype(jnp.int32), kv_segment_ids_bs.astype(jnp.int32))
    if isinstance(q_offset, int):
        local = functools.partial(_causal, q_offset=q_offset, interpret=interpret)
        args = (q_bthd, k_bskd, v_bskd, *segments)
    else:
        several = _at_traced_slots if q_bthd.shape[1] > 1 else _decode
        local = functools.partial(several, interpret=interpret)
        q_slot_b = jnp.broadcast_to(jnp.asarray(q_offset, jnp.int32), (batch,))
        args = (q_bthd, k_bskd, v_bskd, *segments, q_slot_b)
    if q_bthd.dtype == jnp.bfloat16:
        local = _at_default_precision(local)
    return _on_each_device(local, len(args), batch, (heads, kv_heads), batch_axes,
                           head_axes)(*args)


def _causal(q_bthd, k_bskd, v_bskd, q_seg_bt, kv_seg_bs, *, q_offset: int, interpret: bool):
    """Splash with a causal mask from the static slot `q_offset`, on one device's operands
    (shapes as `attention`'s); differentiable in q, k, v."""
    q_len, k_len = q_bthd.shape[1], k_bskd.shape[1]
    # Whole blocks of 128 on both sides: the backward's key-major pass tiles queries too.
    q_pad, k_pad = _round_up(q_len, _LANES), _round_up(k_len, _LANES)
    kernel = _kernel(q_bthd.shape[2], q_pad, k_pad, q_offset, _block(q_pad), _block(k_pad),
                     causal=True, interpret=interpret)
    q_bhtd = _heads_major(_pad(_scaled(q_bthd), 1, q_pad))
    k_bksd = _heads_major(_pad(k_bskd.astype(q_bthd.dtype), 1, k_pad))
    v_bksd = _heads_major(_pad(v_bskd.astype(q_bthd.dtype), 1, k_pad))
    segments = splash.SegmentIds(_pad(q_seg_bt, 1, q_pad), _pad(kv_seg_bs, 1, k_pad))
    out_bhtd = jax.vmap(kernel)(q_bhtd, k_bksd, v_bksd, segments)
    return jnp.swapaxes(out_bhtd, 1, 2)[:, :q_len]


def _decode(q_b1hd, k_bskd, v_bskd, q_seg_b1, kv_seg_bs, q_slot_b, *, interpret: bool):
    """One query per row at its slot `q_slot_b` (int [b]), on one device's operands (shapes as
    `attention`'s): causality folded into the keys' segment ids, each GQA group of query heads
    stacked as the kernel's query sequence of its kv head. Forward only."""
    batch, _, heads, head_dim = q_b1hd.shape
    k_len, kv_heads = k_bskd.shape[1], k_bskd.shape[2]
    groups = heads // kv_heads
    g_pad, k_pad = _round_up(groups, _SUBLANES), _round_up(k_len, _LANES)
    kernel = _kernel(kv_heads, g_pad, k_pad, 0, g_pad, _block(k_pad, largest=1024),
                     causal=False, interpret=interpret)
    # Query row r of kv head k is query head k * groups + r: a reshape, the token axis being 1.
    q_bkgd = _pad(_scaled(q_b1hd).reshape(batch, kv_heads, groups, head_dim), 2, g_pad)
    k_bksd = _heads_major(_pad(k_bskd.astype(q_b1hd.dtype), 1, k_pad))
    v_bksd = _heads_major(_pad(v_bskd.astype(q_b1hd.dtype), 1, k_pad))
    seen_bs = jnp.arange(k_len)[None, :] <= q_slot_b[:, None]
    kv_seg_bs = _pad(jnp.where(seen_bs, kv_seg_bs, 0), 1, k_pad)
    q_seg_bg = _pad(jnp.broadcast_to(q_seg_b1, (batch, groups)), 1, g_pad)
    out_bkgd = jax.vmap(kernel)(q_bkgd, k_bksd, v_bksd, splash.SegmentIds(q_seg_bg, kv_seg_bs))
    return out_bkgd[:, :, :groups].reshape(batch, 1, heads, head_dim)


def _at_traced_slots(q_bthd, k_bskd, v_bskd, q_seg_bt, kv_seg_bs, q_slot_b, *,
                     interpret: bool):
    """Several queries per row from slot `q_slot_b` (int [b], traced), on one device's
    operands (shapes as `attention`'s): each row's queries and their segment ids written at
    their slots of k_len + q_len zero (segment 0) query slots, splash's causal mask of offset
    0 over those, and the outputs read back from the same slots. A slot past the cache is
    clamped by both the write and the read to k_len or later, where every key is visible, as
    for the slot itself."""
    q_len = q_bthd.shape[1]
    slots = k_bskd.shape[1] + q_len

    def place(x_bt, at_b):
        put = lambda x_t, at: jax.lax.dynamic_update_slice_in_dim(
            jnp.zeros((slots,) + x_t.shape[1:], x_t.dtype), x_t, at, axis=0)
        return jax.vmap(put)(x_bt, at_b)

    out_bthd = _causal(place(q_bthd, q_slot_b), k_bskd, v_bskd, place(q_seg_bt, q_slot_b),
                       kv_seg_bs, q_offset=0, interpret=interpret)
    take = lambda x_td, at: jax.lax.dynamic_slice_in_dim(x_td, at, q_len, axis=0)
    return jax.vmap(take)(out_bthd, q_slot_b)


def _at_default_precision(fn):
    """`fn` of arrays, forward and backward traced at DEFAULT matmul precision.

    Why: splash leaves its products' precision to `jax_default_matmul_precision`, and Mosaic
    rejects bfloat16 operands at fp32 contract precision ('highest', as the test suite sets
    it); products of bfloat16 operands are the same at every precision (exact in fp32). The
    backward is traced when a gradient is taken, after the forward's trace has left any
    context, so a custom_vjp enters it again there.
    """
    default = lambda: jax.default_matmul_precision("default")

    @jax.custom_vjp
    def run(*args):
        with default():
            return fn(*args)

    def forward(*args):
        with default():
            return jax.vjp(fn, *args)  # the backward's function is a pytree: the residuals

    def backward(fn_vjp, d_out):
        with default():
            return fn_vjp(d_out)

    run.defvjp(forward, backward)
    return run


def _kernel(heads: int, q_len: int, k_len: int, q_offset: int, block_q: int, block_k: int, *,
            causal: bool, interpret: bool):
    """Splash over one row: q [heads, q_len, d], k and v [kv_heads, k_len, d] (any kv_heads
    dividing `heads`). Built per trace: its block masks become constants of the program being
    traced (a kernel kept across traces would carry one trace's values into the next), and
    splash caches the numpy work behind them per mask and block shape. With `causal`, the
    backward's blocks are set too (a decode kernel is never differentiated)."""
    if causal:
        mask = splash.CausalMask((q_len, k_len), offset=q_offset)
        backward = dict(block_q_dkv=block_q, block_kv_dkv=block_k, block_kv_dkv_compute=block_k,
                        block_q_dq=block_q, block_kv_dq=block_k)
    else:
        mask, backward = splash.FullMask((q_len, k_len)), {}
    blocks = splash.BlockSizes(block_q=block_q, block_kv=block_k, block_kv_compute=block_k,
                               **backward)
    return splash.make_splash_mha(splash.MultiHeadMask([mask] * heads), block_sizes=blocks,
                                  head_shards=1, q_seq_shards=1, interpret=interpret)


def _block(length: int, largest: int = 512) -> int:
    """The largest power-of-two block of at least 128 and at most `largest` that divides
    `length` (a multiple of 128)."""
    block = largest
    while length % block:
        block //= 2
    return block


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _pad(x: jax.Array, axis: int, length: int) -> jax.Array:
    """`x` zero-padded at the end of `axis` to `length` (segment id 0: padding)."""
    if x.shape[axis] == length:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, length - x.shape[axis])
    return jnp.pad(x, widths)


def _scaled(q_bthd: jax.Array) -> jax.Array:
    """The queries times 1/sqrt(head_dim), in fp32, back in their dtype (splash does not
    scale the scores)."""
    scale = 1.0 / math.sqrt(q_bthd.shape[-1])
    return (q_bthd.astype(jnp.float32) * scale).astype(q_bthd.dtype)


def _heads_major(x_bthd: jax.Array) -> jax.Array:
    """[b, t, h, d] -> [b, h, t, d]: splash reads one head's sequence as a [t, d] matrix."""
    return jnp.swapaxes(x_bthd, 1, 2)


def _on_each_device(fn, num_args: int, batch: int, head_counts: tuple[int, ...],
                    batch_axes: tuple[str, ...] | None, head_axes: tuple[str, ...]):
    """`fn` of (q_bthd, k_bskd, v_bskd, q_seg_bt, kv_seg_bs[, q_slot_b]) run by each device on
    its own rows and heads (`jax.shard_map` over every free axis of the mesh in scope); `fn`
    itself where no free axis splits (no mesh, one device, or all manual already)."""
    mesh = jax.sharding.get_abstract_mesh()
    free = () if mesh.empty else tuple(a for a in mesh.axis_names if a not in mesh.manual_axes)
    if all(mesh.shape[a] == 1 for a in free):
        return fn
    if batch_axes is None:
        batch_axes = tuple(a for a in free if a not in head_axes)
    row_axes = _dividing(mesh, free, batch_axes, (batch,))
    head_axes = _dividing(mesh, free, tuple(a for a in head_axes if a not in row_axes),
                          head_counts)
    rows = row_axes or None
    heads = head_axes or None
    specs = (PartitionSpec(rows, None, heads, None),) * 3 + (PartitionSpec(rows, None),) * 2
    specs += (PartitionSpec(rows),) * (num_args - len(specs))
    # check_vma off: a pallas_call's outputs carry no varying-axes type to check.
    return jax.shard_map(fn, in_specs=specs, out_specs=specs[0], axis_names=set(free),
                         check_vma=False)


def _dividing(mesh, free: tuple[str, ...], axes: tuple[str, ...], sizes: tuple[int, ...]
              ) -> tuple[str, ...]:
    """The longest prefix of `axes` (those free, of size > 1) whose product divides every one
    of `sizes`: how far a dimension of those sizes can be split."""
    axes = tuple(a for a in axes if a in free and mesh.shape[a] > 1)
    while axes and any(n % math.prod(mesh.shape[a] for a in axes) for n in sizes):
        axes = axes[:-1]
    return axes
