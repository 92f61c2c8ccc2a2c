"""The mixture-of-experts block (models/moe.py): sorted-group dispatch against a per-token
reference, forward and gradients; routing and replayed routing; the router statistics; no
[tokens, experts, ...] intermediate; a mixed dense/sparse model equal scanned and unrolled; the
planner's sizes of the released MoE checkpoints."""

import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrlhf.engine import replay
from jaxrlhf.engine.decode_layers import LayerByLayer
from jaxrlhf.models import grouped_experts, moe
from jaxrlhf.models.sizes import (
    abstract_params, get_size, matmul_params, param_count, stored_param_count,
)
from jaxrlhf.models.transformer import Transformer

T, D, F, E, K = 10, 16, 12, 6, 2


def _weights(seed=0):
    keys = jax.random.split(jax.random.key(seed), 5)
    x_td = jax.random.normal(keys[0], (T, D))
    gate, up = (jax.random.normal(k, (E, D, F)) / np.sqrt(D) for k in keys[1:3])
    down = jax.random.normal(keys[3], (E, F, D)) / np.sqrt(F)
    logits = jax.random.normal(keys[4], (T, E))
    return x_td, gate, up, down, logits


def _reference(x_td, routing, gate, up, down):
    """Every token through every expert, weighed by its routing weight (0 for an expert it
    did not choose): the dense form the block avoids."""
    h_ted = jax.nn.silu(jnp.einsum("td,edf->tef", x_td, gate)) * jnp.einsum(
        "td,edf->tef", x_td, up)
    y_ted = jnp.einsum("tef,efd->ted", h_ted, down)
    weight_te = jnp.sum(jax.nn.one_hot(routing.experts_tk, E) * routing.weights_tk[..., None],
                        axis=1)
    return jnp.einsum("ted,te->td", y_ted, weight_te)


def test_grouped_dispatch_equals_per_token_reference():
    x_td, gate, up, down, logits = _weights()
    routing = moe.route(logits, K, norm_topk_prob=True)
    np.testing.assert_allclose(jax.jit(grouped_experts.experts_swiglu)(x_td, routing, gate, up, down),
                               jax.jit(_reference)(x_td, routing, gate, up, down), atol=1e-5,
                               rtol=0)

    def loss(fn, x_td, gate, up, down, logits):
        r = moe.route(logits, K, norm_topk_prob=False)
        return jnp.sum(jnp.sin(fn(x_td, r, gate, up, down)))

    args = (x_td, gate, up, down, logits)
    ours = jax.jit(jax.grad(lambda *a: loss(grouped_experts.experts_swiglu, *a), argnums=range(5)))(*args)
    ref = jax.jit(jax.grad(lambda *a: loss(_reference, *a), argnums=range(5)))(*args)
    for a, b in zip(ours, ref):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=0)


def test_route_top_k_and_replay():
    _, _, _, _, logits = _weights()
    probs = jax.nn.softmax(logits)
    free = moe.route(logits, K, norm_topk_prob=False)
    np.testing.assert_array_equal(free.experts_tk, np.argsort(-probs, axis=-1)[:, :K])
    np.testing.assert_allclose(free.weights_tk, np.sort(probs, axis=-1)[:, ::-1][:, :K],
                               rtol=1e-6)
    normed = moe.route(logits, K, norm_topk_prob=True)
    np.testing.assert_allclose(normed.weights_tk.sum(-1), 1.0, rtol=1e-6)
    # Replay: the given experts are used whatever the router prefers; weights follow it.
    given = jnp.stack([jnp.arange(T) % E, (jnp.arange(T) + 3) % E], axis=1)
    replayed = moe.route(logits, K, norm_topk_prob=True, experts_tk=given)
    np.testing.assert_array_equal(replayed.experts_tk, given)
    picked = np.take_along_axis(np.asarray(probs), np.asarray(given), axis=1)
    np.testing.assert_allclose(replayed.weights_tk, picked / picked.sum(-1, keepdims=True),
                               rtol=1e-6)


def test_router_stats():
    # An even router: every probability 1/E, each expert chosen by the same number of tokens.
    n = 2 * E
    logits = jnp.zeros((n, E))
    experts = jnp.stack([jnp.arange(n) % E, (jnp.arange(n) + 1) % E], axis=1)
    stats = moe.router_stats(logits, experts, jnp.ones(n, bool))
    np.testing.assert_allclose(stats.balance_loss, K, rtol=1e-6)  # HF's form: k when even
    np.testing.assert_allclose(stats.z_loss, np.log(E) ** 2, rtol=1e-6)
    np.testing.assert_allclose(stats.load_e, np.full(E, 1 / E), rtol=1e-6)
    # Padding does not count: all valid tokens on experts 0 and 1.
    valid = jnp.arange(n) < 4
    skew = jnp.where(valid[:, None], jnp.array([0, 1]), experts)
    stats = moe.router_stats(logits, skew, valid)
    np.testing.assert_allclose(stats.load_e, [0.5, 0.5, 0, 0, 0, 0], atol=1e-7)
    np.testing.assert_allclose(stats.balance_loss, E * (1 + 1) / E, rtol=1e-6)


def test_blocked_grouped_matmul_equals_ragged_dot():
    """XLA:CPU's grouped matmul (blocks of rows) against `ragged_dot` (on CPU, JAX's dense
    masked form): empty groups, a group over several blocks, forward and gradients."""
    rng = np.random.default_rng(3)
    sizes = jnp.array([0, 37, 1, 0, 9, 17], jnp.int32)
    x = jnp.asarray(rng.standard_normal((int(sizes.sum()), D)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((len(sizes), D, F)), jnp.float32)
    ours = jax.jit(grouped_experts.blocked_grouped_matmul)(x, w, sizes)
    np.testing.assert_allclose(ours, jax.lax.ragged_dot(x, w, sizes), atol=1e-5, rtol=0)
    loss = lambda fn: lambda x, w: jnp.sum(jnp.sin(fn(x, w, sizes)))
    for a, b in zip(jax.jit(jax.grad(loss(grouped_experts.blocked_grouped_matmul), argnums=(0, 1)))(x, w),
                    jax.grad(loss(jax.lax.ragged_dot), argnums=(0, 1))(x, w)):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=0)


def test_no_tokens_by_experts_intermediate():
    """The compiled train-step block (forward and backward, on this backend) holds no array
    with both an experts dim E and a token-assignment dim T*k: the work follows the k chosen
    experts, not all E."""
    x_td, gate, up, down, logits = _weights()

    def block(x_td, gate, up, down, logits):
        return grouped_experts.experts_swiglu(x_td, moe.route(logits, K, True), gate, up, down)

    grad = jax.jit(jax.grad(lambda *a: jnp.sum(block(*a)), argnums=(0, 1)))
    hlo = grad.lower(x_td, gate, up, down, logits).compile().as_text()
    shapes = {tuple(int(n) for n in dims.split(",") if n)
              for dims in re.findall(r"[fsu]\d+\[([\d,]*)\]", hlo)}
    big = [s for s in shapes if E in s and T * K in s and len(s) > 2]
    assert not big, big
    assert any(len(s) == 3 for s in shapes)  # the parse sees the block's 3-D arrays


@pytest.mark.parametrize("dense_layers", [pytest.param((), marks=pytest.mark.slow), (0, 2)])
def test_model_scanned_equals_layer_by_layer(dense_layers):
    """A mixed model picks each layer's block by its index: traced in the scan (both run, one
    kept), static layer by layer; the logits agree and the gradient of an unused slot is 0."""
    cfg = get_size("tiny", dtype=jnp.float32, num_layers=3,
                   moe=moe.MoeConfig(E, K, F, dense_layers=dense_layers))
    tokens = jax.random.randint(jax.random.key(1), (2, 7), 1, cfg.vocab_size)
    pos = jnp.broadcast_to(jnp.arange(7), (2, 7))
    seg = jnp.ones((2, 7), jnp.int32)
    rng = np.random.default_rng(0)  # random values on the abstract tree: no init to compile
    params = jax.tree.map(lambda a: jnp.asarray(0.3 * rng.standard_normal(a.shape), a.dtype),
                          nn.meta.unbox(abstract_params(cfg)))
    forward = lambda stack: jax.jit(lambda p: Transformer(cfg, stack).apply(
        {"params": p}, tokens, pos, seg)[0])(params)
    scanned, unrolled = forward(None), forward(LayerByLayer())
    np.testing.assert_allclose(scanned, unrolled, atol=1e-5, rtol=0)
    if dense_layers:
        grads = jax.jit(jax.grad(lambda p: Transformer(cfg).apply({"params": p}, tokens, pos,
                                                                  seg)[0].sum()))(params)
        experts = np.asarray(grads["layers"]["moe"]["gate_proj"])
        mlp = np.asarray(grads["layers"]["mlp"]["gate_proj"]["kernel"])
        assert not experts[list(dense_layers)].any() and experts[1].any()
        assert not mlp[1].any() and all(mlp[i].any() for i in dense_layers)


def test_released_moe_sizes():
    """Totals and active parameters of the released checkpoints (their model cards: 30.5B /
    3.3B, 235B / 22B, 46.7B / 12.9B; active = the matmuls plus the embedding)."""
    for name, total, active in (("qwen3-30b-a3b", 30.5e9, 3.3e9),
                                ("qwen3-235b-a22b", 235.1e9, 22.2e9),
                                ("mixtral-8x7b", 46.7e9, 12.9e9)):
        cfg = get_size(name)
        embedding = cfg.vocab_size * cfg.hidden_size
        assert param_count(cfg) == pytest.approx(total, rel=0.005), name
        assert stored_param_count(cfg) == param_count(cfg)
        assert matmul_params(cfg) + embedding == pytest.approx(active, rel=0.02), name


def test_stored_params_of_a_mixed_model_leave_out_the_zero_slots():
    cfg = get_size("tiny", num_layers=3, moe=moe.MoeConfig(E, K, F, dense_layers=(1,)))
    d, f = cfg.hidden_size, cfg.intermediate_size
    expected = param_count(cfg) - E * (1 + 3 * F) * d - 2 * 3 * d * f
    assert stored_param_count(cfg) == expected


def test_lora_on_experts_is_refused():
    from jaxrlhf.models.lora import LoraConfig, LoraTarget

    attention = LoraConfig(4, 8.0, (LoraTarget.Q_PROJ,))
    get_size("tiny-moe", lora=attention)  # accepted
    with pytest.raises(ValueError, match="attention projections only"):
        get_size("tiny-moe", lora=LoraConfig(4, 8.0, (LoraTarget.Q_PROJ, LoraTarget.UP_PROJ)))


def test_replayed_routes_are_used_and_their_mismatch_counted():
    """Replaying the experts a forward chose gives that forward's logits and no mismatch;
    replaying other experts uses exactly those (the sown routes), the router still gets a
    gradient, and `routing_mismatch` counts the tokens whose own choice differs."""
    cfg = get_size("tiny", dtype=jnp.float32, num_layers=3,
                   moe=moe.MoeConfig(E, K, F, dense_layers=(1,)))
    tokens = jax.random.randint(jax.random.key(2), (2, 7), 1, cfg.vocab_size)
    pos = jnp.broadcast_to(jnp.arange(7), (2, 7))
    seg = jnp.ones((2, 7), jnp.int32).at[1, 5:].set(0)
    rng = np.random.default_rng(1)
    params = jax.tree.map(lambda a: jnp.asarray(0.3 * rng.standard_normal(a.shape), a.dtype),
                          nn.meta.unbox(abstract_params(cfg)))

    @jax.jit
    def forward(p, routes_lbtk):
        (logits, _), sown = Transformer(cfg).apply({"params": p}, tokens, pos, seg,
                                                   routes_lbtk=routes_lbtk,
                                                   mutable=["intermediates"])
        return logits, sown["intermediates"]["layers"]

    free, sown = jax.jit(lambda p: forward(p, None))(params)
    recorded = np.asarray(sown["routes"][0])
    replayed, sown = forward(params, recorded)
    np.testing.assert_allclose(replayed, free, atol=1e-6, rtol=0)
    assert not np.asarray(sown["route_changed"][0]).any()

    other = (recorded + 1) % E  # every sparse layer's choice shifted by one expert
    logits, sown = forward(params, other)
    np.testing.assert_array_equal(np.asarray(sown["routes"][0])[[0, 2]], other[[0, 2]])
    changed = np.asarray(sown["route_changed"][0])
    assert changed[[0, 2]].all() and not changed[1].any()  # layer 1 is dense
    counts = lambda layers: replay.changed_counts({"intermediates": {"layers": layers}},
                                                  jnp.asarray(other), seg != 0, replayed=True)
    np.testing.assert_allclose(replay.mismatch(counts(sown)), 1.0)
    unchanged = {**sown, "route_changed": (np.zeros_like(changed),)}
    assert float(replay.mismatch(counts(unchanged))) == 0.0
    assert not np.allclose(logits, free, atol=1e-3)
    router_grad = jax.grad(lambda p: forward(p, other)[0].sum())(params)["layers"]["moe"]["router"]
    assert np.asarray(router_grad)[[0, 2]].any()
