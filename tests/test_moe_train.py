"""A train step of a model with experts: its loss adds the router's load-balancing loss and
z-loss at their coefficients (models/moe.py) and reports them and the expert load, on several
layouts, equal to a one-device reference written from the definitions."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxrlhf.engine import microbatch as mb
from jaxrlhf.engine import optimizer as opt
from jaxrlhf.engine import train_step as ts
from jaxrlhf.models.moe import MoeConfig
from jaxrlhf.models.sizes import abstract_params, get_size
from jaxrlhf.models.transformer import Transformer
from jaxrlhf.parallel.layout import make_layout
from test_train_step import logits_ce, make_batch, token_ce

MODEL = get_size("tiny", num_kv_heads=4, dtype=jnp.float32, num_layers=3,
                 moe=MoeConfig(num_experts=8, top_k=2, expert_intermediate_size=32,
                               dense_layers=(1,), aux_loss_coef=0.5, z_loss_coef=0.1))
OPT = opt.OptimizerConfig(lr=1e-2, warmup_steps=0, total_steps=2, eps=1e-3, max_grad_norm=1e9)


def _host_params():
    rng = np.random.default_rng(0)  # random values on the abstract tree: no init to compile
    return jax.tree.map(lambda a: (0.2 * rng.standard_normal(a.shape)).astype(np.float32),
                        nn.meta.unbox(abstract_params(MODEL)))


def _reference(params, batch):
    """CE + 0.5 * balance + 0.1 * z over the batch's valid tokens, from the definitions:
    balance = E * sum_e f_e P_e (f_e: share of tokens choosing e, P_e: mean probability),
    z = mean logsumexp(router logits)^2, each averaged over the sparse layers."""
    cfg = MODEL.moe

    def objective(p):
        # The sparse blocks' inputs: the post-attention norms' outputs, stacked over layers.
        is_ffn_norm = lambda mdl, _: mdl.name == "post_attention_layernorm"
        (logits, _), sown = Transformer(MODEL).apply(
            {"params": p}, batch["tokens_bt"], batch["positions_bt"], batch["segment_ids_bt"],
            mutable=["intermediates"], capture_intermediates=is_ffn_norm)
        loss_sum, weight = logits_ce(logits, batch)
        layers = sown["intermediates"]["layers"]
        (routes_lbtk,), (x_lbtd,) = layers["routes"], layers["post_attention_layernorm"][
            "__call__"]
        valid = batch["segment_ids_bt"].reshape(-1) != 0
        balance, z = [], []
        for layer in (0, 2):  # the sparse layers
            x_td = x_lbtd[layer].reshape(-1, MODEL.hidden_size)[valid]
            logits_te = x_td @ p["layers"]["moe"]["router"][layer]
            chosen_te = jax.nn.one_hot(routes_lbtk[layer].reshape(-1, cfg.top_k)[valid],
                                       cfg.num_experts).sum(1)
            probs_te = jax.nn.softmax(logits_te)
            balance.append(cfg.num_experts * jnp.sum(chosen_te.mean(0) * probs_te.mean(0)))
            z.append(jnp.mean(jax.nn.logsumexp(logits_te, axis=-1) ** 2))
        balance, z = jnp.mean(jnp.stack(balance)), jnp.mean(jnp.stack(z))
        return loss_sum / weight + cfg.aux_loss_coef * balance + cfg.z_loss_coef * z, (
            balance, z)

    (loss, (balance, z)), grads = jax.jit(jax.value_and_grad(objective, has_aux=True))(params)
    return float(loss), float(balance), float(z), grads


@pytest.mark.devices(8)
@pytest.mark.parametrize("spec,micro", [
    pytest.param("0-0:d1", None, marks=pytest.mark.slow),  # ~19 s; tests/unit/test_moe.py: the block
    pytest.param("0-3:d2t2", 2, marks=pytest.mark.slow),  # ~20 s: micro-batches, sharded
])
def test_train_step_adds_router_losses(spec, micro):
    params = _host_params()
    batch = make_batch(3)
    ref_loss, ref_balance, ref_z, ref_grads = _reference(params, batch)
    layout = make_layout(spec, model=MODEL)
    state = ts.create_train_state(params, MODEL, layout, OPT)
    micro_cfg = mb.MicrobatchConfig() if micro is None else mb.MicrobatchConfig.by_count(micro)
    step = ts.make_train_step(MODEL, layout, token_ce, OPT, micro_cfg)
    new_state, metrics = step(state, batch)
    if micro is None:  # the router terms are per forward: one forward, the batch's values
        np.testing.assert_allclose(metrics["moe_balance_loss"], ref_balance, rtol=1e-5)
        np.testing.assert_allclose(metrics["moe_z_loss"], ref_z, rtol=1e-5)
        np.testing.assert_allclose(metrics["loss"], ref_loss, rtol=1e-5)
        # One AdamW step from the reference gradient (no clipping, no decay).
        optimizer = opt.make_optimizer(OPT)
        updates, _ = optimizer.update(ref_grads, optimizer.init(params), params,
                                      grad_norm=optax.tree.norm(ref_grads))
        expected = optax.apply_updates(params, updates)
        jax.tree.map(lambda a, e: np.testing.assert_allclose(np.asarray(a), e, atol=2e-5,
                                                             rtol=0),
                     new_state.params, expected)
    else:
        assert 0 < float(metrics["moe_balance_loss"]) and 0 < float(metrics["moe_z_loss"])
    load = float(metrics["moe_min_load"])
    assert 0 <= load <= 1
