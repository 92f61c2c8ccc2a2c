"""Paged decode attention in Pallas: a few new queries per row against a paged KV cache.

The cache is a pool of fixed-size pages shared by all rows, `[num_pages, page_size, kv_heads,
head_dim]`, and each row owns a page table, int32 `[batch, pages_per_row]`: the row's slot s
lives in page `page_table_bp[b, s // page_size]` at offset `s % page_size`. Rows may share
pages (a GRPO group's prompt prefilled once and read by its n samples) and a row's pages need
not be contiguous or ordered, so a rollout engine allocates and frees cache by the page
instead of reserving the longest row's length for every slot.

Like `kernels.decode_attention`, decode is bound by reading the cache, so one program per
(row, kv head) loops over only the row's live pages, [0, ceil(min(kv_len, last query slot +
1) / page_size)), reading each page's id from the table as a scalar; table entries past them
are never read (they may hold anything) and neither are the pages they name. The GQA group
and the new tokens are stacked into the matmul's M dimension as there.

Semantics (those of `kernels.reference.paged_reference_attention`): query t of row b sits at
slot `q_start_b[b] + t` and sees slot s iff s <= its slot and s < `kv_lengths_b[b]`; every
slot of the prefix is a real token (a paged cache has no padding: a row starts at slot 0). A
query that sees no key (a row of length 0: a free slot) returns zeros.

Compiled for a GPU (the Triton lowering), a page is one load of [page_size, head_dim], so both
must be powers of two and page_size >= 16 (the matmuls' K); interpret mode takes any size. The
pool is one operand here, which a GPU reads through pointers; a TPU kernel would instead
scalar-prefetch the table and copy the live pages into VMEM block by block (the pool does not
fit there). Forward only: decode is never differentiated.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from jaxrlhf.kernels.decode_attention import (online_softmax_init, online_softmax_output,
                                      online_softmax_step, stack_query_groups,
                                      unstack_query_groups)


@dataclasses.dataclass(frozen=True)
class PagedDecodeConfig:
    """Static kernel settings (hashable; a jit static argument)."""

    interpret: bool = False  # Pallas interpret mode: runs on CPU, for tests


def _kernel(qstart_ref, kvlen_ref, table_ref, q_ref, k_ref, v_ref, o_ref, *, groups, q_len,
            scale):
    page_size = k_ref.shape[1]
    q = q_ref[...]  # [n >= q_len * groups, d]
    row = jnp.arange(q.shape[0])
    q_start = qstart_ref[0]
    q_slot = q_start + row // groups
    q_real = row < q_len * groups  # the stacked rows past them pad M: they see no key
    kv_len = jnp.minimum(kvlen_ref[0], table_ref.shape[0] * page_size)
    # Keys past the prefix or after the last query's slot are never visible: skip their pages.
    end = jnp.minimum(kv_len, q_start + q_len)
    n_pages = (jnp.maximum(end, 0) + page_size - 1) // page_size

    def body(j, carry):
        page = table_ref[j]
        k, v = k_ref[page], v_ref[page]  # [page_size, d] each
        k_slot = j * page_size + jnp.arange(page_size)
        vis = ((k_slot[None, :] <= q_slot[:, None]) & (k_slot[None, :] < kv_len)
               & q_real[:, None])
        return online_softmax_step(carry, q, k, v, vis, scale)

    carry = jax.lax.fori_loop(0, n_pages, body, online_softmax_init(q))
    o_ref[...] = online_softmax_output(carry).astype(o_ref.dtype)


def _check_shapes(page_size: int, head_dim: int, interpret: bool) -> None:
    """Compiled (Triton) loads are [page_size, head_dim] blocks: powers of two, K >= 16."""
    if interpret:
        return
    for name, size, least in (("page_size", page_size, 16), ("head_dim", head_dim, 1)):
        if size < least or size & (size - 1):
            raise ValueError(f"paged_decode_attention compiled for a GPU needs {name} a power "
                             f"of two >= {least}, got {size} (interpret mode takes any)")


# A jit boundary, as decode_attention has, so that an unused call is dead code to JAX.
@functools.partial(jax.jit, static_argnames="cfg")
def paged_decode_attention(
    q_bthd: jax.Array,
    k_pages_nskd: jax.Array,
    v_pages_nskd: jax.Array,
    page_table_bp: jax.Array,
    q_start_b: jax.Array,
    kv_lengths_b: jax.Array,
    cfg: PagedDecodeConfig = PagedDecodeConfig(),
) -> jax.Array:
    """Attention of a few new tokens per row over the live pages of a paged KV cache.

    Args:
      q_bthd: [batch, q_len, heads, head_dim] new queries (q_len is small: 1 when decoding).
      k_pages_nskd, v_pages_nskd: [num_pages, page_size, kv_heads, head_dim] the page pool,
        new keys written; heads must be a multiple of kv_heads. Keep it in q's dtype: another
        dtype is converted whole, every call.
      page_table_bp: int [batch, pages_per_row] page ids of each row's slots, in slot order;
        the entries covering slots [0, kv_len) must be valid ids, the rest are never read.
      q_start_b: int [batch] slot of each row's query 0 (traced is fine).
      kv_lengths_b: int [batch] live slots per row (<= pages_per_row * page_size); slots at
        or past it are never read, nor pages past the one holding its last slot.
      cfg: interpret mode.

    Returns:
      [batch, q_len, heads, head_dim] in q's dtype; zeros for queries that see no key.
    """
    batch, q_len, heads, head_dim = q_bthd.shape
    num_pages, page_size, kv_heads = k_pages_nskd.shape[:3]
    pages_per_row = page_table_bp.shape[1]
    if heads % kv_heads:
        raise ValueError(f"heads={heads} is not a multiple of kv_heads={kv_heads}")
    _check_shapes(page_size, head_dim, cfg.interpret)
    q_bknd, _ = stack_query_groups(q_bthd, kv_heads)
    n_pad = q_bknd.shape[2]
    sq = pl.squeezed
    q_spec = pl.BlockSpec((sq, sq, n_pad, head_dim), lambda b, h: (b, h, 0, 0))
    # The whole pool, one kv head of it: pages are picked inside by the row's table.
    pool_spec = pl.BlockSpec((num_pages, page_size, sq, head_dim), lambda b, h: (0, 0, h, 0))
    per_row = pl.BlockSpec((1,), lambda b, h: (b,))  # this row's scalar bound
    kernel = functools.partial(_kernel, groups=heads // kv_heads, q_len=q_len,
                               scale=1.0 / math.sqrt(head_dim))
    out_bknd = pl.pallas_call(
        kernel,
        grid=(batch, kv_heads),
        in_specs=[per_row, per_row, pl.BlockSpec((sq, pages_per_row), lambda b, h: (b, 0)),
                  q_spec, pool_spec, pool_spec],
        out_specs=q_spec,
        out_shape=jax.ShapeDtypeStruct(q_bknd.shape, q_bthd.dtype),
        interpret=cfg.interpret,
        name="paged_decode_attention",
    )(q_start_b.astype(jnp.int32), kv_lengths_b.astype(jnp.int32),
      page_table_bp.astype(jnp.int32), q_bknd, k_pages_nskd.astype(q_bthd.dtype),
      v_pages_nskd.astype(q_bthd.dtype))
    return unstack_query_groups(out_bknd, q_len, heads)
