"""The XLA:CPU decode-attention kernel (`kernels/cpu_decode_attention.cc`) computes what XLA's
products compute (`models.attention.cached_query_attention` with impl XLA) on the tiled cache:
every supported tile and head shape, left padding, per-row and shared query slots; it reads
nothing after a row's query slot; AUTO runs it on the CPU backend, inside `shard_map` on each
device's own rows, and not where XLA partitions the program. And `kernels.native` builds a
library once per source and host, or says why it cannot."""

import functools
import os
import stat

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxrlhf.models import attention
from jaxrlhf.models.attention import AttentionImpl
from jaxrlhf.models.decode_kv import DecodeKV
from jaxrlhf.kernels import cpu_decode_attention, native

needs_compiler = pytest.mark.skipif(
    native.compiler() is None,
    reason="no C++ compiler on PATH: the kernel cannot be built, decode steps run XLA's products")

_XLA = functools.partial(attention.cached_query_attention, impl=AttentionImpl.XLA)


def _operands(batch, heads, kv_heads, dim, length, seed=0, poison_after_slot=False):
    """A cache of `length` slots, rows left-padded by 0-5 slots, each row's query slot drawn
    (row 0's at slot 0); the last row a padding query. With `poison_after_slot`, every key and
    value after a row's query slot is NaN."""
    rng = np.random.default_rng(seed)
    q_b1hd = rng.standard_normal((batch, 1, heads, dim), np.float32)
    k_bskd, v_bskd = (rng.standard_normal((batch, length, kv_heads, dim), np.float32)
                      for _ in range(2))
    pads_b = rng.integers(0, 6, batch)
    slot_b = np.maximum(pads_b, rng.integers(0, length, batch)).astype(np.int32)
    slot_b[0], pads_b[0] = 0, 0
    kv_seg_bs = (np.arange(length)[None] >= pads_b[:, None]).astype(np.int32)
    q_seg_b1 = np.ones((batch, 1), np.int32)
    q_seg_b1[-1] = 0
    if poison_after_slot:
        after_bs = np.arange(length)[None] > slot_b[:, None]
        k_bskd[after_bs], v_bskd[after_bs] = np.nan, np.nan
    cache = DecodeKV.from_stacked(jnp.asarray(k_bskd), jnp.asarray(v_bskd))
    return (jnp.asarray(q_b1hd), *cache, jnp.asarray(q_seg_b1), jnp.asarray(kv_seg_bs),
            jnp.asarray(slot_b))


@needs_compiler
@pytest.mark.parametrize("heads,kv_heads,dim,length", [
    (4, 2, 16, 40),     # tiny: tiles of 32, a partial last tile
    (4, 2, 64, 576),    # W-cpu's shape, tiles of 64
    (14, 2, 64, 96),    # Qwen2.5-0.5B's 7 query heads per kv head
    (16, 8, 128, 128),  # Qwen3's head dim
    (8, 8, 32, 200),    # one query head per kv head
])
def test_equals_xla_products(heads, kv_heads, dim, length):
    q_b1hd, k, v, q_seg_b1, kv_seg_bs, slot_b = _operands(6, heads, kv_heads, dim, length)
    tile = k.shape[-1]
    assert tile == (64 if length % 64 == 0 else 32)
    kernel = jax.jit(cpu_decode_attention.decode_attention)
    for slot in (slot_b, jnp.int32(length - 1)):  # each row's own slot; one for all rows
        got = np.asarray(kernel(q_b1hd, k, v, q_seg_b1, kv_seg_bs, slot))
        want = np.asarray(jax.jit(_XLA)(q_b1hd, k, v, q_seg_b1, kv_seg_bs, slot))
        np.testing.assert_allclose(got[:-1], want[:-1], rtol=1e-5, atol=1e-6)
        np.testing.assert_array_equal(got[-1], 0.0)  # a padding query: zeros, never read


@needs_compiler
def test_reads_nothing_after_a_rows_query_slot():
    """NaN keys and values after each row's query slot: the kernel's output is the clean
    cache's (XLA's products read the whole cache: NaN)."""
    clean = _operands(5, 4, 2, 64, 136)
    poisoned = _operands(5, 4, 2, 64, 136, poison_after_slot=True)
    got = np.asarray(jax.jit(cpu_decode_attention.decode_attention)(*poisoned))
    want = np.asarray(jax.jit(_XLA)(*clean))
    np.testing.assert_allclose(got[:-1], want[:-1], rtol=1e-5, atol=1e-6)
    assert np.isnan(np.asarray(jax.jit(_XLA)(*poisoned))[:-1]).any()


@needs_compiler
def test_masked_slots_weigh_exactly_zero():
    """Values of 1e36 in the left padding (visible to no query): nothing of them reaches the
    output, as in XLA's softmax (a weight of 1e-38 would add 1e-2), whether the padding ends
    inside the first key tile or fills whole tiles before the first visible slot."""
    q_b1hd, k, v, q_seg_b1, kv_seg_bs, slot_b = _operands(6, 4, 2, 64, 128, seed=3)
    kernel, xla = jax.jit(cpu_decode_attention.decode_attention), jax.jit(_XLA)
    for pad in (None, 70):  # `_operands`' 0-5 slots; 70, past the first tile of 64
        if pad is not None:
            kv_seg_bs = (jnp.arange(128)[None] >= pad).astype(jnp.int32).repeat(6, 0)
            slot_b = jnp.maximum(slot_b, pad)
        padding_bks1 = (kv_seg_bs == 0)[:, None, :, None]
        assert padding_bks1.any()
        v_huge = jnp.where(padding_bks1, 1e36, v)
        got = np.asarray(kernel(q_b1hd, k, v_huge, q_seg_b1, kv_seg_bs, slot_b))
        want = np.asarray(xla(q_b1hd, k, v_huge, q_seg_b1, kv_seg_bs, slot_b))
        np.testing.assert_allclose(got[:-1], want[:-1], rtol=1e-5, atol=1e-6)


@needs_compiler
def test_auto_runs_the_kernel_on_cpu_where_it_takes_the_operands():
    operands = _operands(2, 4, 2, 16, 64)
    one_device = Mesh(np.array(jax.devices()[:1]), ("data",))
    with jax.set_mesh(one_device):
        lowered = {impl: jax.jit(functools.partial(attention.cached_query_attention, impl=impl))
                   .lower(*operands).as_text()
                   for impl in (AttentionImpl.AUTO, AttentionImpl.XLA)}
    name = cpu_decode_attention.target()
    assert name in lowered[AttentionImpl.AUTO] and name not in lowered[AttentionImpl.XLA]
    q_b1hd, k, v = operands[:3]
    with jax.set_mesh(one_device):
        assert cpu_decode_attention.takes(q_b1hd, k, v)
        assert not cpu_decode_attention.takes(q_b1hd.astype(jnp.bfloat16), k, v)  # fp32 only
        odd = _operands(2, 4, 2, 8, 64)  # head dim 8
        assert not cpu_decode_attention.takes(*odd[:3])


@needs_compiler
def test_runs_where_the_program_is_not_partitioned():
    """Inside `shard_map` (the rollout engine) each device runs its own rows through the
    kernel, with no collective, and gets the unsharded call's output; under a mesh whose axes
    XLA partitions, XLA's products run (the partitioner would gather the cache whole onto every
    device for a custom call)."""
    operands = _operands(8, 4, 2, 64, 128)
    mesh = Mesh(np.array(jax.devices()[:4]), ("data",))
    rows = NamedSharding(mesh, P("data"))
    auto = functools.partial(attention.cached_query_attention, impl=AttentionImpl.AUTO)
    local = jax.jit(jax.shard_map(auto, mesh=mesh, in_specs=P("data"), out_specs=P("data")))
    name = cpu_decode_attention.target()
    assert name in local.lower(*operands).as_text()
    assert "all-gather" not in local.lower(*operands).compile().as_text()
    got = np.asarray(local(*(jax.device_put(x, rows) for x in operands)))
    want = np.asarray(jax.jit(cpu_decode_attention.decode_attention)(*operands))
    np.testing.assert_array_equal(got, want)
    with jax.set_mesh(mesh):
        assert name not in jax.jit(auto).lower(*operands).as_text()
    assert jax.device_count() > 1  # and no mesh in scope: the arrays may lie on several devices
    assert name not in jax.jit(auto).lower(*operands).as_text()


@needs_compiler
def test_native_build_is_kept_and_failures_say_why(tmp_path, monkeypatch):
    monkeypatch.setenv("JAXRLHF_KERNEL_CACHE", str(tmp_path / "kernels"))
    source = tmp_path / "answer.cc"
    source.write_text('extern "C" int answer() { return 42; }\n')
    library = native.build(source)
    assert library.parent == tmp_path / "kernels" / native.host_key()
    assert stat.S_IMODE(os.stat(library.parent).st_mode) == 0o700  # it holds code we load
    built = library.stat().st_mtime_ns
    assert native.build(source) == library and library.stat().st_mtime_ns == built  # kept
    source.write_text('extern "C" int answer() { return 43; }\n')
    assert native.build(source) != library  # a changed source builds anew

    source.write_text("int answer( {\n")
    with pytest.raises(native.BuildError, match="failed on answer.cc: .*error"):
        native.build(source)
    assert not list(library.parent.glob("*.tmp"))  # no partial library left behind
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv("CXX", raising=False)
    with pytest.raises(native.BuildError, match="no C.. compiler"):
        native.build(source)
