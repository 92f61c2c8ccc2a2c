"""Pure-jnp reference for the attention kernels in this package (the numerics they must match).

Semantics shared by every kernel here: query t of row b sits at slot `q_start_b[b] + t`, key s
at slot s. The query sees key s iff s <= its slot (causal), s < `kv_lengths_b[b]` (the valid
prefix of a cache), and both carry the same non-zero segment id (0 = padding). A query that
sees no key returns zeros (the kernels skip it instead of averaging garbage).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

NEG_INF = -1e30  # finite: exp(NEG_INF - m) underflows to 0 without inf - inf = NaN


def visible_bts(q_segment_ids_bt, kv_segment_ids_bs, q_start_b, kv_lengths_b) -> jax.Array:
    """Boolean [batch, q_len, k_len]: which key each query may attend to."""
    q_len, k_len = q_segment_ids_bt.shape[1], kv_segment_ids_bs.shape[1]
    q_slot_bt = q_start_b[:, None] + jnp.arange(q_len)[None, :]
    k_slot_s = jnp.arange(k_len)
    causal = k_slot_s[None, None, :] <= q_slot_bt[:, :, None]
    in_prefix = (k_slot_s[None, :] < kv_lengths_b[:, None])[:, None, :]
    same_seg = q_segment_ids_bt[:, :, None] == kv_segment_ids_bs[:, None, :]
    real = (kv_segment_ids_bs != 0)[:, None, :]
    return causal & in_prefix & same_seg & real


def reference_attention(
    q_bthd: jax.Array,
    k_bskd: jax.Array,
    v_bskd: jax.Array,
    q_segment_ids_bt: jax.Array,
    kv_segment_ids_bs: jax.Array,
    q_start_b: jax.Array | None = None,
    kv_lengths_b: jax.Array | None = None,
) -> jax.Array:
    """softmax(Q K^T / sqrt(d)) V over visible keys, grouped-query, scores in fp32.

    Args:
      q_bthd: [batch, q_len, heads, head_dim].
      k_bskd, v_bskd: [batch, k_len, kv_heads, head_dim]; heads % kv_heads == 0.
      q_segment_ids_bt: int [batch, q_len]; kv_segment_ids_bs: int [batch, k_len].
      q_start_b: int [batch] slot of query 0 per row (default 0).
      kv_lengths_b: int [batch] valid cache prefix per row (default k_len).

    Returns:
      [batch, q_len, heads, head_dim] in q's dtype; zeros where a query sees no key.
    """
    batch, q_len, heads, head_dim = q_bthd.shape
    k_len, kv_heads = k_bskd.shape[1], k_bskd.shape[2]
    if q_start_b is None:
        q_start_b = jnp.zeros((batch,), jnp.int32)
    if kv_lengths_b is None:
        kv_lengths_b = jnp.full((batch,), k_len, jnp.int32)
    vis_b11ts = visible_bts(q_segment_ids_bt, kv_segment_ids_bs, q_start_b, kv_lengths_b)
    vis_b11ts = vis_b11ts[:, None, None]
    groups = heads // kv_heads
    q_btkgd = q_bthd.reshape(batch, q_len, kv_heads, groups, head_dim)
    scores_bkgts = jnp.einsum(
        "btkgd,bskd->bkgts", q_btkgd, k_bskd.astype(q_bthd.dtype),
        preferred_element_type=jnp.float32,
    ) / math.sqrt(head_dim)
    scores_bkgts = jnp.where(vis_b11ts, scores_bkgts, NEG_INF)
    probs = jnp.where(vis_b11ts, jax.nn.softmax(scores_bkgts, axis=-1), 0.0)
    out_btkgd = jnp.einsum("bkgts,bskd->btkgd", probs.astype(q_bthd.dtype),
                           v_bskd.astype(q_bthd.dtype), preferred_element_type=jnp.float32)
    return out_btkgd.reshape(batch, q_len, heads, head_dim).astype(q_bthd.dtype)


def gather_pages(pages_nskd: jax.Array, page_table_bp: jax.Array) -> jax.Array:
    """A paged cache as contiguous rows: [num_pages, page_size, kv, d] pages and an int
    [batch, pages_per_row] table -> [batch, pages_per_row * page_size, kv, d] (slot s of row b
    is page `page_table_bp[b, s // page_size]`, offset `s % page_size`)."""
    batch, pages_per_row = page_table_bp.shape
    _, page_size, kv_heads, head_dim = pages_nskd.shape
    rows_bpskd = pages_nskd[page_table_bp]
    return rows_bpskd.reshape(batch, pages_per_row * page_size, kv_heads, head_dim)


def paged_reference_attention(
    q_bthd: jax.Array,
    k_pages_nskd: jax.Array,
    v_pages_nskd: jax.Array,
    page_table_bp: jax.Array,
    q_start_b: jax.Array,
    kv_lengths_b: jax.Array,
) -> jax.Array:
    """`reference_attention` over a paged cache: the rows' pages gathered, every slot a real
    token (segment 1), the prefix `kv_lengths_b` and causality doing all the masking.

    Args:
      q_bthd: [batch, q_len, heads, head_dim].
      k_pages_nskd, v_pages_nskd: [num_pages, page_size, kv_heads, head_dim] the page pool.
      page_table_bp: int [batch, pages_per_row] page ids per row, in slot order.
      q_start_b: int [batch] slot of query 0 per row.
      kv_lengths_b: int [batch] live slots per row.

    Returns:
      [batch, q_len, heads, head_dim] in q's dtype; zeros where a query sees no key.
    """
    k_bskd = gather_pages(k_pages_nskd, page_table_bp)
    v_bskd = gather_pages(v_pages_nskd, page_table_bp)
    batch, q_len = q_bthd.shape[:2]
    return reference_attention(
        q_bthd, k_bskd, v_bskd, jnp.ones((batch, q_len), jnp.int32),
        jnp.ones(k_bskd.shape[:2], jnp.int32), q_start_b, kv_lengths_b)
