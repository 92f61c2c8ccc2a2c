"""A layer's decode cache (`models.decode_kv.DecodeKV`, keys in tiles of slots): every operation
the engines use is the same operation on the plain [b, S, k, d] cache, for lengths whose tiles
are 64 slots, 32, and 32 running past the last slot."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrlhf.models.decode_kv import DecodeKV, tile_size

_B, _K, _D = 3, 2, 4


def _stacked(length, seed=0):
    rng = np.random.default_rng(seed)
    return tuple(rng.standard_normal((_B, length, _K, _D)).astype(np.float32) for _ in range(2))


def _check(cache: DecodeKV, k_bskd, v_bskd):
    batch, length = k_bskd.shape[:2]
    assert cache.length == length
    assert cache.k_bkcdi.shape == DecodeKV.shapes(batch, _K, _D, length).k_bkcdi
    got_k, got_v = cache.stacked()
    np.testing.assert_array_equal(got_k, k_bskd)
    np.testing.assert_array_equal(got_v, v_bskd)
    # Slots past the end of the cache (the last tile's tail) hold zeros.
    tiles, tile = cache.k_bkcdi.shape[2], cache.k_bkcdi.shape[4]
    flat = np.swapaxes(np.asarray(cache.k_bkcdi), 2, 3).reshape(batch, _K, _D, tiles * tile)
    assert not flat[..., length:].any()


def test_tile_sizes():
    assert [tile_size(n) for n in (128, 96, 80, 9)] == [64, 32, 32, 32]
    assert DecodeKV.shapes(2, 1, 8, 80) == ((2, 1, 3, 8, 32), (2, 1, 80, 8))


@pytest.mark.parametrize("length", [128, 96, 40])
def test_round_trip_and_layout(length):
    k_bskd, v_bskd = _stacked(length)
    cache = DecodeKV.from_stacked(jnp.asarray(k_bskd), jnp.asarray(v_bskd))
    _check(cache, k_bskd, v_bskd)
    # Slot s of row b, head h is at tile s // T, position s % T.
    tile = tile_size(length)
    s = length - 1
    np.testing.assert_array_equal(cache.k_bkcdi[1, 1, s // tile, :, s % tile], k_bskd[1, s, 1])


def test_resize_take_and_writes():
    k_bskd, v_bskd = _stacked(40)
    cache = DecodeKV.from_stacked(jnp.asarray(k_bskd), jnp.asarray(v_bskd))
    for length in (128, 96, 80, 40):  # grow across tile sizes, then cut
        cache = jax.jit(DecodeKV.resized, static_argnums=1)(cache, length)
        pad = ((0, 0), (0, max(0, length - 40)), (0, 0), (0, 0))
        _check(cache, np.pad(k_bskd, pad)[:, :length], np.pad(v_bskd, pad)[:, :length])
    rows = jnp.asarray([2, 0])
    _check(cache.take(rows), k_bskd[[2, 0]], v_bskd[[2, 0]])

    # One token per row: at one slot for all rows, then at each row's own.
    new_k, new_v = (np.full((_B, _K, _D), x, np.float32) for x in (7.0, 8.0))
    want_k, want_v = k_bskd.copy(), v_bskd.copy()
    cache = jax.jit(DecodeKV.write_token)(cache, new_k, new_v, jnp.int32(33))
    want_k[:, 33], want_v[:, 33] = new_k, new_v
    _check(cache, want_k, want_v)
    slots = np.asarray([0, 31, 39])
    cache = jax.jit(DecodeKV.write_token)(cache, -new_k, -new_v, jnp.asarray(slots))
    want_k[np.arange(_B), slots], want_v[np.arange(_B), slots] = -new_k, -new_v
    _check(cache, want_k, want_v)

    # A prompt of 5 slots into rows 2 and 0 (row 3 is padding, dropped): its slots set, the
    # rest of its first tile zero keys, the values and every later slot kept.
    prompt_k, prompt_v = (x[:, :5] + 100 for x in _stacked(5, seed=1)[:2])
    targets = jnp.asarray([2, 0, 3])
    cache = jax.jit(DecodeKV.write_prefix)(cache, targets, prompt_k, prompt_v)
    for row, src in ((2, 0), (0, 1)):
        want_k[row, :5], want_v[row, :5] = prompt_k[src], prompt_v[src]
        want_k[row, 5:32] = 0.0
    _check(cache, want_k, want_v)
