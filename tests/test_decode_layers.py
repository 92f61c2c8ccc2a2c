"""Decoding layer by layer (`engine.decode_layers`, the token loop on XLA:CPU and XLA:GPU) computes what the
scanned stack computes: the one-query attention against the cache, the model's cached steps,
and whole sampled generations (same tokens, log-probs within fp32 rounding), unsharded and with
the kv heads split over devices."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrlhf.engine import decode_layers
from jaxrlhf.engine.decode_layers import LayerByLayer, segment_ends
from jaxrlhf.engine.generate import GenerateConfig, decode_model, generate
from jaxrlhf.models import attention
from jaxrlhf.models.attention import AttentionImpl
from jaxrlhf.models.sizes import abstract_params, get_size
from jaxrlhf.models.transformer import KVCache, Transformer
from jaxrlhf.parallel.layout import make_layout

_CONFIG = get_size("tiny", dtype=jnp.float32, num_layers=3)  # 4 heads over 2 kv heads


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("per_row", [False, True])
def test_cached_query_attention_equals_the_reference(dtype, per_row):
    """Left padding, a padding query row, GQA, a traced slot (one for all rows, or each row's
    own): as `_xla_attention` with q_len 1 on the [b, S, k, d] cache (fp32 to rounding; bf16 to
    one bf16 step, its probabilities rounded alike)."""
    batch, slots, heads, kv_heads, dim = 3, 9, 4, 2, 8
    keys = jax.random.split(jax.random.key(0), 3)
    q_b1hd = jax.random.normal(keys[0], (batch, 1, heads, dim), dtype)
    k_bskd, v_bskd = (jax.random.normal(k, (batch, slots, kv_heads, dim), dtype)
                      for k in keys[1:])
    (cache,) = decode_layers.split_cache(KVCache(k_bskd[None], v_bskd[None]))
    kv_seg_bs = jnp.asarray([[0, 0, 1, 1, 1, 1, 1, 1, 1], [1] * 9, [0] * 9], jnp.int32)
    q_seg_b1 = jnp.asarray([[1], [1], [0]], jnp.int32)
    tol = dict(rtol=1e-6, atol=1e-6) if dtype == jnp.float32 else dict(rtol=1e-2, atol=1e-2)
    for slot in ((2, 6, 4), (6, 3, 8)) if per_row else (2, 6):
        slot = jnp.asarray(slot, jnp.int32)
        got = jax.jit(attention.cached_query_attention)(q_b1hd, *cache, q_seg_b1, kv_seg_bs, slot)
        want = jax.jit(attention._xla_attention)(q_b1hd, k_bskd, v_bskd, q_seg_b1, kv_seg_bs,
                                                 slot)
        assert got.dtype == want.dtype == dtype
        np.testing.assert_allclose(np.asarray(got[:2], np.float32),
                                   np.asarray(want[:2], np.float32), **tol)


def _params():
    tokens = jnp.zeros((1, 4), jnp.int32)
    variables = Transformer(_CONFIG).init(jax.random.key(0), tokens, tokens, tokens + 1)
    return nn.unbox(variables["params"])


@pytest.mark.parametrize("split", [decode_layers.split_cache, decode_layers.layer_caches])
def test_cached_steps_equal_the_scanned_stack(split):
    """Prefill (stacked cache, stacked or split params), then single-token steps on per-layer
    caches (tiled `DecodeKV`s, or [1, b, S, k, d] `KVCache`s read by `dot_product_attention`):
    the scanned stack's logits and caches, to fp32 rounding."""
    params = _params()
    tokens_bt = jax.random.randint(jax.random.key(1), (2, 7), 1, _CONFIG.vocab_size)
    positions_bt = jnp.broadcast_to(jnp.arange(7), (2, 7))
    segments_bt = jnp.ones((2, 7), jnp.int32)
    scanned, by_layer = Transformer(_CONFIG), Transformer(_CONFIG, LayerByLayer())

    def run(model, params, split):
        cache = KVCache.zeros(_CONFIG, batch=2, cache_len=7)
        out, cache = model.apply({"params": params}, tokens_bt[:, :4], positions_bt[:, :4],
                                 segments_bt[:, :4], cache, 0, segments_bt)
        steps = [out]
        if split:
            cache, params = split(cache), decode_layers.split_params(params)
        for t in range(4, 7):
            out, cache = model.apply({"params": params}, tokens_bt[:, t:t + 1],
                                     positions_bt[:, t:t + 1], segments_bt[:, t:t + 1], cache,
                                     t, segments_bt)
            steps.append(out)
        cache = decode_layers.stack_cache(cache) if split else cache
        return jnp.concatenate(steps, axis=1), cache

    want_logits, want_cache = jax.jit(run, static_argnums=(0, 2))(scanned, params, None)
    for prefill_params in (params, decode_layers.split_params(params)):
        got_logits, got_cache = jax.jit(run, static_argnums=(0, 2))(by_layer, prefill_params,
                                                                    split)
        np.testing.assert_allclose(got_logits, want_logits, rtol=1e-5, atol=1e-5)
        jax.tree.map(lambda g, w: np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5),
                     got_cache, want_cache)


@pytest.mark.devices(8)
@pytest.mark.parametrize("spec,new", [("0-0:d1", 7), ("0-7:d4t2", 7), ("0-7:d4t2", 40)])
def test_sampled_generation_equals_the_scanned_stack(spec, new):
    """A sampled, ragged, left-padded generation on `decode_model`'s stack (layer by layer on
    XLA:CPU; at d4t2 each device holds one kv head; with 40 new tokens its caches grow once,
    after 20) draws the scanned stack's tokens, with its log-probs to fp32 rounding."""
    assert segment_ends(new) == {7: (7,), 40: (20, 40)}[new]
    layout = make_layout(spec, model=_CONFIG)
    model = decode_model(_CONFIG, layout)
    assert isinstance(model.layer_stack, LayerByLayer)
    params = jax.device_put(_params(), layout.param_shardings(abstract_params(_CONFIG)))
    prompt_bp = jax.random.randint(jax.random.key(2), (8, 6), 1, _CONFIG.vocab_size)
    mask_bp = jnp.asarray([[0, 0, 0, 1, 1, 1], [1] * 6, [0, 0, 0, 0, 0, 1], [0, 1, 1, 1, 1, 1]]
                          * 2, bool)
    cfg = GenerateConfig(max_new_tokens=new, eos_token_id=-1, pad_token_id=0, temperature=0.8)
    rows = layout.batch_sharding(2)

    def run(model):
        fn = jax.jit(lambda p, t, m: generate(model, cfg, p, t, m, jax.random.key(3)))
        with layout.activation_context():
            return fn(params, *jax.device_put((prompt_bp, mask_bp), rows))

    got, want = run(model), run(Transformer(_CONFIG))
    np.testing.assert_array_equal(got.response_bn, want.response_bn)
    np.testing.assert_allclose(got.logprobs_bn, want.logprobs_bn, rtol=1e-5, atol=1e-5)


@pytest.mark.devices(8)
def test_decode_model_keeps_the_scan_with_fsdp():
    """With fsdp every token all-gathers each layer's weights anyway; unrolled, all layers'
    gathered weights would be live at once: that layout decodes with the scanned stack."""
    unrolled = _CONFIG.replace(scan_layers=False)
    model = decode_model(unrolled, make_layout("0-7:d2f4", model=unrolled))
    assert model.layer_stack is None and model.config.scan_layers


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU")
def test_gpu_generation_decodes_layer_by_layer_and_equals_the_scanned_stack():
    """On one GPU the generate call decodes layer by layer (`decodes_layer_by_layer`), its
    tiled caches read by XLA's products although AUTO resolves to cuDNN: a sampled, ragged,
    left-padded fp32 generation draws the scanned stack's tokens (which prefills and decodes
    with cuDNN or its XLA fallback), log-probs to fp32 rounding."""
    config = _CONFIG.replace(attention=AttentionImpl.AUTO)
    layout = make_layout("0-0:d1", model=config)
    model = decode_model(config, layout)
    assert isinstance(model.layer_stack, LayerByLayer)
    params = _params()
    prompt_bp = jax.random.randint(jax.random.key(2), (8, 6), 1, config.vocab_size)
    mask_bp = jnp.asarray([[0, 0, 0, 1, 1, 1], [1] * 6, [0, 0, 0, 0, 0, 1], [0, 1, 1, 1, 1, 1]]
                          * 2, bool)
    cfg = GenerateConfig(max_new_tokens=40, eos_token_id=-1, pad_token_id=0, temperature=0.8)
    run = lambda model: jax.jit(lambda p, t, m: generate(model, cfg, p, t, m, jax.random.key(3)))(
        params, prompt_bp, mask_bp)
    with jax.default_matmul_precision("highest"):  # fp32 products, not TF32, on both sides
        got, want = run(model), run(Transformer(config))
    np.testing.assert_array_equal(got.response_bn, want.response_bn)
    np.testing.assert_allclose(got.logprobs_bn, want.logprobs_bn, rtol=1e-5, atol=1e-5)
