"""Sliding windows and score softcapping (Mistral, Gemma 3) in every attention implementation
`auto` may pick: the full-sequence entry and the decode step against a `DecodeKV` cache give
a numpy reference's numbers (fp32), with the window static or traced (a layer scan's)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrlhf.models.attention import AttentionImpl, cached_query_attention, dot_product_attention
from jaxrlhf.models.decode_kv import DecodeKV

B, T, H, K, D = 2, 12, 4, 2, 16
WINDOW = 3


def _reference(q_bthd, k_bskd, v_bskd, q_seg_bt, kv_seg_bs, q_slot_bt, window, softcap):
    """Per row and head: softmax over the keys of the same non-zero segment, at slots in
    (q - window, q], of (capped) q.k / sqrt(d), times the values (float64)."""
    q, k, v = (np.asarray(x, np.float64) for x in (q_bthd, k_bskd, v_bskd))
    out = np.zeros(q.shape)
    groups = H // K
    for b in range(q.shape[0]):
        for t in range(q.shape[1]):
            slot = q_slot_bt[b, t]
            keys = [s for s in range(k.shape[1]) if s <= slot and kv_seg_bs[b, s] != 0
                    and kv_seg_bs[b, s] == q_seg_bt[b, t]
                    and (window is None or s > slot - window)]
            if not keys:
                continue
            for h in range(H):
                scores = k[b, keys, h // groups] @ q[b, t, h] / np.sqrt(D)
                if softcap is not None:
                    scores = softcap * np.tanh(scores / softcap)
                p = np.exp(scores - scores.max())
                out[b, t, h] = (p / p.sum()) @ v[b, keys, h // groups]
    return out


def _inputs():
    kq, kk, kv = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(kq, (B, T, H, D), jnp.float32)
    k = jax.random.normal(kk, (B, T, K, D), jnp.float32)
    v = jax.random.normal(kv, (B, T, K, D), jnp.float32)
    # Row 0: left padding then one sequence; row 1: two packed sequences.
    seg = np.asarray([[0] * 2 + [1] * 10, [1] * 5 + [2] * 7], np.int32)
    return q, k, v, seg


@pytest.mark.parametrize("impl", list(AttentionImpl), ids=lambda i: i.value)
@pytest.mark.parametrize("softcap", [None, 2.0])
def test_forward_honours_the_window(impl, softcap):
    q, k, v, seg = _inputs()
    slots = np.broadcast_to(np.arange(T), (B, T))
    want = _reference(q, k, v, seg, seg, slots, WINDOW, softcap)
    valid = seg != 0
    got = dot_product_attention(q, k, v, seg, seg, 0, impl, window=WINDOW, softcap=softcap)
    np.testing.assert_allclose(np.asarray(got)[valid], want[valid], atol=2e-5, rtol=0)
    traced = jax.jit(lambda w: dot_product_attention(q, k, v, seg, seg, 0, impl, window=w,
                                                     softcap=softcap))(jnp.int32(WINDOW))
    np.testing.assert_allclose(np.asarray(traced)[valid], want[valid], atol=2e-5, rtol=0)
    full = _reference(q, k, v, seg, seg, slots, None, softcap)
    assert np.abs(full[valid] - want[valid]).max() > 1e-2  # the window changes the output


@pytest.mark.parametrize("impl", list(AttentionImpl), ids=lambda i: i.value)
def test_decode_step_honours_the_window(impl):
    """One query per row at its own slot (7 and 11) against a 12-slot cache: AUTO on the CPU
    would take the C++ kernel, which has no window, so the window must route it to XLA."""
    q, k, v, seg = _inputs()
    q_slot_b = np.asarray([7, 11], np.int32)
    q_b1hd = q[jnp.arange(B), q_slot_b][:, None]
    q_seg_b1 = seg[np.arange(B), q_slot_b][:, None]
    cache = DecodeKV.from_stacked(k, v)
    want = _reference(q_b1hd, k, v, q_seg_b1, seg, q_slot_b[:, None], WINDOW, None)
    got = cached_query_attention(q_b1hd, cache.k_bkcdi, cache.v_bksd, q_seg_b1, seg,
                                 jnp.asarray(q_slot_b), impl, window=WINDOW)
    np.testing.assert_allclose(np.asarray(got), want, atol=2e-5, rtol=0)
    full = _reference(q_b1hd, k, v, q_seg_b1, seg, q_slot_b[:, None], None, None)
    assert np.abs(full - want).max() > 1e-2
