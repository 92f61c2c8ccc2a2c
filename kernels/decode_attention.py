"""Decode attention in Pallas: a few new queries per row against a KV cache, ragged lengths.

Decode is bound by reading the cache, so the kernel reads only each row's valid prefix: one
program per (row, kv head) loops over key blocks [0, ceil(min(kv_len, last query slot + 1) /
block_k)) and never loads the blocks beyond. The per-row bounds `q_start_b` and
`kv_lengths_b` are int32 [batch] operands read as scalars inside the kernel (on TPU they
would be scalar-prefetched into SMEM; the loop bound is data-dependent either way).

All query heads of one kv head (the GQA group) and all new tokens are stacked into the
matmul's M dimension ([q_len * groups, head_dim], padded to a power of two >= 16 for GPU
matmuls), so K and V are read once per group.

The cache length need not be a multiple of `block_k` (nor a power of two, which Triton's blocks
must be): the last block is loaded shifted back to end at the cache's end, and the slots it
shares with the previous block are masked. The
kernel is forward-only (decode is never differentiated). Semantics are those of
`kernels.reference.reference_attention`.
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
class DecodeConfig:
    """Static kernel settings (hashable)."""

    block_k: int = 256
    interpret: bool = False  # Pallas interpret mode: runs on CPU, for tests


def _kernel(qstart_ref, kvlen_ref, q_ref, k_ref, v_ref, qseg_ref, kseg_ref, o_ref, *,
            block_k, groups, q_len, scale):
    cache_len = k_ref.shape[0]
    q = q_ref[...]  # [n >= q_len * groups, d]
    q_seg = qseg_ref[...]  # [n]
    q_start = qstart_ref[0]
    q_slot = q_start + jnp.arange(q.shape[0]) // groups
    kv_len = jnp.minimum(kvlen_ref[0], cache_len)
    # Keys past the prefix or after the last query's slot are never visible: skip their blocks.
    end = jnp.minimum(kv_len, q_start + q_len)
    n_blocks = (jnp.maximum(end, 0) + block_k - 1) // block_k

    def body(j, carry):
        # The last block may overhang the cache: load it shifted back, mask the repeats.
        start = jnp.minimum(j * block_k, cache_len - block_k)
        ks = pl.ds(start, block_k)
        k, v, k_seg = k_ref[ks, :], v_ref[ks, :], kseg_ref[ks]
        k_slot = start + jnp.arange(block_k)
        vis = ((k_slot[None, :] <= q_slot[:, None]) & (k_slot[None, :] < kv_len)
               & (k_slot[None, :] >= j * block_k)
               & (q_seg[:, None] == k_seg[None, :]) & (k_seg[None, :] != 0))
        return online_softmax_step(carry, q, k, v, vis, scale)

    carry = jax.lax.fori_loop(0, n_blocks, body, online_softmax_init(q))
    o_ref[...] = online_softmax_output(carry).astype(o_ref.dtype)


def online_softmax_init(q_nd):
    """(running max, running sum, fp32 accumulator) before any key block, for q [n, d]."""
    n = q_nd.shape[0]
    return (jnp.full((n,), NEG_INF, jnp.float32), jnp.zeros((n,), jnp.float32),
            jnp.zeros(q_nd.shape, jnp.float32))


def online_softmax_step(carry, q_nd, k_md, v_md, vis_nm, scale):
    """Folds one block of m keys into the running softmax of n stacked queries (in-kernel).

    Scores and sums in fp32; the unnormalised probabilities are rounded to v's dtype for the
    second matmul (as the reference rounds its probabilities). Invisible keys add nothing.
    """
    m, l, acc = carry
    s = jax.lax.dot_general(q_nd, k_md, (((1,), (1,)), ((), ())),
                            preferred_element_type=jnp.float32) * scale
    s = jnp.where(vis_nm, s, NEG_INF)
    m_new = jnp.maximum(m, s.max(axis=1))
    alpha = jnp.exp(m - m_new)
    p = jnp.where(vis_nm, jnp.exp(s - m_new[:, None]), 0.0)
    l = alpha * l + p.sum(axis=1)
    acc = alpha[:, None] * acc + jax.lax.dot_general(
        p.astype(v_md.dtype), v_md, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)
    return m_new, l, acc


def online_softmax_output(carry):
    """fp32 [n, d] attention output; zeros for a query that saw no key (its sum is 0)."""
    _, l, acc = carry
    return acc / jnp.where(l > 0, l, 1.0)[:, None]


def stack_query_groups(q_bthd: jax.Array, kv_heads: int) -> tuple[jax.Array, int]:
    """[b, t, k*g, d] -> ([b, k, n_pad, d], n = t*g): a kv head's whole group of queries (all
    new tokens) as the M dimension of one matmul, zero-padded to n_pad = a power of two >= 16
    (GPU matmuls need M >= 16). Row r of a block is query t = r // g, head k*g + r % g."""
    batch, q_len, heads, head_dim = q_bthd.shape
    groups = heads // kv_heads
    n = q_len * groups
    n_pad = max(16, pl.next_power_of_2(n))
    q_bknd = q_bthd.reshape(batch, q_len, kv_heads, groups, head_dim).transpose(0, 2, 1, 3, 4)
    q_bknd = jnp.pad(q_bknd.reshape(batch, kv_heads, n, head_dim),
                     ((0, 0), (0, 0), (0, n_pad - n), (0, 0)))
    return q_bknd, n


def unstack_query_groups(out_bknd: jax.Array, q_len: int, heads: int) -> jax.Array:
    """The inverse of `stack_query_groups`: [b, k, n_pad, d] -> [b, t, heads, d]."""
    batch, kv_heads, _, head_dim = out_bknd.shape
    groups = heads // kv_heads
    out_bknd = out_bknd[:, :, :q_len * groups]
    out_btkgd = out_bknd.reshape(batch, kv_heads, q_len, groups, head_dim).transpose(0, 2, 1, 3, 4)
    return out_btkgd.reshape(batch, q_len, heads, head_dim)


# Under jit the kernel is one pjit equation, which dead-code elimination drops when its output
# is unused; a bare pallas_call never is (Pallas keeps every one, in case it writes in place).
# flax >= 0.12.10's nn.scan traces the layer body and rejects one whose kept equations read the
# carry ("broadcasted variable has a data dependency on the scan body"): the scanned decoder's
# decode step failed there.
@functools.partial(jax.jit, static_argnames="cfg")
def decode_attention(
    q_bthd: jax.Array,
    k_bskd: jax.Array,
    v_bskd: jax.Array,
    q_segment_ids_bt: jax.Array,
    kv_segment_ids_bs: jax.Array,
    q_start_b: jax.Array,
    kv_lengths_b: jax.Array,
    cfg: DecodeConfig = DecodeConfig(),
) -> jax.Array:
    """Attention of a few new tokens per row over the valid prefix of a KV cache.

    Args:
      q_bthd: [batch, q_len, heads, head_dim] new queries (q_len is small: 1 when decoding).
      k_bskd, v_bskd: [batch, cache_len, kv_heads, head_dim] the cache, new keys written.
      q_segment_ids_bt: int [batch, q_len]; kv_segment_ids_bs: int [batch, cache_len]; 0 = pad.
      q_start_b: int [batch] cache slot of each row's query 0 (traced is fine).
      kv_lengths_b: int [batch] valid prefix per row; slots at or past it are never read.
      cfg: block size and interpret mode.

    Returns:
      [batch, q_len, heads, head_dim] in q's dtype; zeros for queries that see no key.
    """
    batch, q_len, heads, head_dim = q_bthd.shape
    cache_len, kv_heads = k_bskd.shape[1], k_bskd.shape[2]
    if heads % kv_heads:
        raise ValueError(f"heads={heads} is not a multiple of kv_heads={kv_heads}")
    groups = heads // kv_heads
    if cache_len < 16:  # GPU matmuls need K >= 16: pad with segment 0 slots, never visible
        pad = lambda x: jnp.pad(x, [(0, 0), (0, 16 - cache_len)] + [(0, 0)] * (x.ndim - 2))
        k_bskd, v_bskd, kv_segment_ids_bs = pad(k_bskd), pad(v_bskd), pad(kv_segment_ids_bs)
        cache_len = 16
    # Triton loads power-of-two blocks: the largest one the cache holds (the last block is
    # shifted back to end at the cache's end, so any cache length works).
    block_k = min(cfg.block_k, 1 << (cache_len.bit_length() - 1))
    q_bknd, n = stack_query_groups(q_bthd, kv_heads)
    n_pad = q_bknd.shape[2]  # the padded rows carry segment 0: they see no key
    q_seg_bn = jnp.repeat(q_segment_ids_bt.astype(jnp.int32), groups, axis=1)
    q_seg_bn = jnp.pad(q_seg_bn, ((0, 0), (0, n_pad - n)))
    sq = pl.squeezed
    q_spec = pl.BlockSpec((sq, sq, n_pad, head_dim), lambda b, h: (b, h, 0, 0))
    kv_spec = pl.BlockSpec((sq, cache_len, sq, head_dim), lambda b, h: (b, 0, h, 0))
    per_row = pl.BlockSpec((1,), lambda b, h: (b,))  # this row's scalar bound
    kernel = functools.partial(_kernel, block_k=block_k, groups=groups, q_len=q_len,
                               scale=1.0 / math.sqrt(head_dim))
    out_bknd = pl.pallas_call(
        kernel,
        grid=(batch, kv_heads),
        in_specs=[per_row, per_row, q_spec, kv_spec, kv_spec,
                  pl.BlockSpec((sq, n_pad), lambda b, h: (b, 0)),
                  pl.BlockSpec((sq, cache_len), lambda b, h: (b, 0))],
        out_specs=q_spec,
        out_shape=jax.ShapeDtypeStruct(q_bknd.shape, q_bthd.dtype),
        interpret=cfg.interpret,
        name="decode_attention",
    )(q_start_b.astype(jnp.int32), kv_lengths_b.astype(jnp.int32), q_bknd,
      k_bskd.astype(q_bthd.dtype), v_bskd.astype(q_bthd.dtype), q_seg_bn,
      kv_segment_ids_bs.astype(jnp.int32))
    return unstack_query_groups(out_bknd, q_len, heads)
