"""Pallas attention kernels vs their pure-jnp reference, in interpret mode on CPU (fp32, and bf16
for the paged kernel), and compiled on a GPU (`-m gpu`)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrlhf.kernels.decode_attention import DecodeConfig, decode_attention
from jaxrlhf.kernels.flash_attention import FlashConfig, flash_attention
from jaxrlhf.kernels.paged_decode_attention import PagedDecodeConfig, paged_decode_attention
from jaxrlhf.kernels.reference import paged_reference_attention, reference_attention

_TOL = dict(rtol=1e-5, atol=1e-5)


def _qkv(rng, batch, q_len, k_len, heads, kv_heads, head_dim=8):
    normal = lambda *shape: jnp.asarray(rng.normal(size=shape), jnp.float32)
    return (normal(batch, q_len, heads, head_dim), normal(batch, k_len, kv_heads, head_dim),
            normal(batch, k_len, kv_heads, head_dim))


# Row 0: left padding then two packed segments; row 1: one segment then right padding;
# row 2: all padding (its queries see nothing and must come out as zeros, not NaN).
_SEG_20 = np.array([[0] * 3 + [1] * 10 + [2] * 7, [1] * 15 + [0] * 5, [0] * 20], np.int32)


@pytest.mark.parametrize("heads,kv_heads", [(1, 1), pytest.param(3, 1, marks=pytest.mark.slow)])
def test_flash_values_and_grads_match_reference(heads, kv_heads):
    """Causal + packing + padding, 20 tokens in blocks of 8 (not a divisor), GQA 1 and 2."""
    rng = np.random.default_rng(heads)
    q, k, v = _qkv(rng, 3, 20, 20, heads, kv_heads)
    seg = jnp.asarray(_SEG_20)
    cfg = FlashConfig(block_q=8, block_k=8, interpret=True)
    out, kernel_vjp = jax.vjp(lambda q, k, v: flash_attention(q, k, v, seg, seg, cfg), q, k, v)
    ref, ref_vjp = jax.vjp(lambda q, k, v: reference_attention(q, k, v, seg, seg), q, k, v)
    np.testing.assert_allclose(out, ref, **_TOL)
    assert not np.any(out[2]), "an all-padding row must output zeros"

    d_out = jnp.asarray(rng.normal(size=out.shape), jnp.float32)
    for name, g, r in zip("qkv", kernel_vjp(d_out), ref_vjp(d_out)):
        np.testing.assert_allclose(g, r, **_TOL, err_msg=f"d{name}")


def test_flash_prefill_against_longer_cache():
    """Prefill: 12 prompt queries against a 20-slot cache whose tail is not yet written;
    head_dim 12 is zero-padded to 16 inside."""
    rng = np.random.default_rng(7)
    q, k, v = _qkv(rng, 2, 12, 20, 4, 1, head_dim=12)
    q_seg = jnp.asarray([[0] * 4 + [1] * 8, [1] * 12], jnp.int32)
    kv_seg = jnp.concatenate([q_seg, jnp.ones((2, 8), jnp.int32)], axis=1)
    out = flash_attention(q, k, v, q_seg, kv_seg,
                          FlashConfig(block_q=8, block_k=16, interpret=True))
    np.testing.assert_allclose(out, reference_attention(q, k, v, q_seg, kv_seg), **_TOL)


def test_flash_rejects_bad_head_ratio():
    q, k, v = _qkv(np.random.default_rng(0), 1, 8, 8, 3, 2)
    seg = jnp.ones((1, 8), jnp.int32)
    with pytest.raises(ValueError, match="heads=3 is not a multiple of kv_heads=2"):
        flash_attention(q, k, v, seg, seg, FlashConfig(interpret=True))


@pytest.mark.parametrize("q_len,heads,kv_heads", [pytest.param(1, 4, 1, marks=pytest.mark.slow),
                                                  (2, 2, 2)])
def test_decode_ragged_matches_reference(q_len, heads, kv_heads):
    """Ragged prefixes over a 19-slot cache in blocks of 4 (the last one overhangs)."""
    rng = np.random.default_rng(q_len)
    batch, cache_len = 4, 19
    q, k, v = _qkv(rng, batch, q_len, cache_len, heads, kv_heads)
    kv_len_b = jnp.asarray([5, 19, 11, 7], jnp.int32)
    q_start_b = kv_len_b - q_len
    kv_seg = np.ones((batch, cache_len), np.int32)
    kv_seg[0, :2] = 0  # left padding
    kv_seg[3, :] = 0  # an all-padding row
    q_seg = np.ones((batch, q_len), np.int32)
    q_seg[3] = 0
    kv_seg, q_seg = jnp.asarray(kv_seg), jnp.asarray(q_seg)
    out = decode_attention(q, k, v, q_seg, kv_seg, q_start_b, kv_len_b,
                           DecodeConfig(block_k=4, interpret=True))
    ref = reference_attention(q, k, v, q_seg, kv_seg, q_start_b, kv_len_b)
    np.testing.assert_allclose(out, ref, **_TOL)
    assert not np.any(out[3]), "an all-padding row must output zeros"


def test_decode_never_reads_past_the_prefix():
    """NaN in every cache block past a row's prefix must not reach the output."""
    rng = np.random.default_rng(3)
    q, k, v = _qkv(rng, 2, 1, 16, 2, 1)
    kv_len_b = jnp.asarray([5, 3], jnp.int32)  # blocks of 4: slots >= 8 are never loaded
    seg = jnp.ones((2, 16), jnp.int32)
    poison = lambda x: x.at[:, 8:].set(jnp.nan)
    out = decode_attention(q, poison(k), poison(v), seg[:, :1], seg, kv_len_b - 1, kv_len_b,
                           DecodeConfig(block_k=4, interpret=True))
    ref = reference_attention(q, k, v, seg[:, :1], seg, kv_len_b - 1, kv_len_b)
    np.testing.assert_allclose(out, ref, **_TOL)


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="compiles the kernels for a GPU")
def test_kernels_compiled_on_gpu_match_reference():
    """The same kernels lowered for the GPU (not interpreted), bf16, power-of-two blocks."""
    rng = np.random.default_rng(11)
    bf16 = lambda x: x.astype(jnp.bfloat16)
    q, k, v = map(bf16, _qkv(rng, 2, 256, 256, 8, 2, head_dim=64))
    seg = jnp.asarray(np.repeat([[1, 2], [1, 0]], 128, axis=1), jnp.int32)
    out = flash_attention(q, k, v, seg, seg, FlashConfig(block_q=64, block_k=64))
    ref = reference_attention(q, k, v, seg, seg)
    np.testing.assert_allclose(out.astype(np.float32), ref.astype(np.float32), atol=2e-2)
    grads = jax.grad(lambda q: jnp.sum(flash_attention(q, k, v, seg, seg).astype(jnp.float32)))(q)
    want = jax.grad(lambda q: jnp.sum(reference_attention(q, k, v, seg, seg).astype(jnp.float32)))(q)
    np.testing.assert_allclose(grads.astype(np.float32), want.astype(np.float32), atol=5e-2)

    kv_len_b = jnp.asarray([100, 256], jnp.int32)
    q1 = q[:, :1]
    out = decode_attention(q1, k, v, seg[:, :1], seg, kv_len_b - 1, kv_len_b,
                           DecodeConfig(block_k=64))
    ref = reference_attention(q1, k, v, seg[:, :1], seg, kv_len_b - 1, kv_len_b)
    np.testing.assert_allclose(out.astype(np.float32), ref.astype(np.float32), atol=2e-2)


@pytest.mark.parametrize("kernel", ["flash", "decode", "paged"])
def test_an_unused_kernel_call_is_dead_code(kernel):
    """A kernel call whose output nobody reads drops out of a traced program, as any jnp op
    does. flax >= 0.12.10's nn.scan traces the layer body that way and rejects one whose kept
    equations read the carry; a bare pallas_call (never dead to JAX) in the decode step made the
    scanned decoder fail there."""
    from jax._src.interpreters import partial_eval as pe  # what nn.scan runs; no public API

    rng = np.random.default_rng(0)
    q, k, v = _qkv(rng, 2, 1, 16, 2, 1)
    seg = jnp.ones((2, 16), jnp.int32)
    kv_len_b = jnp.asarray([9, 16], jnp.int32)
    call = {"flash": lambda q, k, v: flash_attention(q, k, v, seg[:, :1], seg,
                                                     FlashConfig(q_offset=15, interpret=True)),
            "decode": lambda q, k, v: decode_attention(q, k, v, seg[:, :1], seg, kv_len_b - 1,
                                                       kv_len_b, DecodeConfig(interpret=True)),
            "paged": lambda q, k, v: paged_decode_attention(
                q, k.reshape(8, 4, 1, 8), v.reshape(8, 4, 1, 8), jnp.arange(8).reshape(2, 4),
                kv_len_b - 1, kv_len_b, PagedDecodeConfig(interpret=True))}
    closed = jax.make_jaxpr(lambda q, k, v: (call[kernel](q, k, v), q.sum())[1])(q, k, v)
    _, used = pe.dce_jaxpr(closed.jaxpr, [True])
    assert used == [True, False, False], "the unused kernel call still reads k and v"


def _kernel_block_shapes(fn, *args) -> list[tuple[int, ...]]:
    """Shapes of every block load/store inside the Pallas kernels `fn` runs."""
    shapes = []

    def walk(jaxpr, in_kernel):
        for eqn in jaxpr.eqns:
            if in_kernel and eqn.primitive.name in ("get", "swap"):
                shapes.extend(v.aval.shape for v in eqn.outvars)
            for param in eqn.params.values():
                inner = getattr(param, "jaxpr", param)  # ClosedJaxpr or Jaxpr
                if hasattr(inner, "eqns"):
                    walk(inner, in_kernel or eqn.primitive.name == "pallas_call")

    walk(jax.make_jaxpr(fn)(*args).jaxpr, False)
    return shapes


@pytest.mark.parametrize("cache_len", [11, 24, 40])
def test_decode_blocks_are_powers_of_two_for_any_cache_length(cache_len):
    """Triton (the GPU lowering) takes only power-of-two blocks, >= 16 for its matmuls: a
    cache of prompt + new tokens is rarely a power of two (ppo_tiny's is 24). Checked on the
    kernel as the GPU would lower it, and the values in interpret mode."""
    rng = np.random.default_rng(cache_len)
    q, k, v = _qkv(rng, 2, 1, cache_len, 4, 2, head_dim=16)
    seg = jnp.ones((2, cache_len), jnp.int32)
    kv_len_b = jnp.asarray([cache_len - 5, cache_len], jnp.int32)
    call = lambda q, k, v, interpret: decode_attention(
        q, k, v, seg[:, :1], seg, kv_len_b - 1, kv_len_b, DecodeConfig(interpret=interpret))
    shapes = _kernel_block_shapes(lambda q, k, v: call(q, k, v, False), q, k, v)
    assert shapes and all(d >= 1 and d & (d - 1) == 0 for s in shapes for d in s), shapes
    assert all(min(s) >= 16 for s in shapes if len(s) == 2), shapes
    ref = reference_attention(q, k, v, seg[:, :1], seg, kv_len_b - 1, kv_len_b)
    np.testing.assert_allclose(call(q, k, v, True), ref, **_TOL)


# --- paged decode ---------------------------------------------------------------------------

_PAGED_TOL = dict(rtol=1e-5, atol=1e-6)


def _paged_case(rng, page_size, q_len, heads, kv_heads, head_dim=8, dtype=jnp.float32):
    """Five rows over a shuffled pool of pages, 4 pages per row, lengths ragged: 0 (a free
    slot), q_len (the queries alone, from slot 0), a page boundary exactly, a chunk of queries before the row's end (the
    causal edge inside the prefix), the whole table. Rows 1 and 2 share their first page (a
    GRPO group's prompt). Table entries past a row's live pages and every page no live slot
    uses point at (or are) `dead_pages`, which the kernel must never read.

    Returns q, k_pages, v_pages, page_table_bp, q_start_b, kv_lengths_b, dead_pages.
    """
    batch, pages_per_row = 5, 4
    kv_len_b = np.array([0, q_len, 2 * page_size, 3 * page_size - 1, 4 * page_size], np.int32)
    q_start_b = kv_len_b - q_len
    q_start_b[3] = page_size + 1  # queries at slots page_size + 1 ...: later live keys hidden
    num_pages = batch * pages_per_row + 2
    order = rng.permutation(num_pages)
    table_bp = order[:batch * pages_per_row].reshape(batch, pages_per_row).astype(np.int32)
    table_bp[2, 0] = table_bp[1, 0]
    live = [int(-(-min(n, s + q_len) // page_size)) for n, s in zip(kv_len_b, q_start_b)]
    dead = sorted(set(range(num_pages)) - {int(table_bp[b, j]) for b in range(batch)
                                            for j in range(live[b])})
    for b in range(batch):
        table_bp[b, live[b]:] = dead[0]
    normal = lambda *shape: jnp.asarray(rng.normal(size=shape), dtype)
    pool = (num_pages, page_size, kv_heads, head_dim)
    return (normal(batch, q_len, heads, head_dim), normal(*pool), normal(*pool),
            jnp.asarray(table_bp), jnp.asarray(q_start_b), jnp.asarray(kv_len_b), dead)


@pytest.mark.parametrize("page_size,q_len,heads,kv_heads", [
    (4, 1, 4, 1), (8, 2, 4, 2), (16, 1, 6, 2), (16, 3, 2, 2)])
def test_paged_decode_matches_reference(page_size, q_len, heads, kv_heads):
    """Ragged lengths over shuffled, partly shared pages; GQA groups of 1 to 4; several page
    sizes and query counts."""
    rng = np.random.default_rng(page_size * 10 + q_len)
    q, k, v, table_bp, q_start_b, kv_len_b, _ = _paged_case(rng, page_size, q_len, heads,
                                                            kv_heads)
    out = paged_decode_attention(q, k, v, table_bp, q_start_b, kv_len_b,
                                 PagedDecodeConfig(interpret=True))
    ref = paged_reference_attention(q, k, v, table_bp, q_start_b, kv_len_b)
    np.testing.assert_allclose(out, ref, **_PAGED_TOL)
    assert not np.any(out[0]), "a row of length 0 must output zeros"
    assert np.all(np.any(out[1:] != 0, axis=-1)), "every query of a live row sees a key"


def test_paged_decode_never_reads_dead_pages():
    """NaN in every page no live slot lives in (table entries past a row's live pages point
    at one) must not reach the output."""
    rng = np.random.default_rng(5)
    q, k, v, table_bp, q_start_b, kv_len_b, dead = _paged_case(rng, 8, 1, 4, 2)
    poison = lambda x: x.at[jnp.asarray(dead)].set(jnp.nan)
    out = paged_decode_attention(q, poison(k), poison(v), table_bp, q_start_b, kv_len_b,
                                 PagedDecodeConfig(interpret=True))
    ref = paged_reference_attention(q, k, v, table_bp, q_start_b, kv_len_b)
    np.testing.assert_allclose(out, ref, **_PAGED_TOL)


def test_paged_decode_bf16_matches_reference():
    """bf16 pages and queries (what a rollout engine keeps), fp32 accumulation in both."""
    rng = np.random.default_rng(9)
    q, k, v, table_bp, q_start_b, kv_len_b, _ = _paged_case(rng, 16, 1, 8, 2, head_dim=64,
                                                            dtype=jnp.bfloat16)
    out = paged_decode_attention(q, k, v, table_bp, q_start_b, kv_len_b,
                                 PagedDecodeConfig(interpret=True))
    ref = paged_reference_attention(q, k, v, table_bp, q_start_b, kv_len_b)
    assert out.dtype == jnp.bfloat16
    np.testing.assert_allclose(out.astype(np.float32), ref.astype(np.float32), atol=2e-2)


def test_paged_reference_is_the_contiguous_reference():
    """The paged reference gathers each row's pages in table order: against the contiguous
    reference on rows assembled page by page here."""
    rng = np.random.default_rng(2)
    q, k, v, table_bp, q_start_b, kv_len_b, _ = _paged_case(rng, 4, 2, 4, 2)
    rows = lambda pages: jnp.asarray(np.stack([np.concatenate([pages[p] for p in row])
                                               for row in np.asarray(table_bp)]))
    seg = jnp.ones((5, table_bp.shape[1] * 4), jnp.int32)
    want = reference_attention(q, rows(np.asarray(k)), rows(np.asarray(v)), seg[:, :2], seg,
                               q_start_b, kv_len_b)
    np.testing.assert_array_equal(
        paged_reference_attention(q, k, v, table_bp, q_start_b, kv_len_b), want)


def test_paged_decode_blocks_are_powers_of_two():
    """As the GPU would lower it: every page load is [page_size, head_dim], powers of two."""
    rng = np.random.default_rng(4)
    q, k, v, table_bp, q_start_b, kv_len_b, _ = _paged_case(rng, 16, 1, 6, 2, head_dim=16)
    shapes = _kernel_block_shapes(
        lambda q, k, v: paged_decode_attention(q, k, v, table_bp, q_start_b, kv_len_b), q, k, v)
    assert (16, 16) in shapes, shapes
    assert all(d >= 1 and d & (d - 1) == 0 for s in shapes for d in s), shapes
    assert all(min(s) >= 16 for s in shapes if len(s) == 2), shapes


@pytest.mark.parametrize("page_size,head_dim", [(8, 16), (24, 16), (16, 12)])
def test_paged_decode_compiled_rejects_pages_triton_cannot_load(page_size, head_dim):
    rng = np.random.default_rng(0)
    q, k, v, table_bp, q_start_b, kv_len_b, _ = _paged_case(rng, page_size, 1, 2, 1, head_dim)
    with pytest.raises(ValueError, match="needs (page_size|head_dim) a power of two"):
        paged_decode_attention(q, k, v, table_bp, q_start_b, kv_len_b)


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="compiles the kernels for a GPU")
@pytest.mark.parametrize("page_size", [16, 64])
def test_paged_decode_compiled_on_gpu_matches_reference(page_size):
    """The paged kernel lowered for the GPU (not interpreted), bf16, GQA 4, ragged rows."""
    rng = np.random.default_rng(page_size)
    q, k, v, table_bp, q_start_b, kv_len_b, _ = _paged_case(rng, page_size, 1, 8, 2, head_dim=64,
                                                            dtype=jnp.bfloat16)
    out = paged_decode_attention(q, k, v, table_bp, q_start_b, kv_len_b)
    ref = paged_reference_attention(q, k, v, table_bp, q_start_b, kv_len_b)
    np.testing.assert_allclose(out.astype(np.float32), ref.astype(np.float32), atol=2e-2)


@pytest.fixture
def triton_lowering():
    """GPU lowering through Triton, which these kernels are written for: jax 0.11 lowers a GPU
    pallas_call to Triton, jax 0.10 to Mosaic GPU unless `jax_pallas_use_mosaic_gpu` is off."""
    name = "jax_pallas_use_mosaic_gpu"
    if name not in jax.config.values:
        yield
        return
    before = jax.config.values[name]
    jax.config.update(name, False)
    try:
        yield
    finally:
        jax.config.update(name, before)


def _gpu_lowering_cases():
    """kernel -> (function, abstract bf16 arguments at a 1B model's head shapes, how many
    Triton kernels it lowers to)."""
    bf16, i32, s = jnp.bfloat16, jnp.int32, jax.ShapeDtypeStruct
    q1, rows = s((4, 1, 6, 64), bf16), s((4,), i32)
    qkv = (s((2, 128, 8, 64), bf16), s((2, 128, 2, 64), bf16), s((2, 128, 2, 64), bf16))
    seg = (s((2, 128), i32),) * 2
    cache, pool = s((4, 24, 2, 64), bf16), s((40, 16, 2, 64), bf16)
    flash_loss = lambda q, k, v, sq, sk: jnp.sum(flash_attention(q, k, v, sq, sk)
                                                 .astype(jnp.float32))
    return {
        "flash": (flash_attention, (*qkv, *seg), 1),
        "flash_grads": (jax.grad(flash_loss, argnums=(0, 1, 2)), (*qkv, *seg), 3),
        "decode": (decode_attention, (q1, cache, cache, s((4, 1), i32), s((4, 24), i32), rows,
                                      rows), 1),
        "paged": (paged_decode_attention, (q1, pool, pool, s((4, 10), i32), rows, rows), 1),
    }


@pytest.mark.parametrize("kernel", ["flash", "flash_grads", "decode", "paged"])
def test_kernels_lower_for_a_gpu(kernel, triton_lowering):
    """Each kernel lowered for a GPU here, without one: Pallas turns it into Triton IR, which
    refuses blocks of sizes other than powers of two and ops Triton lacks; the decode kernels
    with a cache length (24) that is not a power of two, the paged one reading page ids from
    its table and pages at a dynamic index, GQA group 3."""
    fn, args, n_kernels = _gpu_lowering_cases()[kernel]
    text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("xla.gpu.triton") == n_kernels, text[:2000]
