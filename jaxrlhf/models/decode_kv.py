"""One layer's KV cache as a token loop keeps it on XLA:CPU (`engine.decode_layers`): keys in
tiles of cache slots, values [b, k, S, d], and what the engines do to it (zeros, to and from the
stacked [b, S, k, d] form, resize, take rows, write a prompt, write one token per row).

Why tiles. A decode step's scores are q [g, d] x K [d, S] per (row, kv head): a batched product
whose one big operand is the cache. Stored as one [d, S] matrix (the layout before), XLA:CPU's
dot reads it in panels of columns, each touching all head_dim rows S slots apart: as many
strided streams as head_dim, and the product ran at 9 GB/s at 1,056 slots (W-cpu's 64 rows, 2
kv heads of dim 64), two and a half times slower than the output's p [g, S] x V [S, d], which
reads V row after row. Stored as tiles [S / T, d, T], every tile one contiguous block of T
slots, the scores are a product batched over (row, kv head, tile) that reads each tile
straight through. The scores' product alone, CPU ms for 4 layers at 1,024 slots (128), against
15.6 (1.6) for the [d, S] matrix: tiles of 8 slots 17.5 (2.2), 16: 12.6 (1.7), 32: 8.5 (0.76),
64: 7.2 (0.59), 128: 13.6 (1.4). A whole step's attention: `benchmarks/decode_step.py`.

The tile is 64 slots where the cache length is a multiple of 64, else 32, and the tiles may run
past the cache's last slot (at most 31 slots, zeros, never attended): a length a static shape
fixes, so every cache of one length has one tile size.

Values stay [b, k, S, d]: p [g, S] x V [S, d] already reads V in place, near the memory
bandwidth.

A sliding-window layer's cache may hold fewer slots than the sequence, R < S (a ring): slot s
lies at position s % R, so its R positions hold the latest R slots written, and a query at slot
q reads position j as slot q - ((q - j) mod R) (`ring_slots`; `attention.cached_query_attention`).
A cache of R >= S slots is the same ring that has not wrapped: slot s at position s.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

TILE = 64
_SMALL_TILE = 32


def fit_length(x: jax.Array, length: int, axis: int) -> jax.Array:
    """`x` with `length` entries along `axis`: zero-padded at the end, or cut at `length`."""
    if x.shape[axis] >= length:
        return jax.lax.slice_in_dim(x, 0, length, axis=axis)
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, length - x.shape[axis])
    return jnp.pad(x, widths)


def tile_size(length: int) -> int:
    """Slots per key tile of a cache of `length` slots."""
    return TILE if length % TILE == 0 else _SMALL_TILE


def _tiles(length: int) -> int:
    return -(-length // tile_size(length))


def _tiled(k_bkds: jax.Array) -> jax.Array:
    """Keys [b, k, d, S] as tiles [b, k, c, d, i] (zeros after slot S)."""
    batch, kv_heads, head_dim, length = k_bkds.shape
    tile, tiles = tile_size(length), _tiles(length)
    k_bkds = jnp.pad(k_bkds, ((0, 0), (0, 0), (0, 0), (0, tiles * tile - length)))
    return jnp.swapaxes(k_bkds.reshape(batch, kv_heads, head_dim, tiles, tile), 2, 3)


def ring_slots(q_slot_b: jax.Array, length: int) -> jax.Array:
    """int32 [b, R]: the slot each position of a ring of R = `length` positions holds for a
    query at slot q_slot_b [b] (negative: no slot yet)."""
    j_r = jnp.arange(length, dtype=jnp.int32)
    q_b1 = q_slot_b.astype(jnp.int32)[:, None]
    return q_b1 - jnp.mod(q_b1 - j_r, length)


class DecodeKV(NamedTuple):
    """One layer's cache in a token loop (module docstring).

    Attributes:
      k_bkcdi: keys [batch, kv_heads, tiles, head_dim, tile]: slot s at tile s // tile,
        position s % tile; tiles x tile >= S, slots from S on are zeros, never read.
      v_bksd: values [batch, kv_heads, S, head_dim].
    """

    k_bkcdi: jax.Array
    v_bksd: jax.Array

    @property
    def length(self) -> int:
        """S, the cache's slots."""
        return self.v_bksd.shape[2]

    @staticmethod
    def shapes(batch: int, kv_heads: int, head_dim: int, length: int) -> "DecodeKV":
        """The shapes (tuples) of a cache of `length` slots."""
        return DecodeKV((batch, kv_heads, _tiles(length), head_dim, tile_size(length)),
                        (batch, kv_heads, length, head_dim))

    @staticmethod
    def zeros(batch: int, kv_heads: int, head_dim: int, length: int, dtype) -> "DecodeKV":
        shapes = DecodeKV.shapes(batch, kv_heads, head_dim, length)
        return DecodeKV(*(jnp.zeros(shape, dtype) for shape in shapes))

    @staticmethod
    def from_stacked(k_bskd: jax.Array, v_bskd: jax.Array) -> "DecodeKV":
        """From keys and values [b, S, k, d] (one transposing copy)."""
        return DecodeKV(_tiled(jnp.transpose(k_bskd, (0, 2, 3, 1))),
                        jnp.transpose(v_bskd, (0, 2, 1, 3)))

    def keys_bkds(self) -> jax.Array:
        """The keys as one [b, k, d, S] array (a copy)."""
        batch, kv_heads, tiles, head_dim, tile = self.k_bkcdi.shape
        k_bkds = jnp.swapaxes(self.k_bkcdi, 2, 3).reshape(batch, kv_heads, head_dim, tiles * tile)
        return k_bkds[..., :self.length]

    def stacked(self) -> tuple[jax.Array, jax.Array]:
        """(keys, values) [b, S, k, d] (`from_stacked` undone)."""
        return (jnp.transpose(self.keys_bkds(), (0, 3, 1, 2)),
                jnp.transpose(self.v_bksd, (0, 2, 1, 3)))

    def resized(self, length: int) -> "DecodeKV":
        """The cache with `length` slots: zero-padded, or cut at `length`."""
        return DecodeKV(_tiled(fit_length(self.keys_bkds(), length, 3)),
                        fit_length(self.v_bksd, length, 2))

    def take(self, rows_m: jax.Array) -> "DecodeKV":
        """Rows `rows_m` [m] only, in that order."""
        return DecodeKV(*(jnp.take(x, rows_m, axis=0) for x in self))

    def write_window(self, rows_u: jax.Array, k_uskd: jax.Array, v_uskd: jax.Array,
                     last_u: jax.Array) -> "DecodeKV":
        """A ring shorter than the L slots given (module docstring): each row's R positions set
        to its latest R slots up to `last_u` [u] (int), gathered from keys and values
        [u, L, k, d]; positions of slots before 0 get zeros. Rows as `write_prefix`."""
        ring = self.length
        slots_ur = ring_slots(last_u, ring)
        take = lambda x_uskd: jnp.where(
            (slots_ur >= 0)[:, :, None, None],
            jnp.take_along_axis(x_uskd, jnp.maximum(slots_ur, 0)[:, :, None, None], axis=1), 0)
        return self.write_prefix(rows_u, take(k_uskd), take(v_uskd))

    def write_prefix(self, rows_u: jax.Array, k_uskd: jax.Array, v_uskd: jax.Array
                     ) -> "DecodeKV":
        """The first L slots of rows `rows_u` [u] (an index >= b is padding, dropped) set to
        keys and values [u, L, k, d]. Later slots keep what they held, except that slots up to
        the end of slot L - 1's key tile read zero keys (never attended before this row's own
        tokens overwrite them: causality hides them). A ring shorter than L keeps the last
        R slots, each at its position (`write_window`)."""
        prefix = k_uskd.shape[1]
        if prefix > self.length:
            last_u = jnp.full(k_uskd.shape[:1], prefix - 1, jnp.int32)
            return self.write_window(rows_u, k_uskd, v_uskd, last_u)
        tile = self.k_bkcdi.shape[-1]
        tiles = -(-prefix // tile)
        k_ukds = jnp.pad(jnp.transpose(k_uskd, (0, 2, 3, 1)),
                         ((0, 0), (0, 0), (0, 0), (0, tiles * tile - prefix)))
        k_ukcdi = jnp.swapaxes(k_ukds.reshape(*k_ukds.shape[:3], tiles, tile), 2, 3)
        dtype = self.v_bksd.dtype
        return DecodeKV(
            self.k_bkcdi.at[rows_u, :, :tiles].set(k_ukcdi.astype(dtype), mode="drop"),
            self.v_bksd.at[rows_u, :, :prefix].set(
                jnp.transpose(v_uskd, (0, 2, 1, 3)).astype(dtype), mode="drop"))

    def write_token(self, k_bkd: jax.Array, v_bkd: jax.Array, slot) -> "DecodeKV":
        """One new token's keys and values [b, k, d] per row, in place: at `slot` (a scalar:
        a dynamic update of one slot) or row r's at `slot[r]` (int [b]: a scatter, which
        writes only the rows' slots where a select would rewrite the whole cache); in a ring,
        at the slot's position (slot % R)."""
        tile = self.k_bkcdi.shape[-1]
        slot = slot % self.length
        k_bkd, v_bkd = k_bkd.astype(self.k_bkcdi.dtype), v_bkd.astype(self.v_bksd.dtype)
        if jnp.ndim(slot):
            rows_b = jnp.arange(k_bkd.shape[0])
            return DecodeKV(self.k_bkcdi.at[rows_b, :, slot // tile, :, slot % tile].set(k_bkd),
                            self.v_bksd.at[rows_b, :, slot, :].set(v_bkd))
        return DecodeKV(
            jax.lax.dynamic_update_slice(self.k_bkcdi, k_bkd[:, :, None, :, None],
                                         (0, 0, slot // tile, 0, slot % tile)),
            jax.lax.dynamic_update_slice(self.v_bksd, v_bkd[:, :, None], (0, 0, slot, 0)))


# Logical axes of each array, for sharding constraints (`engine.decoding.constrain_cache`).
AXES = DecodeKV(("batch", "act_kv_heads", None, "head_dim", None),
                ("batch", "act_kv_heads", None, "head_dim"))
