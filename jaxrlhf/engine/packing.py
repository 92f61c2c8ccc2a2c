"""Packing: sequences laid end to end in rows of a fixed width, so a forward pays for tokens.

A train or inference batch arrives *padded*: one sequence per row of width t (left-padded
prompt, right-padded response), its real tokens one contiguous run with segment id != 0. With
long-tailed lengths most of those [b, t] slots are padding, and the transformer, the vocabulary
projection and the log-softmax would compute on them all. A `PackPlan` (built on the host from
the rows' segment ids) moves every sequence into a packed row of the same width t, several per row,
each with its own segment id (1, 2, ... within the row) and its positions restarting at 0, so
attention never crosses sequences (`models.attention`). The model runs on the packed rows; its
per-token outputs are moved back to the padded layout (`unpack`), where every loss and every
caller reads them exactly as an unpadded forward of each sequence would give them.

Rows of one call are cut into m micro-batches (strided: micro-batch j holds the padded rows
j, j + m, ...; `engine.microbatch`) and each micro-batch is packed on its own into R rows; R is
the same for all of them (one compiled shape) and comes from a short ladder (`row_buckets`),
a multiple of the data-parallel size, so compiles stay few. Each data-parallel rank packs the
sequences of its own block of rows into its own block of R/dp packed rows, so packing moves
nothing between devices (a gather across shards costs XLA an all-reduce per call, and an early
collective stalls every device's worker until the slowest arrives). Within a block sequences
go, longest first, to the fullest row that has room for them (best fit decreasing).

With long-tailed lengths the shards' own rows can hold very different token counts, and every
shard computes as many packed rows as the fullest needs. A *spread* plan (`plan(...,
spread=True)`) balances them instead: each micro-batch's sequences are dealt to the shards
longest first, each to the shard with the fewest tokens so far (greedy LPT), then packed into
that shard's rows as above. Its indices count within the whole micro-batch, so packing and
unpacking read across devices (`pack`/`unpack` with shards=1); train steps and inference take
it where it needs fewer packed rows than the shards' own (`fewest_rows`).

`Rows.PADDED` is the same machinery with the identity plan (sequence i in row i, where it
lies): what a pipelined layout runs, and the baseline benchmarks compare against.
"""

from __future__ import annotations

import enum
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np


class Rows(enum.Enum):
    """How a batch's sequences are laid into the rows the model computes on."""

    PACKED = "packed"  # several sequences per row, rows of the batch's width
    PADDED = "padded"  # one sequence per row, as it arrived


class PackPlan(NamedTuple):
    """Where every token goes, for m micro-batches of b/m padded rows of width t each.

    Attributes:
      gather_mrt: int32 [m, R, t]: packed slot (r, s) of micro-batch j holds token
        gather_mrt[j, r, s] of that micro-batch's padded rows, flattened ([b/m * t]); 0 on
        padding slots (which segment_ids_mrt marks).
      segment_ids_mrt: int32 [m, R, t]: 1, 2, ... for the sequences of a packed row, 0 on
        padding.
      scatter_mbt: int32 [m, b/m, t]: padded token (i, s) of micro-batch j sits at packed slot
        scatter_mbt[j, i, s] of that micro-batch's packed rows, flattened ([R * t]); 0 on
        padding tokens.
    """

    gather_mrt: np.ndarray | jax.Array
    segment_ids_mrt: np.ndarray | jax.Array
    scatter_mbt: np.ndarray | jax.Array

    @property
    def rows(self) -> int:
        """R, packed rows per micro-batch."""
        return self.gather_mrt.shape[1]


class Spans(NamedTuple):
    """The sequences of a batch's rows: maximal runs of one non-zero segment id, int64 [n]
    each (row, first column, length), row-major."""

    row_n: np.ndarray
    start_n: np.ndarray
    length_n: np.ndarray


def sequence_spans(segment_ids_bt: np.ndarray) -> Spans:
    """Every run of equal non-zero segment ids in every row (one per row for a padded batch;
    a batch that is packed already has several)."""
    seg_bt = np.asarray(segment_ids_bt)
    edge_bt = np.ones(seg_bt.shape, bool)
    edge_bt[:, 1:] = seg_bt[:, 1:] != seg_bt[:, :-1]
    row_n, start_n = np.nonzero(edge_bt & (seg_bt != 0))
    flat_start_n = row_n * seg_bt.shape[1] + start_n
    run_end = np.flatnonzero(np.append(edge_bt.reshape(-1)[1:], True)
                             | np.append((seg_bt.reshape(-1) == 0)[1:], True))
    # The end of a run: the first edge, or row end, at or after its start.
    ends_n = run_end[np.searchsorted(run_end, flat_start_n)]
    return Spans(row_n, start_n, ends_n - flat_start_n + 1)


def row_buckets(rows: int, multiple: int) -> int:
    """The smallest row count on the ladder 1, 2, ..., 8, 10, 12, 14, 16, 20, 24, 28, 32, 40,
    ... (every count to 8, then four per octave) times `multiple` that is >= `rows`: a
    micro-batch's packed rows compile for few shapes, and waste at most a quarter of them.
    (Two per octave wasted a third: W-cpu's long-tailed batch needed 18 rows and got 24.)"""
    steps = 1
    while steps * multiple < rows:
        octave = 1 << max(0, steps.bit_length() - 3)  # the step between rungs: 1 below 8
        steps += octave
    return steps * multiple


def _fill(length_n: np.ndarray, width: int, rows: int):
    """Longest first, each sequence into the fullest of `rows` rows it fits in (best fit
    decreasing: few rows); None if one fits nowhere. Returns (row_n, offset_n), int64 [n]."""
    row_n = np.zeros(len(length_n), np.int64)
    offset_n = np.zeros(len(length_n), np.int64)
    used_r = np.zeros(rows, np.int64)
    for i in np.argsort(-length_n, kind="stable"):
        room_r = np.where(used_r + length_n[i] <= width, used_r, -1)
        r = int(np.argmax(room_r))
        if room_r[r] < 0:
            return None
        row_n[i], offset_n[i] = r, used_r[r]
        used_r[r] += length_n[i]
    return row_n, offset_n


def rows_needed(length_n: np.ndarray, width: int, multiple: int) -> int:
    """R for one group of sequences: the smallest bucket of `row_buckets` they fit in."""
    total = int(np.sum(length_n))
    rows = row_buckets(max(1, -(-total // width)), multiple)
    while _fill(length_n, width, rows) is None:
        rows = row_buckets(rows + 1, multiple)
    return rows


def plan(segment_ids_bt: np.ndarray, micro_batches: int, shards: int, rows: Rows,
         min_rows: int = 0, spread: bool = False) -> PackPlan:
    """The plan of a batch, host side.

    Args:
      segment_ids_bt: [b, t] segment ids of the batch (one sequence per row when padded).
      micro_batches: m; micro-batch j is rows j::m.
      shards: the data-parallel size: each shard's block of a micro-batch's rows is packed into
        its own block of R/shards packed rows, so packing and unpacking move nothing between
        devices.
      rows: PACKED, or PADDED for the identity plan (R = b/m).
      min_rows: R is at least this (a caller's bucket).
      spread: PACKED only: balance the shards' tokens (module docstring); the indices then
        count within the whole micro-batch.

    Returns:
      A PackPlan of numpy arrays; its indices count within a shard's block (see `pack`), or
      within the micro-batch when `spread`.
    """
    segment_ids_bt = np.asarray(segment_ids_bt)
    if spread:
        return _spread_plan(segment_ids_bt, micro_batches, shards, min_rows)
    batch, width = segment_ids_bt.shape
    per_shard = batch // micro_batches // shards  # padded rows of a micro-batch on one shard
    local, groups = _blocks(segment_ids_bt, micro_batches, shards)
    if rows is Rows.PADDED:
        count = max(per_shard, -(-min_rows // shards))
        placed = [(local.row_n[g], local.start_n[g]) for g in groups]
    else:
        count = max(_block_rows(local, groups, width), -(-min_rows // shards))
        placed = [_fill(local.length_n[g], width, count) for g in groups]
    parts = [_micro_plan(Spans(*(x[g] for x in local)), row_g, offset_g, per_shard, width,
                         count) for g, (row_g, offset_g) in zip(groups, placed)]
    # [m * shards] blocks -> [m, shards * rows of a block]
    return PackPlan(*(np.stack(arrays).reshape(micro_batches, -1, width)
                      for arrays in zip(*parts)))


def _blocks(segment_ids_bt: np.ndarray, micro_batches: int, shards: int):
    """(spans with rows counted within their block, [indices of the spans of block g] for
    g = j * shards + d): block (j, d) is shard d's part of micro-batch j's rows."""
    batch = segment_ids_bt.shape[0]
    per_shard = batch // micro_batches // shards
    spans = sequence_spans(segment_ids_bt)
    micro_n, local_n = spans.row_n % micro_batches, spans.row_n // micro_batches
    group_n = micro_n * shards + local_n // per_shard
    local = Spans(local_n % per_shard, spans.start_n, spans.length_n)
    return local, [np.flatnonzero(group_n == g) for g in range(micro_batches * shards)]


def _block_rows(local: Spans, groups, width: int) -> int:
    """Packed rows of one block: the bucket every block's sequences fit in."""
    return row_buckets(max(rows_needed(local.length_n[g], width, 1) for g in groups), 1)


def packed_rows(segment_ids_bt: np.ndarray, micro_batches: int, shards: int) -> int:
    """R of `plan(..., Rows.PACKED)` for these micro-batches, without building the plan."""
    local, groups = _blocks(np.asarray(segment_ids_bt), micro_batches, shards)
    return shards * _block_rows(local, groups, segment_ids_bt.shape[1])


def _deal(length_n: np.ndarray, shards: int) -> np.ndarray:
    """int64 [n]: the shard of each sequence, longest first to the shard with the fewest tokens
    so far (greedy LPT: no shard ends above the mean by more than one sequence)."""
    shard_n = np.zeros(len(length_n), np.int64)
    load_d = np.zeros(shards, np.int64)
    for i in np.argsort(-length_n, kind="stable"):
        d = int(np.argmin(load_d))
        shard_n[i] = d
        load_d[d] += length_n[i]
    return shard_n


def _spread_groups(segment_ids_bt: np.ndarray, micro_batches: int, shards: int):
    """(spans with rows counted within their micro-batch, [indices of the spans of group g] for
    g = j * shards + d): shard d's share of micro-batch j's sequences, dealt by `_deal`."""
    spans = sequence_spans(segment_ids_bt)
    micro_n = spans.row_n % micro_batches
    shard_n = np.zeros(len(micro_n), np.int64)
    for j in range(micro_batches):
        in_j = np.flatnonzero(micro_n == j)
        shard_n[in_j] = _deal(spans.length_n[in_j], shards)
    local = Spans(spans.row_n // micro_batches, spans.start_n, spans.length_n)
    group_n = micro_n * shards + shard_n
    return local, [np.flatnonzero(group_n == g) for g in range(micro_batches * shards)]


def spread_rows(segment_ids_bt: np.ndarray, micro_batches: int, shards: int) -> int:
    """R of `plan(..., Rows.PACKED, spread=True)`, without building the plan."""
    local, groups = _spread_groups(np.asarray(segment_ids_bt), micro_batches, shards)
    return shards * _block_rows(local, groups, segment_ids_bt.shape[1])


def _spread_plan(segment_ids_bt: np.ndarray, micro_batches: int, shards: int,
                 min_rows: int) -> PackPlan:
    """`plan(..., spread=True)`: each shard's dealt sequences packed into its own block of the
    micro-batch's packed rows, indices counted within the micro-batch."""
    batch, width = segment_ids_bt.shape
    local, groups = _spread_groups(segment_ids_bt, micro_batches, shards)
    count = max(_block_rows(local, groups, width), -(-min_rows // shards))
    micro_plans = []
    for j in range(micro_batches):
        parts = []
        for d in range(shards):
            g = groups[j * shards + d]
            row_g, offset_g = _fill(local.length_n[g], width, count)
            parts.append(_micro_plan(Spans(*(x[g] for x in local)), row_g, offset_g,
                                     batch // micro_batches, width, count, row_base=d * count))
        gathers, segments, scatters = zip(*parts)
        # Each shard's scatter is 0 off its own sequences' tokens: their sum is the whole one.
        micro_plans.append((np.concatenate(gathers), np.concatenate(segments),
                            np.sum(scatters, axis=0, dtype=np.int32)))
    return PackPlan(*(np.stack(arrays) for arrays in zip(*micro_plans)))


def fewest_rows(segment_ids_bt: np.ndarray, own: PackPlan, shards: int, rows: Rows
                ) -> tuple[PackPlan, bool]:
    """(plan, spread): the spread plan of `own`'s micro-batches where it needs fewer packed rows
    than `own` (each shard packing its own rows: long-tailed lengths on several data-parallel
    shards), else `own`. Every rank computes as many packed rows as the fullest needs, and a
    spread plan's cross-device gather of the token arrays costs far less than the rows it
    saves; a caller compiles its call for both (`pack`/`unpack` with shards=1 when spread)."""
    micro_batches = own.gather_mrt.shape[0]
    if (rows is Rows.PACKED and shards > 1
            and spread_rows(segment_ids_bt, micro_batches, shards) < own.rows):
        return plan(segment_ids_bt, micro_batches, shards, rows, spread=True), True
    return own, False


def shard_tokens(plan_: PackPlan, shards: int) -> np.ndarray:
    """int64 [m, shards]: the real tokens in each shard's block of each micro-batch's packed
    rows (what each data-parallel rank computes on)."""
    seg_mdn = np.asarray(plan_.segment_ids_mrt).reshape(plan_.gather_mrt.shape[0], shards, -1)
    return np.count_nonzero(seg_mdn, axis=-1)


def _micro_plan(spans: Spans, row_n, offset_n, batch: int, width: int, rows: int,
                row_base: int = 0):
    """One block's (gather_rt, segment_ids_rt, scatter_bt), numpy int32: `spans` of its
    `batch` padded rows into its `rows` packed rows (which start at packed row `row_base` of
    the rows the scatter indices count)."""
    gather_rt = np.zeros((rows, width), np.int32)
    segment_ids_rt = np.zeros((rows, width), np.int32)
    scatter_bt = np.zeros((batch, width), np.int32)
    next_id_r = np.ones(rows, np.int32)
    for i in np.lexsort((offset_n, row_n)):  # left to right in each packed row
        n, r, off = int(spans.length_n[i]), int(row_n[i]), int(offset_n[i])
        src, start = int(spans.row_n[i]), int(spans.start_n[i])
        gather_rt[r, off:off + n] = src * width + start + np.arange(n)
        segment_ids_rt[r, off:off + n] = next_id_r[r]
        next_id_r[r] += 1
        scatter_bt[src, start:start + n] = (row_base + r) * width + off + np.arange(n)
    return gather_rt, segment_ids_rt, scatter_bt


def _by_shard(x_bt: jax.Array, index_rt: jax.Array, shards: int) -> jax.Array:
    """x's entries picked by `index_rt` within each shard's block of rows: [B, t, ...] and
    [R, t] -> [R, t, ...] (trailing dims, e.g. routing replay's [L, k] per token, move with
    their token), shard d's rows of index_rt reading shard d's rows of x. A gather whose
    leading (shard) dim is a batch dim, so XLA partitions it over the devices as it lies."""
    trailing = x_bt.shape[2:]
    x_dn = x_bt.reshape(shards, -1, *trailing)
    index_dn = index_rt.reshape(shards, -1, *(1,) * len(trailing))
    return jnp.take_along_axis(x_dn, index_dn, axis=1).reshape(*index_rt.shape, *trailing)


def pack(x_bt: jax.Array, gather_rt: jax.Array, shards: int) -> jax.Array:
    """[b, t, ...] padded rows -> [R, t, ...] packed rows (padding slots hold some token's
    entry)."""
    return _by_shard(x_bt, gather_rt, shards)


def unpack(x_rt: jax.Array, scatter_bt: jax.Array, real_bt: jax.Array, shards: int
           ) -> jax.Array:
    """[R, t] per-token outputs on packed rows -> [b, t] on the padded rows, 0 where `real_bt`
    (bool [b, t]) is False. Differentiable (its gradient scatters back)."""
    return jnp.where(real_bt, _by_shard(x_rt, scatter_bt, shards), jnp.zeros((), x_rt.dtype))


def packed_tokens(plan_: PackPlan) -> int:
    """Real tokens over all micro-batches (host int)."""
    return int(np.count_nonzero(np.asarray(plan_.segment_ids_mrt)))
