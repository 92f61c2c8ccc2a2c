"""Model sizes (ReaL Table 1, exact) and the decoder's own invariants.

HF logit parity lives in test_hf_io.py; here: the size registry, scan vs unrolled layers,
remat policies, heads, and KV-cache decoding against a full forward pass.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrlhf.models.config import HeadKind, RematPolicy
from jaxrlhf.models.sizes import get_size, param_count, param_count_without_output_embedding
from jaxrlhf.models.transformer import KVCache, Transformer

# ReaL, Table 1: (TotalParamCount, ParamCount w/o. Output Embedding).
TABLE_1 = {
    "llama3-7b": (8030261248, 7504924672),
    "llama3-13b": (14001525760, 13344855040),
    "llama3-34b": (35321028608, 34270355456),
    "llama3-70b": (70553706496, 69503033344),
}


@pytest.mark.parametrize("name", TABLE_1)
def test_param_counts_equal_real_table_1(name):
    config = get_size(name)
    assert param_count(config) == TABLE_1[name][0]
    assert param_count_without_output_embedding(config) == TABLE_1[name][1]


def test_unknown_size_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown model size 'llama9'"):
        get_size("llama9")


def _inputs(batch=2, length=7, vocab=272):
    tokens = jax.random.randint(jax.random.key(1), (batch, length), 0, vocab)
    positions = jnp.broadcast_to(jnp.arange(length), (batch, length))
    return tokens, positions, jnp.ones((batch, length), jnp.int32)


def _forward(config, params=None):
    """Jitted: eager flax dispatches op by op and is many times slower on CPU."""
    model = Transformer(config)
    tokens, positions, segments = _inputs()
    if params is None:
        params = jax.jit(model.init)(jax.random.key(0), tokens, positions, segments)["params"]
    return jax.jit(model.apply)({"params": params}, tokens, positions, segments)[0], params


def test_unrolled_and_remat_layers_equal_scanned():
    base = get_size("tiny", dtype=jnp.float32)
    want, params = _forward(base)
    for variant in (base.replace(scan_layers=False), base.replace(remat=RematPolicy.FULL),
                    base.replace(remat=RematPolicy.DOTS)):
        got, _ = _forward(variant, params)
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


@pytest.mark.slow
def test_remat_gradients_equal():
    base = get_size("tiny", dtype=jnp.float32)
    _, params = _forward(base)
    tokens, positions, segments = _inputs()

    def loss(p, config):
        return jnp.mean(Transformer(config).apply({"params": p}, tokens, positions, segments)[0])

    grad = jax.jit(jax.grad(loss), static_argnums=1)
    want = grad(params, base)
    got = grad(params, base.replace(remat=RematPolicy.FULL))
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-7)


def test_scalar_head_gives_one_value_per_token():
    values, params = _forward(get_size("tiny", dtype=jnp.float32, head=HeadKind.SCALAR))
    assert values.shape == (2, 7) and values.dtype == jnp.float32
    assert "score" in params and "lm_head" not in params
    np.testing.assert_array_equal(values, 0.0)  # the value head starts at zero


def test_bf16_compute_returns_fp32_logits_close_to_fp32():
    config = get_size("tiny", dtype=jnp.float32)
    want, params = _forward(config)
    got, _ = _forward(config.replace(dtype=jnp.bfloat16), params)
    assert got.dtype == jnp.float32
    np.testing.assert_allclose(got, want, atol=0.05)


@pytest.mark.slow  # generation tests cover the cache through the engine
def test_cached_decoding_equals_full_forward():
    """Prefill 4 tokens, then decode 3 one at a time: same logits as one full pass."""
    config = get_size("tiny", dtype=jnp.float32)
    model = Transformer(config)
    want, params = _forward(config)
    tokens, positions, segments = _inputs()
    apply = jax.jit(model.apply)
    cache = KVCache.zeros(config, batch=2, cache_len=7)
    kv_segments = jnp.ones((2, 7), jnp.int32)
    out, cache = apply({"params": params}, tokens[:, :4], positions[:, :4], segments[:, :4],
                       cache=cache, cache_index=0, kv_segment_ids_bs=kv_segments)
    steps = [out]
    for t in range(4, 7):  # cache_index is traced: one compile serves every decode step
        out, cache = apply({"params": params}, tokens[:, t:t + 1], positions[:, t:t + 1],
                           segments[:, t:t + 1], cache=cache, cache_index=t,
                           kv_segment_ids_bs=kv_segments)
        steps.append(out)
    np.testing.assert_allclose(jnp.concatenate(steps, axis=1), want, rtol=1e-5, atol=1e-5)


def test_flat_matmul_and_dense_match_einsum_and_nn_dense():
    """The 2-D dots the model uses (for XLA:CPU's backward) equal the einsums they replace,
    and `Dense` keeps nn.Dense's parameter tree and initial values (checkpoints stay valid)."""
    import flax.linen as nn

    from jaxrlhf.models.transformer import Dense, flat_matmul

    x_bthk = jax.random.normal(jax.random.key(0), (2, 3, 4, 5))
    kernel_hkd = jax.random.normal(jax.random.key(1), (4, 5, 6))
    np.testing.assert_allclose(flat_matmul(x_bthk, kernel_hkd, 2),
                               jnp.einsum("bthk,hkd->btd", x_bthk, kernel_hkd),
                               rtol=1e-6, atol=1e-6)
    config = get_size("tiny", dtype=jnp.float32)
    x_btd = jax.random.normal(jax.random.key(2), (2, 3, config.hidden_size))
    ours = Dense(config, 8, ("embed", "mlp"))
    theirs = nn.Dense(8, use_bias=False, kernel_init=nn.initializers.normal(0.02))
    params = nn.unbox(ours.init(jax.random.key(3), x_btd))
    np.testing.assert_array_equal(params["params"]["kernel"],
                                  theirs.init(jax.random.key(3), x_btd)["params"]["kernel"])
    np.testing.assert_allclose(ours.apply(params, x_btd), theirs.apply(params, x_btd),
                               rtol=1e-6, atol=1e-6)
