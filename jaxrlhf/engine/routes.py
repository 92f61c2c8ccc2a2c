"""Rows moved between the data-parallel devices of a layout, each device sent only the rows it
needs (the rollout engine's compaction and fill).

A rollout state's rows (its slots) are split over the layout's data axes: device i of the
data-parallel group holds rows [i * n, (i + 1) * n). Compacting a state into fewer slots, or
writing a fill's prefilled prompts into their slots, reads rows that may lie on another device.
Written as a gather (or a scatter) along the split dim with indices every device holds alike,
the SPMD partitioner has each device read the rows it holds with the indices masked and adds
the results up over the data axes: every device then holds the whole result, all devices'
rows. For the compaction of a 70B rollout state on v5p d16t4 (its cache 5.4 GB per chip) that
was 98.8 GB of temporaries on a 95.7 GB chip.

Here the host, which knows the indices, plans the moves (`plan`): a row that stays on its
device is read in place, and every device sends each other device the rows it needs from it,
one all_to_all of c rows per pair of devices (c the most rows one device needs from one other,
a power of two: few compiles); on each device (under shard_map) `take` reads the rows it wants
from its own and the ones it received, by the indices `plan` returned.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxrlhf.parallel.layout import Layout


class Routes(NamedTuple):
    """A plan of row moves (`plan`).

    Attributes:
      send_dq: int32 [dp, dp * c]: device i's rows (its own indices) to send, c to each device
        in turn (padding: row 0); [dp, 0] where no row moves.
      at_j: int32 [j]: each wanted row's index among its device's own rows and those it receives
        (`take`).
      width: c, the rows one device may send another (0: none moves).
    """

    send_dq: np.ndarray
    at_j: np.ndarray
    width: int


def data_axes(layout: Layout) -> tuple[str, ...]:
    """The mesh axes a layout splits rows over (those of its batch dim)."""
    axes = layout.batch_sharding(1).spec[0]
    return () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)


def _pow2(n: int) -> int:
    return 1 << (max(int(n), 1) - 1).bit_length()


def plan(home_j: np.ndarray, row_j: np.ndarray, dest_j: np.ndarray, own: int, dp: int
         ) -> Routes:
    """The moves that bring j wanted rows to their devices: row `row_j` of device `home_j`
    (its own index, < `own`, the rows each device holds) wanted on device `dest_j`; a row wanted
    twice on one device is sent once."""
    at_j = np.asarray(row_j, np.int32).copy()
    moving = np.flatnonzero(np.asarray(home_j) != np.asarray(dest_j))
    if not len(moving):
        return Routes(np.zeros((dp, 0), np.int32), at_j, 0)
    pair = np.asarray(home_j)[moving] * dp + np.asarray(dest_j)[moving]
    # Distinct (pair, row) in order of pair: each row's rank among its pair's.
    moves, which = np.unique(pair * own + np.asarray(row_j)[moving], return_inverse=True)
    pair_v, row_v = moves // own, moves % own
    rank_v = np.arange(len(moves)) - np.searchsorted(pair_v, pair_v)
    width = min(_pow2(rank_v.max() + 1), own)
    send = np.zeros((dp, dp, width), np.int32)
    send[pair_v // dp, pair_v % dp, rank_v] = row_v
    # What device d receives: dp blocks of `width` rows, block i from device i, after its own.
    at_j[moving] = own + (pair_v // dp * width + rank_v)[which.reshape(-1)]
    return Routes(send.reshape(dp, dp * width), at_j, width)


def take(x: jax.Array, at_j: jax.Array, send_q: jax.Array, axes: tuple[str, ...], axis: int = 0
         ) -> jax.Array:
    """Rows `at_j` (along `axis`) of a device's own rows of `x` followed by dp blocks of c rows,
    block i those device i sent it (`plan`'s at_j); a plain take where nothing moves (c = 0).
    Runs on each device (shard_map over the layout's mesh).

    Args:
      send_q: int32 [dp * c]: this device's row of `Routes.send_dq`.
      axes: the mesh axes the rows are split over (`data_axes`).
    """
    if send_q.shape[0] == 0:
        return jnp.take(x, at_j, axis=axis)
    got = jax.lax.all_to_all(jnp.take(x, send_q, axis=axis), axes, axis, axis, tiled=True)
    # Two takes and a select, not one take from own and received rows concatenated: the
    # concatenation would be a copy of every own row.
    own = x.shape[axis]
    mine = jnp.take(x, jnp.minimum(at_j, own - 1), axis=axis)
    theirs = jnp.take(got, jnp.maximum(at_j - own, 0), axis=axis)
    shape = [1] * x.ndim
    shape[axis] = at_j.shape[0]
    return jnp.where((at_j < own).reshape(shape), mine, theirs)
