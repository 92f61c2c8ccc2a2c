"""kernels/tpu_attention.py (JAX's splash attention on TPU): its numbers against the pure-jnp
reference and XLA in Pallas interpret mode on CPU (fp32), sharded over a CPU mesh; compiled for
a TPU topology (v5p:2x2x1, libtpu's compiler, no TPU needed) inside sharded jits as the layouts,
the pipeline and the rollout engine run it; and which operands fall back to XLA."""

import logging
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxrlhf.kernels import tpu_attention
from jaxrlhf.kernels.reference import reference_attention
from jaxrlhf.models.attention import (
    AttentionImpl, _xla_attention, cached_query_attention, dot_product_attention,
)
from jaxrlhf.models.decode_kv import DecodeKV
from jaxrlhf.parallel.layout import make_layout

_TOL = dict(rtol=1e-5, atol=1e-5)


def _qkv(rng, batch, q_len, k_len, heads, kv_heads, head_dim=16, dtype=jnp.float32):
    normal = lambda *shape: jnp.asarray(rng.normal(size=shape), dtype)
    return (normal(batch, q_len, heads, head_dim), normal(batch, k_len, kv_heads, head_dim),
            normal(batch, k_len, kv_heads, head_dim))


def _real(seg_bt):
    """bool [b, t, 1, 1]: queries of a real token (padding queries' outputs are meaningless)."""
    return (np.asarray(seg_bt) != 0)[:, :, None, None]


# Row 0: left padding then two packed segments; row 1: one segment then right padding.
_SEG_20 = np.array([[0] * 3 + [1] * 10 + [2] * 7, [1] * 15 + [0] * 5], np.int32)


def test_causal_values_and_grads_match_xla():
    """Packing + left and right padding, GQA 2, 20 tokens (padded to a 128-slot block inside,
    head_dim 16): outputs and all three gradients at real queries; padding queries finite."""
    rng = np.random.default_rng(0)
    q, k, v = _qkv(rng, 2, 20, 20, 4, 2)
    seg = jnp.asarray(_SEG_20)
    real = _real(seg)
    d_out = jnp.where(real, jnp.asarray(rng.normal(size=q.shape), jnp.float32), 0.0)
    splash = lambda q, k, v: tpu_attention.attention(q, k, v, seg, seg, interpret=True)
    out, splash_vjp = jax.vjp(splash, q, k, v)
    want, xla_vjp = jax.vjp(lambda q, k, v: _xla_attention(q, k, v, seg, seg, 0), q, k, v)
    assert np.isfinite(out).all()
    np.testing.assert_allclose(np.where(real, out, 0), np.where(real, want, 0), **_TOL)
    for name, got, ref in zip("qkv", splash_vjp(d_out), xla_vjp(d_out)):
        np.testing.assert_allclose(got, ref, **_TOL, err_msg=f"d{name}")


def test_bf16_values_and_grads_at_any_matmul_precision():
    """bfloat16 runs forward and backward at DEFAULT precision whatever the suite sets
    ('highest', which Mosaic rejects for bf16 operands): within bf16 rounding of XLA in fp32
    on the same inputs (1% of each array's largest entry)."""
    rng = np.random.default_rng(4)
    q, k, v = _qkv(rng, 2, 20, 20, 4, 2, dtype=jnp.bfloat16)
    seg = jnp.asarray(_SEG_20)
    real = _real(seg)
    loss = lambda attend: lambda q, k, v: jnp.sum(
        jnp.where(real, attend(q, k, v), 0).astype(jnp.float32) * jnp.arange(16.0))
    splash = lambda q, k, v: tpu_attention.attention(q, k, v, seg, seg, interpret=True)
    xla = lambda q, k, v: _xla_attention(q, k, v, seg, seg, 0)
    with jax.default_matmul_precision("highest"):
        got = jax.value_and_grad(loss(splash), argnums=(0, 1, 2))(q, k, v)
    want = jax.value_and_grad(loss(xla), argnums=(0, 1, 2))(
        *(x.astype(jnp.float32) for x in (q, k, v)))
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.float32(g), w, rtol=0, atol=1e-2 * np.abs(w).max())


@pytest.mark.parametrize("q_offset", [0, 9])
def test_prefill_against_longer_cache(q_offset):
    """12 queries from slot `q_offset` of a 140-slot cache (two key blocks after padding) whose
    slots after the prompt are marked real but not yet written: causality hides them. GQA 4."""
    rng = np.random.default_rng(1)
    q, k, v = _qkv(rng, 2, 12, 140, 4, 1)
    q_seg = jnp.asarray([[0] * 4 + [1] * 8, [1] * 12], jnp.int32)
    kv_seg = jnp.concatenate([jnp.zeros((2, q_offset), jnp.int32).at[1].set(1), q_seg,
                              jnp.ones((2, 128 - q_offset), jnp.int32)], axis=1)
    out = tpu_attention.attention(q, k, v, q_seg, kv_seg, q_offset, interpret=True)
    want = reference_attention(q, k, v, q_seg, kv_seg, jnp.full((2,), q_offset, jnp.int32))
    np.testing.assert_allclose(np.where(_real(q_seg), out, 0), np.where(_real(q_seg), want, 0),
                               **_TOL)


def _decode_case(rng):
    """Decode as the engines run it: one query per row at its own slot of a 40-slot cache,
    left-padded prompts (segment 0 first), every response slot marked 1 up front (written or
    not); row 2 a finished slot (its query segment 0). GQA 4 over 2 kv heads."""
    q, k, v = _qkv(rng, 3, 1, 40, 8, 2)
    kv_seg = jnp.asarray([[0] * 5 + [1] * 35, [1] * 40, [0] * 30 + [1] * 10], jnp.int32)
    q_seg = jnp.asarray([[1], [1], [0]], jnp.int32)
    return q, k, v, q_seg, kv_seg, jnp.asarray([20, 39, 33], jnp.int32)


def test_decode_at_traced_per_row_slots():
    q, k, v, q_seg, kv_seg, slot_b = _decode_case(np.random.default_rng(2))
    step = jax.jit(lambda q_offset: tpu_attention.attention(q, k, v, q_seg, kv_seg, q_offset,
                                                            interpret=True))
    out = step(slot_b)
    np.testing.assert_allclose(out[:2], reference_attention(q, k, v, q_seg, kv_seg, slot_b)[:2],
                               **_TOL)
    assert np.isfinite(out).all()
    # A scalar traced slot: every row's query there.
    slot = jnp.asarray(25, jnp.int32)
    np.testing.assert_allclose(
        step(slot)[:2], reference_attention(q, k, v, q_seg, kv_seg, jnp.full((3,), 25))[:2],
        **_TOL)


def test_several_queries_at_traced_per_row_slots():
    """5 queries per row at traced slots 0, 17 and 38 of a 40-slot cache (row 2's last ones
    past its end), as a pipeline's prefill gets them: outputs and gradients as XLA's."""
    rng = np.random.default_rng(5)
    q, k, v = _qkv(rng, 3, 5, 40, 4, 2)
    q_seg = jnp.asarray([[0, 0, 1, 1, 1], [1] * 5, [2] * 5], jnp.int32)
    kv_seg = jnp.asarray([[0] * 2 + [1] * 38, [1] * 40, [0] * 10 + [2] * 30], jnp.int32)
    slot_b = jnp.asarray([0, 17, 38], jnp.int32)
    real = _real(q_seg)
    d_out = jnp.where(real, jnp.asarray(rng.normal(size=q.shape), jnp.float32), 0.0)

    @jax.jit
    def both(q, k, v, slot_b):
        splash = lambda q, k, v: tpu_attention.attention(q, k, v, q_seg, kv_seg, slot_b,
                                                         interpret=True)
        xla = lambda q, k, v: _xla_attention(q, k, v, q_seg, kv_seg, slot_b)
        return [(out, vjp(d_out)) for out, vjp in (jax.vjp(f, q, k, v) for f in (splash, xla))]

    (out, grads), (want, want_grads) = both(q, k, v, slot_b)
    assert np.isfinite(out).all()
    np.testing.assert_allclose(np.where(real, out, 0), np.where(real, want, 0), **_TOL)
    for name, got, ref in zip("qkv", grads, want_grads):
        np.testing.assert_allclose(got, ref, **_TOL, err_msg=f"d{name}")


def test_sharded_over_a_cpu_mesh_matches_unsharded():
    """Rows over "data", heads and kv heads over "tensor" (shard_map, each device its own):
    the same numbers as one call over everything, for the causal path and decode."""
    mesh = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("data", "tensor"))
    rng = np.random.default_rng(3)
    q, k, v = _qkv(rng, 2, 20, 20, 4, 2)
    seg = jnp.asarray(_SEG_20)
    dq, dk, dv, dq_seg, dkv_seg, slot_b = _decode_case(rng)
    dq, dk, dv = (x[:2] for x in (dq, dk, dv))
    dq_seg, dkv_seg, slot_b = dq_seg[:2], dkv_seg[:2], slot_b[:2]

    def both(q, k, v, dq, dk, dv, slot_b):
        run = lambda *args: tpu_attention.attention(*args, batch_axes=("data",),
                                                    head_axes=("tensor",), interpret=True)
        return run(q, k, v, seg, seg, 0), run(dq, dk, dv, dq_seg, dkv_seg, slot_b)

    with jax.set_mesh(mesh):
        got = jax.jit(both)(q, k, v, dq, dk, dv, slot_b)
    want = jax.jit(both)(q, k, v, dq, dk, dv, slot_b)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, **_TOL)


@pytest.mark.parametrize("dtype,q_len,q_offset,precision,reason", [
    (jnp.float32, 20, 0, "highest", None),
    (jnp.float32, 1, "traced", "default", None),
    (jnp.bfloat16, 1, "traced", "tensorfloat32", None),
    (jnp.float16, 20, 0, None, "takes float32 or bfloat16 on TPU, got float16"),
    (jnp.float32, 7, "traced", None, None),
    (jnp.float32, 20, -1, None, "q_offset=-1 < 0"),
    (jnp.float32, 20, 0, "tensorfloat32", "jax_default_matmul_precision='tensorfloat32'"),
])
def test_fallback_reasons(dtype, q_len, q_offset, precision, reason):
    """Exactly these fall back to XLA: float16 (Mosaic cannot load it), a negative static
    offset, float32 at a matmul precision Mosaic lacks. Odd lengths and head dims never do
    (padded; a block spans the whole head), nor queries at traced slots, one or several."""
    q = jax.ShapeDtypeStruct((2, q_len, 4, 100), dtype)
    offset = jnp.zeros((2,), jnp.int32) if q_offset == "traced" else q_offset
    with jax.default_matmul_precision(precision):
        got = tpu_attention.fallback_reason(q, offset)
    assert got is None if reason is None else reason in got, got


# --- compiled for a TPU topology ------------------------------------------------------------


@pytest.fixture(scope="module")
def tpu_devices(libtpu):
    """The 4 devices of a described v5p:2x2x1 slice (compile only: libtpu's compiler; the
    `libtpu` fixture skips without it, naming the extra, and fails under CI=true)."""
    from jax.experimental import topologies

    return topologies.get_topology_desc(platform="tpu", topology_name="v5p:2x2x1").devices


def _compiled_hlo(fn, layout, *args) -> str:
    with layout.activation_context():
        return jax.jit(fn).lower(*args).compile().as_text()


def _abstract(layout, shape, logical, dtype=jnp.bfloat16):
    return jax.ShapeDtypeStruct(shape, dtype, sharding=layout.sharding(logical))


_Q = ("batch", "length", "act_heads", "head_dim")
_KV = ("batch", "length", "act_kv_heads", "head_dim")
_ROWS = ("batch", "length")


def _assert_local_kernels(hlo: str, count: int):
    """`count` Mosaic calls and no collective: each device ran the kernel on its own rows and
    heads, nothing was gathered."""
    assert hlo.count('custom_call_target="tpu_custom_call"') == count, hlo
    assert not re.findall(r"all-gather|all-to-all|collective-permute|all-reduce", hlo)


@pytest.mark.tpu_compile
def test_train_compiles_for_tpu_on_each_device(tpu_devices):
    """d2t2: 4 rows over data, 4 heads / 2 kv heads over tensor, 200 tokens; the forward, and
    jax.grad through it (splash's dQ and dK/dV kernels)."""
    layout = make_layout("d2t2", devices=tpu_devices)
    args = (_abstract(layout, (4, 200, 4, 128), _Q), _abstract(layout, (4, 200, 2, 128), _KV),
            _abstract(layout, (4, 200, 2, 128), _KV), _abstract(layout, (4, 200), _ROWS, jnp.int32))
    attend = lambda q, k, v, seg: dot_product_attention(q, k, v, seg, seg,
                                                        impl=AttentionImpl.AUTO)
    _assert_local_kernels(_compiled_hlo(attend, layout, *args), 1)
    loss = lambda q, k, v, seg: jnp.sum(attend(q, k, v, seg).astype(jnp.float32) ** 2)
    hlo = _compiled_hlo(jax.grad(loss, argnums=(0, 1, 2)), layout, *args)
    # dK/dV come out per device: 2 rows, 1 kv head, 200 slots padded to 256.
    assert re.search(r"splash_mha_dkv\S*\s*=\s*\(\S*\s*\S*\s*bf16\[2,1,256,128\]", hlo), hlo
    _assert_local_kernels(hlo, 3)


@pytest.mark.tpu_compile
def test_decode_compiles_for_tpu_on_each_device(tpu_devices):
    """A decode step at per-row traced slots of a 300-slot cache, and the same through a
    layer's `DecodeKV` cache (`cached_query_attention`)."""
    layout = make_layout("d2t2", devices=tpu_devices)
    q = _abstract(layout, (4, 1, 4, 64), _Q, jnp.float32)
    cache = _abstract(layout, (4, 300, 2, 64), _KV, jnp.float32)
    segs = (_abstract(layout, (4, 1), _ROWS, jnp.int32),
            _abstract(layout, (4, 300), _ROWS, jnp.int32))
    slot_b = _abstract(layout, (4,), ("batch",), jnp.int32)
    step = lambda q, k, v, q_seg, kv_seg, slot_b: dot_product_attention(
        q, k, v, q_seg, kv_seg, slot_b, impl=AttentionImpl.AUTO)
    _assert_local_kernels(_compiled_hlo(step, layout, q, cache, cache, *segs, slot_b), 1)

    def layer_cache_step(q, k, v, q_seg, kv_seg, slot_b):
        kv = DecodeKV.from_stacked(k, v)
        return cached_query_attention(q, kv.k_bkcdi, kv.v_bksd, q_seg, kv_seg, slot_b,
                                      impl=AttentionImpl.AUTO)

    hlo = _compiled_hlo(layer_cache_step, layout, q, cache, cache, *segs, slot_b)
    assert hlo.count('custom_call_target="tpu_custom_call"') == 1


@pytest.mark.tpu_compile
def test_compiles_inside_pipeline_vmap_and_engine_shard_map(tpu_devices):
    """Inside `jax.vmap(spmd_axis_name="pipeline")` (a pipeline's stages, p2t2) the stage
    axis is split too; inside a shard_map over every axis (the rollout engine, d4) the kernel
    runs as written, with no shard_map of its own."""
    layout = make_layout("p2t2", devices=tpu_devices)
    staged = lambda logical: ("stages",) + logical
    args = (_abstract(layout, (2, 2, 128, 4, 128), staged(_Q)),
            _abstract(layout, (2, 2, 128, 2, 128), staged(_KV)),
            _abstract(layout, (2, 2, 128, 2, 128), staged(_KV)),
            _abstract(layout, (2, 2, 128), staged(_ROWS), jnp.int32))
    attend = lambda q, k, v, seg: dot_product_attention(q, k, v, seg, seg,
                                                        impl=AttentionImpl.AUTO)
    stages = jax.vmap(attend, spmd_axis_name="pipeline")
    loss = lambda *args: jnp.sum(stages(*args).astype(jnp.float32))
    _assert_local_kernels(_compiled_hlo(jax.grad(loss, argnums=(0, 1, 2)), layout, *args), 3)

    layout = make_layout("d4", devices=tpu_devices)
    rows = layout.spec(("batch",))

    def engine_step(q, k, v, q_seg, kv_seg, slot_b):
        with nn.logical_axis_rules(()):  # as the engine's shard_map body runs
            return dot_product_attention(q, k, v, q_seg, kv_seg, slot_b, impl=AttentionImpl.AUTO)

    on_each = jax.shard_map(engine_step, mesh=layout.mesh, in_specs=(rows,) * 6,
                            out_specs=rows, check_vma=False)
    batch = lambda shape, dtype=jnp.float32: jax.ShapeDtypeStruct(
        shape, dtype, sharding=NamedSharding(layout.mesh, PartitionSpec(*rows)))
    hlo = _compiled_hlo(on_each, layout, batch((8, 1, 4, 64)), batch((8, 200, 2, 64)),
                        batch((8, 200, 2, 64)), batch((8, 1), jnp.int32),
                        batch((8, 200), jnp.int32), batch((8,), jnp.int32))
    _assert_local_kernels(hlo, 1)


@pytest.mark.tpu_compile
def test_fallback_runs_xla_with_one_warning(tpu_devices, caplog):
    """float16 on TPU: XLA's attention, no Mosaic call, one warning naming the reason."""
    layout = make_layout("d2t2", devices=tpu_devices)
    args = (_abstract(layout, (4, 128, 4, 64), _Q, jnp.float16),
            _abstract(layout, (4, 128, 2, 64), _KV, jnp.float16),
            _abstract(layout, (4, 128, 2, 64), _KV, jnp.float16),
            _abstract(layout, (4, 128), _ROWS, jnp.int32))
    attend = lambda q, k, v, seg: dot_product_attention(q, k, v, seg, seg,
                                                        impl=AttentionImpl.AUTO)
    with caplog.at_level(logging.WARNING):
        hlo = _compiled_hlo(attend, layout, *args)
    assert "tpu_custom_call" not in hlo
    warnings = [r.getMessage() for r in caplog.records if "falls back to xla" in r.getMessage()]
    assert warnings == ["attention=pallas falls back to xla on TPU: splash attention takes "
                        "float32 or bfloat16 on TPU, got float16"]
