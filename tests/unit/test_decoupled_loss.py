"""AReaL's decoupled PPO objective for PPO and GRPO, against independent numpy loops.

The loss (jaxrlhf.algorithms.losses with `proximal_logp_bn`) clips u = π_θ/π_prox and weights
each token by π_prox/π_behav; jaxrlhf.algorithms.decoupled adds the `actor_prox` call that
computes π_prox and routes it to the actor's train step. References are float64 loops on the
same float32 inputs; padding holds nan on purpose.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrlhf import algorithms as alg
from jaxrlhf.algorithms import decoupled, ppo
from jaxrlhf.algorithms.spec import TrainSpec, policy_readout
from jaxrlhf.engine.inference import InferenceBatch, readout
from jaxrlhf.mfc import Call, Role
from jaxrlhf.schema import base_config
from jaxrlhf.spec import ConfigError, run_spec

TOL = dict(rtol=1e-6, atol=1e-6)
LENGTHS = (5, 1, 8, 0, 3)
N = 8


def _mask():
    mask = np.zeros((len(LENGTHS), N), np.float32)
    for b, length in enumerate(LENGTHS):
        mask[b, :length] = 1
    return mask


def _inputs(seed):
    rng = np.random.default_rng(seed)
    mask = _mask()
    behav = (-rng.random(mask.shape) * 2).astype(np.float32)
    prox = (behav + 0.4 * rng.standard_normal(mask.shape)).astype(np.float32)
    logp = (prox + 0.5 * rng.standard_normal(mask.shape)).astype(np.float32)
    ref = (behav + 0.3 * rng.standard_normal(mask.shape)).astype(np.float32)
    adv = rng.standard_normal(mask.shape).astype(np.float32)
    return logp, behav, prox, ref, adv, mask


def _nan_pad(x, mask):
    return jnp.asarray(np.where(mask > 0, x, np.nan).astype(np.float32))


def _np_token_loss(logp, behav, prox, adv, eps, cap):
    """One token's decoupled loss: −(π_prox/π_behav)·min(u·A, clip(u)·A), u = π_θ/π_prox."""
    u = math.exp(float(logp) - float(prox))
    surrogate = min(u * adv, min(max(u, 1 - eps), 1 + eps) * adv)
    w = math.exp(float(prox) - float(behav))
    return -surrogate * (w if cap is None or w <= cap else 0.0), w


@pytest.mark.parametrize("cap", [None, 1.3])
def test_grpo_decoupled_loss_matches_loop(cap):
    logp, behav, prox, ref, adv, mask = _inputs(21)
    config = alg.GRPOLossConfig(
        policy=alg.PPOLossConfig(clip_eps=0.2, behav_imp_weight_cap=cap,
                                 aggregation=alg.LossAggregation.SEQ_MEAN_TOKEN_MEAN),
        kl_coef=0.05)
    loss_sum, weight, stats = jax.jit(alg.grpo_loss, static_argnums=5)(
        _nan_pad(logp, mask), _nan_pad(behav, mask), _nan_pad(ref, mask), _nan_pad(adv, mask),
        jnp.asarray(mask), config, proximal_logp_bn=_nan_pad(prox, mask))
    want, want_w, dropped = 0.0, 0.0, 0
    for b, length in enumerate(LENGTHS):
        row, row_w = 0.0, 0.0
        for t in range(length):
            token, w = _np_token_loss(logp[b, t], behav[b, t], prox[b, t], float(adv[b, t]), 0.2,
                                      cap)
            log_r = float(ref[b, t]) - float(logp[b, t])
            row += token + 0.05 * (math.exp(log_r) - 1 - log_r)
            kept = cap is None or w <= cap
            row_w += w if kept else 0.0
            dropped += not kept
        if length:
            want += row / length
            want_w += row_w / length
    np.testing.assert_allclose(float(loss_sum), want, **TOL)
    np.testing.assert_allclose(float(stats["behav_imp_weight"]), want_w, **TOL)
    assert float(weight) == 4  # the empty row has no say
    assert (dropped > 0) == (cap is not None)  # the cap really drops tokens at 1.3


def test_ppo_decoupled_gradient_is_weighted_proximal_gradient():
    # d/dlogπ_θ of the decoupled loss = (π_prox/π_behav) × the standard loss's gradient taken
    # with π_prox as the old policy: the weight is a constant, the trust region is π_prox's.
    logp, behav, prox, _, adv, mask = _inputs(22)
    config = alg.PPOLossConfig(clip_eps=0.2)
    m = jnp.asarray(mask)
    decoupled_grad = jax.grad(lambda lp: alg.ppo_policy_loss(
        lp, _nan_pad(behav, mask), _nan_pad(adv, mask), m, config,
        proximal_logp_bn=_nan_pad(prox, mask))[0])(_nan_pad(logp, mask))
    standard_grad = jax.grad(lambda lp: alg.ppo_policy_loss(
        lp, _nan_pad(prox, mask), _nan_pad(adv, mask), m, config)[0])(_nan_pad(logp, mask))
    weight = np.where(mask > 0, np.exp(prox.astype(np.float64) - behav), 0.0)
    np.testing.assert_allclose(np.asarray(decoupled_grad), weight * np.asarray(standard_grad),
                               rtol=1e-5, atol=1e-7)
    assert np.count_nonzero(np.asarray(decoupled_grad)) > 0


def test_on_policy_decoupled_equals_standard():
    # Fresh data: π_prox = π_behav, so the decoupled loss is PPO's exactly.
    logp, behav, _, _, adv, mask = _inputs(23)
    config = alg.PPOLossConfig(clip_eps=0.2)
    args = (_nan_pad(logp, mask), _nan_pad(behav, mask), _nan_pad(adv, mask), jnp.asarray(mask))
    standard, _, _ = alg.ppo_policy_loss(*args, config)
    coupled, _, stats = alg.ppo_policy_loss(*args, config, proximal_logp_bn=args[1])
    assert float(coupled) == float(standard)
    assert float(stats["behav_imp_weight"]) == sum(LENGTHS)


def _decoupled_actor_batch(seed):
    logp, behav, prox, ref, adv, mask = _inputs(seed)
    b, n, vocab = mask.shape[0], N, 7
    rng = np.random.default_rng(seed + 100)
    logits = rng.standard_normal((b, n + 1, vocab)).astype(np.float32)
    tokens = rng.integers(0, vocab, (b, n + 1)).astype(np.int32)
    batch = {"tokens_bt": jnp.asarray(tokens), "segment_ids_bt": jnp.ones((b, n + 1), jnp.int32),
             "positions_bt": jnp.broadcast_to(jnp.arange(n + 1), (b, n + 1)),
             "mask_bn": jnp.asarray(mask),
             "old_logp_bn": jnp.asarray(behav), "advantages_bn": jnp.asarray(adv),
             "ref_logp_bn": jnp.asarray(ref), decoupled.PROX_KEY: jnp.asarray(prox),
             "kl_coef": jnp.full((b,), 0.1, jnp.float32)}
    # log π_θ of token t+1 under the logits at t, by hand
    lp = np.zeros((b, n))
    for i in range(b):
        for t in range(n):
            row = logits[i, t].astype(np.float64)
            lp[i, t] = row[tokens[i, t + 1]] - row.max() - math.log(np.exp(row - row.max()).sum())
    return jnp.asarray(logits), batch, lp, behav, prox, ref, adv, mask


POLICY = policy_readout(1.0)


def _loss_of_logits(train, logits, batch):
    """A train spec's loss of the logits of `batch`, read as its train step reads them."""
    inputs = InferenceBatch(batch["tokens_bt"], batch["positions_bt"], batch["segment_ids_bt"])
    return train.loss_fn(readout(train.readout or POLICY, logits, inputs), batch)


@pytest.mark.parametrize("kl_in_reward", [True, False])
def test_decoupled_ppo_actor_loss_matches_loop(kl_in_reward):
    logits, batch, lp, behav, prox, ref, adv, mask = _decoupled_actor_batch(24)
    cfg = ppo.PPOConfig(policy=alg.PPOLossConfig(clip_eps=0.2), kl_in_reward=kl_in_reward)
    train = TrainSpec(None, ppo.actor_loss(cfg, decoupled.batch_proximal))
    loss_sum, weight, _ = _loss_of_logits(train, logits, batch)
    want = 0.0
    for i, length in enumerate(LENGTHS):
        for t in range(length):
            want += _np_token_loss(lp[i, t], behav[i, t], prox[i, t], float(adv[i, t]), 0.2,
                                   None)[0]
            if not kl_in_reward:  # k1 = log π_θ − log π_ref, times β
                want += 0.1 * (lp[i, t] - float(ref[i, t]))
    np.testing.assert_allclose(float(loss_sum), want, rtol=1e-5, atol=1e-5)
    assert float(weight) == sum(LENGTHS)


def _spec(algorithm, staleness, decoupled_on=True, mini_batches=1):
    config = base_config()
    config.algorithm = algorithm
    config.ppo.mini_batches = mini_batches
    if algorithm == "grpo":
        config.rollout.update(batch_size=8, group_size=4)
    config.async_rl.update(max_staleness=staleness, decoupled=decoupled_on)
    return run_spec(config)


@pytest.mark.parametrize("algorithm", ["ppo", "grpo"])
def test_async_spec_trains_with_proximal_logprobs(algorithm):
    # Two updates per batch: π_prox (the weights before the first) comes from `actor_prox`.
    spec = _spec(algorithm, 2, mini_batches=2)
    assert spec.async_rl.decoupled and spec.async_rl.max_staleness == 2
    order = list(spec.graph.order)
    prox = spec.graph.mfc(decoupled.PROX_MFC)
    assert (prox.role, prox.call) == (Role.ACTOR, Call.INFERENCE)
    assert order.index("actor_prox") < order.index("actor_train")
    assert decoupled.PROX_KEY in spec.graph.mfc("actor_train").inputs
    # One update per batch: the train step's own forward pass is π_prox, no extra call.
    one = _spec(algorithm, 2)
    assert one.async_rl.decoupled and "actor_prox" not in one.graph.order
    assert decoupled.PROX_KEY not in one.graph.mfc("actor_train").inputs
    # The synchronous default and decoupled=False keep the algorithm as it is.
    for plain in (_spec(algorithm, 0), _spec(algorithm, 2, decoupled_on=False)):
        assert "actor_prox" not in plain.graph.order


@pytest.mark.parametrize("algorithm", ["ppo", "grpo"])
def test_own_proximal_is_the_proximal_call_at_one_update(algorithm):
    """With π_prox taken from the step's own forward pass, loss and gradient equal those with
    π_prox from a separate call on the same weights (what `actor_prox` computes): the
    decoupled loss of the one-update spec against the loss fed the forward's own log-probs."""
    logits, batch, lp, *_ = _decoupled_actor_batch(31)
    batch = {**batch, decoupled.PROX_KEY: jnp.asarray(lp, jnp.float32)}
    own = _spec(algorithm, 2).algorithm.train[Role.ACTOR]
    fed = _spec(algorithm, 2, mini_batches=2).algorithm.train[Role.ACTOR]
    (own_loss, (_, own_stats)), own_grad = jax.value_and_grad(
        lambda x: (lambda out: (out[0], out[1:]))(_loss_of_logits(own, x, batch)),
        has_aux=True)(logits)
    (fed_loss, _), fed_grad = jax.value_and_grad(
        lambda x: (lambda out: (out[0], out[1:]))(_loss_of_logits(fed, x, batch)),
        has_aux=True)(logits)
    np.testing.assert_allclose(float(own_loss), float(fed_loss), rtol=1e-6)
    np.testing.assert_allclose(own_grad, fed_grad, rtol=1e-5, atol=1e-7)
    assert np.count_nonzero(np.asarray(own_grad)) > 0
    assert float(own_stats["clip_frac"]) == 0.0  # u = π_θ / π_prox = 1 at the only update


def test_async_rejects_other_algorithms():
    config = base_config()
    config.algorithm = "remax"
    config.async_rl.max_staleness = 1
    with pytest.raises(ConfigError, match="async_rl.max_staleness=1: asynchronous RL runs ppo"):
        run_spec(config)
    config.algorithm, config.async_rl.max_staleness = "ppo", -1
    with pytest.raises(ConfigError, match="async_rl.max_staleness=-1: must be >= 0"):
        run_spec(config)


@pytest.mark.parametrize("algorithm", ["ppo", "grpo"])
def test_greedy_rollouts_train_at_temperature_one(algorithm):
    """rollout.temperature=0 is greedy generation, whose log-probs the engine records at
    temperature 1; the actor's train step reads the policy the same way (it divided logits
    by 0)."""
    logits, batch, *_ = _decoupled_actor_batch(5)
    loss = {}
    for temperature in (0.0, 1.0):
        config = base_config()
        config.algorithm, config.rollout.temperature = algorithm, temperature
        if algorithm == "grpo":
            config.rollout.update(batch_size=8, group_size=4)
        train = run_spec(config).algorithm.train[Role.ACTOR]
        loss[temperature] = float(_loss_of_logits(train, logits, batch)[0])
    assert np.isfinite(loss[0.0]) and loss[0.0] == loss[1.0]
