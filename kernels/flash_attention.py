"""Flash attention in Pallas for prefill and training: causal, segment ids, GQA, fwd + bwd.

Forward (FlashAttention-2 style): one program per (row, query head, query block) streams the
key/value blocks with an online softmax in fp32 and stores the output and the per-query
log-sum-exp. Under the causal mask, key blocks after the query block's last slot are never
loaded (the loop bound depends on the query block).

Backward: two Pallas kernels recomputing the probabilities blockwise from the saved
log-sum-exp (nothing of size [q_len, k_len] is stored):
  * dQ: one program per (row, query head, query block), looping over visible key blocks;
  * dK/dV: one program per (row, query head, key block), looping over the query blocks that
    can see it; per-query-head partials are summed over each GQA group outside the kernel
    (costs heads/kv_heads times the dK/dV memory, avoids atomics).

Lengths that are not a multiple of the block sizes are padded with segment id 0 (padding
never attends nor is attended), head_dim with zeros to a power of two (as Triton blocks need),
and the output is sliced back. Semantics are those of
`kernels.reference.reference_attention` with `kv_lengths_b` = k_len and a static `q_offset`.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from jaxrlhf.kernels.reference import NEG_INF


@dataclasses.dataclass(frozen=True)
class FlashConfig:
    """Static kernel settings (hashable; a jit static argument)."""

    block_q: int = 128
    block_k: int = 128
    q_offset: int = 0  # slot of query 0 (prefill against a cache starts at 0)
    interpret: bool = False  # Pallas interpret mode: runs on CPU, for tests
    scale: float = 0.0  # softmax scale; 0 = 1/sqrt(head_dim) (set before head_dim padding)


def _dot_nt(a, b):
    """a [m, d] @ b[n, d]^T -> [m, n] in fp32."""
    return jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)


def _dot_nn(a, b):
    """a [m, n] @ b [n, d] -> [m, d] in fp32."""
    return jax.lax.dot_general(a, b, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)


def _dot_tn(a, b):
    """a [n, m]^T @ b [n, d] -> [m, d] in fp32."""
    return jax.lax.dot_general(a, b, (((0,), (0,)), ((), ())), preferred_element_type=jnp.float32)


def _visible(q_slot, q_seg, k_slot, k_seg):
    """[bq, bk] mask from [bq] and [bk] slots/segments."""
    return ((k_slot[None, :] <= q_slot[:, None]) & (q_seg[:, None] == k_seg[None, :])
            & (k_seg[None, :] != 0))


def _num_visible_k_blocks(q_block, cfg: FlashConfig, num_k_blocks):
    """Key blocks [0, n) hold every key a causal query block can see."""
    last_q_slot = cfg.q_offset + (q_block + 1) * cfg.block_q - 1
    return jnp.minimum(last_q_slot // cfg.block_k + 1, num_k_blocks)


def _fwd_kernel(q_ref, k_ref, v_ref, qseg_ref, kseg_ref, o_ref, lse_ref, *, cfg, scale):
    bq, bk = cfg.block_q, cfg.block_k
    qi = pl.program_id(2)
    q = q_ref[...]
    q_seg = qseg_ref[...]
    q_slot = cfg.q_offset + qi * bq + jnp.arange(bq)

    def body(j, carry):
        m, l, acc = carry
        ks = pl.ds(j * bk, bk)
        k, v, k_seg = k_ref[ks, :], v_ref[ks, :], kseg_ref[ks]
        vis = _visible(q_slot, q_seg, j * bk + jnp.arange(bk), k_seg)
        s = jnp.where(vis, _dot_nt(q, k) * scale, NEG_INF)
        m_new = jnp.maximum(m, s.max(axis=1))
        alpha = jnp.exp(m - m_new)
        p = jnp.where(vis, jnp.exp(s - m_new[:, None]), 0.0)
        l = alpha * l + p.sum(axis=1)
        acc = alpha[:, None] * acc + _dot_nn(p.astype(v.dtype), v)
        return m_new, l, acc

    init = (jnp.full((bq,), NEG_INF, jnp.float32), jnp.zeros((bq,), jnp.float32),
            jnp.zeros(q.shape, jnp.float32))
    n_k = _num_visible_k_blocks(qi, cfg, k_ref.shape[0] // bk)
    m, l, acc = jax.lax.fori_loop(0, n_k, body, init)
    seen = l > 0  # a query with no visible key (padding) outputs 0
    o_ref[...] = (acc / jnp.where(seen, l, 1.0)[:, None]).astype(o_ref.dtype)
    lse_ref[...] = jnp.where(seen, m + jnp.log(jnp.where(seen, l, 1.0)), 0.0)


def _specs(batch, heads, kv_heads, q_len, k_len, head_dim, cfg: FlashConfig, over_k: bool):
    """Block specs for grid (batch, heads, q blocks) or, with over_k, (batch, heads, k blocks)."""
    groups = heads // kv_heads
    sq = pl.squeezed
    if over_k:  # whole query sequence, one key block
        q_spec = pl.BlockSpec((sq, q_len, sq, head_dim), lambda b, h, j: (b, 0, h, 0))
        k_spec = pl.BlockSpec((sq, cfg.block_k, sq, head_dim),
                              lambda b, h, j: (b, j, h // groups, 0))
        row_q = pl.BlockSpec((sq, sq, q_len), lambda b, h, j: (b, h, 0))
        qseg = pl.BlockSpec((sq, q_len), lambda b, h, j: (b, 0))
        kseg = pl.BlockSpec((sq, cfg.block_k), lambda b, h, j: (b, j))
    else:  # one query block, whole key sequence
        q_spec = pl.BlockSpec((sq, cfg.block_q, sq, head_dim), lambda b, h, i: (b, i, h, 0))
        k_spec = pl.BlockSpec((sq, k_len, sq, head_dim), lambda b, h, i: (b, 0, h // groups, 0))
        row_q = pl.BlockSpec((sq, sq, cfg.block_q), lambda b, h, i: (b, h, i))
        qseg = pl.BlockSpec((sq, cfg.block_q), lambda b, h, i: (b, i))
        kseg = pl.BlockSpec((sq, k_len), lambda b, h, i: (b, 0))
    return q_spec, k_spec, row_q, qseg, kseg


def _fwd(q, k, v, qseg, kseg, cfg: FlashConfig):
    batch, q_len, heads, head_dim = q.shape
    k_len, kv_heads = k.shape[1], k.shape[2]
    q_spec, k_spec, row_q, qseg_spec, kseg_spec = _specs(
        batch, heads, kv_heads, q_len, k_len, head_dim, cfg, over_k=False)
    kernel = functools.partial(_fwd_kernel, cfg=cfg, scale=cfg.scale)
    out, lse = pl.pallas_call(
        kernel,
        grid=(batch, heads, q_len // cfg.block_q),
        in_specs=[q_spec, k_spec, k_spec, qseg_spec, kseg_spec],
        out_specs=[q_spec, row_q],
        out_shape=[jax.ShapeDtypeStruct(q.shape, q.dtype),
                   jax.ShapeDtypeStruct((batch, heads, q_len), jnp.float32)],
        interpret=cfg.interpret,
        name="flash_attention_fwd",
    )(q, k, v, qseg, kseg)
    return out, lse


def _dq_kernel(q_ref, k_ref, v_ref, qseg_ref, kseg_ref, do_ref, lse_ref, delta_ref, dq_ref, *,
               cfg, scale):
    bq, bk = cfg.block_q, cfg.block_k
    qi = pl.program_id(2)
    q, do = q_ref[...], do_ref[...]
    lse, delta, q_seg = lse_ref[...], delta_ref[...], qseg_ref[...]
    q_slot = cfg.q_offset + qi * bq + jnp.arange(bq)

    def body(j, dq):
        ks = pl.ds(j * bk, bk)
        k, v, k_seg = k_ref[ks, :], v_ref[ks, :], kseg_ref[ks]
        vis = _visible(q_slot, q_seg, j * bk + jnp.arange(bk), k_seg)
        p = jnp.where(vis, jnp.exp(_dot_nt(q, k) * scale - lse[:, None]), 0.0)
        ds = p * (_dot_nt(do, v) - delta[:, None])
        return dq + _dot_nn(ds.astype(k.dtype), k)

    n_k = _num_visible_k_blocks(qi, cfg, k_ref.shape[0] // bk)
    dq = jax.lax.fori_loop(0, n_k, body, jnp.zeros(q.shape, jnp.float32))
    dq_ref[...] = (dq * scale).astype(dq_ref.dtype)


def _dkv_kernel(q_ref, k_ref, v_ref, qseg_ref, kseg_ref, do_ref, lse_ref, delta_ref, dk_ref,
                dv_ref, *, cfg, scale):
    bq, bk = cfg.block_q, cfg.block_k
    kj = pl.program_id(2)
    k, v, k_seg = k_ref[...], v_ref[...], kseg_ref[...]
    k_slot = kj * bk + jnp.arange(bk)

    def body(i, carry):
        dk, dv = carry
        qs = pl.ds(i * bq, bq)
        q, do, q_seg = q_ref[qs, :], do_ref[qs, :], qseg_ref[qs]
        lse, delta = lse_ref[qs], delta_ref[qs]
        vis = _visible(cfg.q_offset + i * bq + jnp.arange(bq), q_seg, k_slot, k_seg)
        p = jnp.where(vis, jnp.exp(_dot_nt(q, k) * scale - lse[:, None]), 0.0)  # [bq, bk]
        dv = dv + _dot_tn(p.astype(do.dtype), do)
        ds = p * (_dot_nt(do, v) - delta[:, None])
        return dk + _dot_tn(ds.astype(q.dtype), q), dv

    # Causal: query blocks ending before this key block's first slot see none of it.
    first_q = jnp.maximum(kj * bk - cfg.q_offset, 0) // bq
    zeros = jnp.zeros(k.shape, jnp.float32)
    dk, dv = jax.lax.fori_loop(first_q, q_ref.shape[0] // bq, body, (zeros, zeros))
    dk_ref[...] = (dk * scale).astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)


def _bwd(q, k, v, qseg, kseg, out, lse, do, cfg: FlashConfig):
    batch, q_len, heads, head_dim = q.shape
    k_len, kv_heads = k.shape[1], k.shape[2]
    scale = cfg.scale
    # delta = rowsum(dO * O): the softmax-Jacobian term, [batch, heads, q_len] fp32.
    delta = jnp.einsum("bthd,bthd->bht", do.astype(jnp.float32), out.astype(jnp.float32))
    args = (q, k, v, qseg, kseg, do, lse, delta)

    q_spec, k_spec, row_q, qseg_spec, kseg_spec = _specs(
        batch, heads, kv_heads, q_len, k_len, head_dim, cfg, over_k=False)
    dq = pl.pallas_call(
        functools.partial(_dq_kernel, cfg=cfg, scale=scale),
        grid=(batch, heads, q_len // cfg.block_q),
        in_specs=[q_spec, k_spec, k_spec, qseg_spec, kseg_spec, q_spec, row_q, row_q],
        out_specs=q_spec,
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        interpret=cfg.interpret,
        name="flash_attention_dq",
    )(*args)

    q_spec, k_spec, row_q, qseg_spec, kseg_spec = _specs(
        batch, heads, kv_heads, q_len, k_len, head_dim, cfg, over_k=True)
    # dK/dV per query head: [batch, k_len, heads, head_dim], block over the head axis.
    kh_spec = pl.BlockSpec((pl.squeezed, cfg.block_k, pl.squeezed, head_dim),
                           lambda b, h, j: (b, j, h, 0))
    dk_h, dv_h = pl.pallas_call(
        functools.partial(_dkv_kernel, cfg=cfg, scale=scale),
        grid=(batch, heads, k_len // cfg.block_k),
        in_specs=[q_spec, k_spec, k_spec, qseg_spec, kseg_spec, q_spec, row_q, row_q],
        out_specs=[kh_spec, kh_spec],
        out_shape=[jax.ShapeDtypeStruct((batch, k_len, heads, head_dim), jnp.float32)] * 2,
        interpret=cfg.interpret,
        name="flash_attention_dkv",
    )(*args)
    groups = heads // kv_heads
    sum_groups = lambda x: x.reshape(batch, k_len, kv_heads, groups, head_dim).sum(3)
    return dq, sum_groups(dk_h).astype(k.dtype), sum_groups(dv_h).astype(v.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _flash(q, k, v, qseg, kseg, cfg):
    return _fwd(q, k, v, qseg, kseg, cfg)[0]


def _flash_fwd(q, k, v, qseg, kseg, cfg):
    out, lse = _fwd(q, k, v, qseg, kseg, cfg)
    return out, (q, k, v, qseg, kseg, out, lse)


def _flash_bwd(cfg, residuals, do):
    q, k, v, qseg, kseg, out, lse = residuals
    dq, dk, dv = _bwd(q, k, v, qseg, kseg, out, lse, do, cfg)
    return dq, dk, dv, None, None  # integer segment ids take no cotangent


_flash.defvjp(_flash_fwd, _flash_bwd)


def _pad_to(x, axis, multiple):
    extra = -x.shape[axis] % multiple
    if not extra:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, extra)
    return jnp.pad(x, widths)  # zeros: segment id 0 marks the padding


def flash_attention(
    q_bthd: jax.Array,
    k_bskd: jax.Array,
    v_bskd: jax.Array,
    q_segment_ids_bt: jax.Array,
    kv_segment_ids_bs: jax.Array,
    cfg: FlashConfig = FlashConfig(),
) -> jax.Array:
    """Causal segment-masked GQA attention, differentiable in q, k, v.

    Args:
      q_bthd: [batch, q_len, heads, head_dim].
      k_bskd, v_bskd: [batch, k_len, kv_heads, head_dim]; heads % kv_heads == 0.
      q_segment_ids_bt: int [batch, q_len]; kv_segment_ids_bs: int [batch, k_len]; 0 = pad.
      cfg: block sizes, the static slot of query 0, interpret mode.

    Returns:
      [batch, q_len, heads, head_dim] in q's dtype; zeros for queries that see no key.
    """
    heads, kv_heads = q_bthd.shape[2], k_bskd.shape[2]
    if heads % kv_heads:
        raise ValueError(f"heads={heads} is not a multiple of kv_heads={kv_heads}")
    if cfg.q_offset < 0:
        raise ValueError(f"q_offset={cfg.q_offset} must be >= 0")
    q_len, head_dim = q_bthd.shape[1], q_bthd.shape[3]
    cfg = dataclasses.replace(cfg, scale=cfg.scale or 1.0 / math.sqrt(head_dim))
    # GPU (Triton) blocks need a power-of-two head_dim: zero columns change no dot product.
    pad_d = lambda x: _pad_to(x, 3, pl.next_power_of_2(head_dim))
    q_bthd, k_bskd, v_bskd = pad_d(q_bthd), pad_d(k_bskd), pad_d(v_bskd)
    q = _pad_to(q_bthd, 1, cfg.block_q)
    qseg = _pad_to(q_segment_ids_bt.astype(jnp.int32), 1, cfg.block_q)
    k, v = _pad_to(k_bskd, 1, cfg.block_k), _pad_to(v_bskd, 1, cfg.block_k)
    kseg = _pad_to(kv_segment_ids_bs.astype(jnp.int32), 1, cfg.block_k)
    return _flash(q, k.astype(q.dtype), v.astype(q.dtype), qseg, kseg, cfg)[:, :q_len, :, :head_dim]
