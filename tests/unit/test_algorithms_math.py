"""Numerics of jaxrlhf.algorithms against independent numpy references written as plain loops.

References run in float64 on the same float32 inputs; tolerances are float32 round-off.
Padding positions hold nan/garbage on purpose: the functions must never look at them.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrlhf import algorithms as alg

TOL = dict(rtol=1e-6, atol=1e-6)
LENGTHS = (5, 1, 8, 0, 3)  # includes a full row, a single token and an empty response
N = 8


def _rng(seed=0):
    return np.random.default_rng(seed)


def _prefix_mask(lengths=LENGTHS, n=N):
    mask = np.zeros((len(lengths), n), np.float32)
    for b, length in enumerate(lengths):
        mask[b, :length] = 1
    return mask


def _with_padding(x, mask, fill=np.nan):
    return np.where(mask > 0, x, fill).astype(np.float32)


def _close(actual, expected):
    np.testing.assert_allclose(np.asarray(actual, np.float64), expected, **TOL)


# ----------------------------------------------------------------------------- logprobs


def _np_log_softmax(row):
    row = row.astype(np.float64)
    shifted = row - row.max()
    return shifted - math.log(sum(math.exp(v) for v in shifted))


@pytest.mark.parametrize("scale,temperature", [(1.0, 1.0), (300.0, 1.0), (2.0, 0.7)])
def test_logprobs_and_entropy_match_numpy(scale, temperature):
    # scale 300 overflows a naive exp(logits) in float32.
    rng = _rng(1)
    logits = (scale * rng.standard_normal((2, 3, 11))).astype(np.float32)
    tokens = rng.integers(0, 11, (2, 3))
    logp = alg.logprobs_from_logits(jnp.asarray(logits), jnp.asarray(tokens), temperature)
    ent = alg.entropy_from_logits(jnp.asarray(logits), temperature)
    want_logp = np.zeros((2, 3))
    want_ent = np.zeros((2, 3))
    for b in range(2):
        for t in range(3):
            ls = _np_log_softmax(logits[b, t].astype(np.float64) / temperature)
            want_logp[b, t] = ls[tokens[b, t]]
            want_ent[b, t] = -sum(math.exp(v) * v for v in ls)
    assert np.all(np.isfinite(np.asarray(logp)))
    _close(logp, want_logp)
    _close(ent, want_ent)


def test_logprobs_bf16_logits_upcast():
    logits = jnp.asarray(_rng(2).standard_normal((1, 2, 5)), jnp.bfloat16)
    logp = alg.logprobs_from_logits(logits, jnp.array([[0, 4]]))
    assert logp.dtype == jnp.float32
    want = [_np_log_softmax(np.asarray(logits[0, t], np.float64))[k] for t, k in [(0, 0), (1, 4)]]
    _close(logp[0], want)


def test_sequence_logprobs_ignores_padding():
    mask = _prefix_mask()
    logp = _rng(3).standard_normal(mask.shape)
    got = alg.sequence_logprobs(jnp.asarray(_with_padding(logp, mask, -np.inf)), jnp.asarray(mask))
    want = [sum(float(logp[b, t]) for t in range(L)) for b, L in enumerate(LENGTHS)]
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-5)


# ----------------------------------------------------------------------------- advantages


def _np_gae(rewards, values, mask, gamma, lam):
    """Textbook GAE on each row's valid tokens only, bootstrap 0 after the last one."""
    adv = np.zeros(rewards.shape)
    for b in range(rewards.shape[0]):
        idx = [t for t in range(rewards.shape[1]) if mask[b, t]]
        running = 0.0
        for k in reversed(range(len(idx))):
            t = idx[k]
            next_value = float(values[b, idx[k + 1]]) if k + 1 < len(idx) else 0.0
            delta = float(rewards[b, t]) + gamma * next_value - float(values[b, t])
            running = delta + gamma * lam * running
            adv[b, t] = running
    returns = np.where(mask > 0, adv + values.astype(np.float64), 0.0)
    return adv, returns


def test_gae_textbook_case():
    # γ = λ = 1: A_t = (Σ future rewards) − V_t.
    adv, ret = jax.jit(alg.gae)(
        jnp.array([[0.0, 1.0, 7.0]]), jnp.array([[0.5, 0.2, 9.0]]), jnp.array([[1, 1, 0]]), 1.0, 1.0
    )
    _close(adv, [[0.5, 0.8, 0.0]])
    _close(ret, [[1.0, 1.0, 0.0]])


@pytest.mark.parametrize("gamma,lam", [(0.9, 0.8), (1.0, 0.95), (0.99, 0.0)])
def test_gae_matches_loop_with_prefix_masks(gamma, lam):
    rng = _rng(4)
    mask = _prefix_mask()
    rewards = rng.standard_normal(mask.shape).astype(np.float32)
    values = rng.standard_normal(mask.shape).astype(np.float32)
    adv, ret = jax.jit(alg.gae)(
        jnp.asarray(_with_padding(rewards, mask)),
        jnp.asarray(_with_padding(values, mask)),
        jnp.asarray(mask),
        gamma,
        lam,
    )
    want_adv, want_ret = _np_gae(rewards, values, mask, gamma, lam)
    _close(adv, want_adv)
    _close(ret, want_ret)


def test_gae_skips_interior_holes():
    rng = _rng(5)
    mask = (rng.random((4, N)) < 0.6).astype(np.float32)
    mask[0] = [1, 0, 0, 1, 1, 0, 1, 0]
    rewards = rng.standard_normal(mask.shape).astype(np.float32)
    values = rng.standard_normal(mask.shape).astype(np.float32)
    adv, ret = jax.jit(alg.gae)(
        jnp.asarray(_with_padding(rewards, mask, 1e6)),
        jnp.asarray(_with_padding(values, mask, -1e6)),
        jnp.asarray(mask),
        0.95,
        0.9,
    )
    want_adv, want_ret = _np_gae(rewards, values, mask, 0.95, 0.9)
    _close(adv, want_adv)
    _close(ret, want_ret)


def test_discounted_returns_and_remax():
    rng = _rng(6)
    mask = _prefix_mask()
    rewards = rng.standard_normal(mask.shape).astype(np.float32)
    baseline = rng.standard_normal(len(LENGTHS)).astype(np.float32)
    rewards_in = jnp.asarray(_with_padding(rewards, mask))
    got = jax.jit(alg.discounted_returns)(rewards_in, jnp.asarray(mask), 0.9)
    got_remax = jax.jit(alg.remax_advantages)(rewards_in, jnp.asarray(mask), jnp.asarray(baseline))
    want = np.zeros(mask.shape)
    want_remax = np.zeros(mask.shape)
    for b, length in enumerate(LENGTHS):
        for t in range(length):
            want[b, t] = sum(0.9 ** (k - t) * float(rewards[b, k]) for k in range(t, length))
            want_remax[b, t] = sum(float(rewards[b, k]) for k in range(t, length)) - baseline[b]
    _close(got, want)
    _close(got_remax, want_remax)


@pytest.mark.parametrize("shift_mean,unbiased", [(True, False), (True, True), (False, False)])
def test_masked_whiten_matches_numpy(shift_mean, unbiased):
    rng = _rng(7)
    mask = _prefix_mask()
    x = (3.0 + 2.0 * rng.standard_normal(mask.shape)).astype(np.float32)
    got = alg.masked_whiten(
        jnp.asarray(_with_padding(x, mask)), jnp.asarray(mask), shift_mean=shift_mean,
        unbiased=unbiased, eps=1e-5,
    )
    valid = [float(x[b, t]) for b in range(mask.shape[0]) for t in range(N) if mask[b, t]]
    mean = sum(valid) / len(valid)
    var = sum((v - mean) ** 2 for v in valid) / (len(valid) - (1 if unbiased else 0))
    want = np.zeros(mask.shape)
    for b in range(mask.shape[0]):
        for t in range(N):
            if mask[b, t]:
                want[b, t] = (float(x[b, t]) - (mean if shift_mean else 0.0)) / math.sqrt(
                    var + 1e-5
                )
    _close(got, want)
    if shift_mean:
        assert abs(float(alg.masked_mean(got, jnp.asarray(mask)))) < 1e-6


@pytest.mark.parametrize("scale_by_std,unbiased", [(True, True), (True, False), (False, True)])
def test_group_normalized_advantages_matches_loop(scale_by_std, unbiased):
    group_size, groups = 4, 3
    scores = _rng(8).standard_normal(group_size * groups).astype(np.float32)
    scores[8:12] = 0.5  # a group whose answers all scored the same: no signal, advantage 0
    got = alg.group_normalized_advantages(
        jnp.asarray(scores), group_size, scale_by_std=scale_by_std, unbiased=unbiased, eps=1e-6
    )
    want = np.zeros(scores.shape)
    for g in range(groups):
        members = [float(s) for s in scores[g * group_size : (g + 1) * group_size]]
        mean = sum(members) / group_size
        ddof = 1 if unbiased else 0
        std = math.sqrt(sum((m - mean) ** 2 for m in members) / (group_size - ddof))
        for i, m in enumerate(members):
            want[g * group_size + i] = (m - mean) / (std + 1e-6) if scale_by_std else m - mean
    _close(got, want)
    np.testing.assert_array_equal(np.asarray(got[8:12]), 0.0)


def test_group_normalized_advantages_rejects_bad_groups():
    with pytest.raises(ValueError, match="divide"):
        alg.group_normalized_advantages(jnp.zeros(6), 4)
    with pytest.raises(ValueError, match="group_size >= 2"):
        alg.group_normalized_advantages(jnp.zeros(6), 1)


def test_broadcast_to_tokens_and_lagrangian_advantages():
    rng = _rng(9)
    mask = _prefix_mask()
    per_seq = rng.standard_normal(len(LENGTHS)).astype(np.float32)
    got = alg.broadcast_to_tokens(jnp.asarray(per_seq), jnp.asarray(mask))
    _close(got, per_seq[:, None] * mask)
    a_r = rng.standard_normal(mask.shape).astype(np.float32)
    a_c = rng.standard_normal(mask.shape).astype(np.float32)
    lam = 0.7
    got = alg.lagrangian_advantages(
        jnp.asarray(_with_padding(a_r, mask)), jnp.asarray(a_c), jnp.asarray(mask),
        jnp.log(jnp.float32(lam)),
    )
    want = np.where(mask > 0, (a_r.astype(np.float64) - lam * a_c) / (1 + lam), 0.0)
    _close(got, want)


# ----------------------------------------------------------------------------- KL


@pytest.mark.parametrize("estimator", list(alg.KLEstimator))
def test_kl_estimators_match_formulas(estimator):
    rng = _rng(10)
    logp = (-rng.random((3, 4)) * 3).astype(np.float32)
    ref = (-rng.random((3, 4)) * 3).astype(np.float32)
    got = alg.kl_per_token(jnp.asarray(logp), jnp.asarray(ref), estimator)
    want = np.zeros(logp.shape)
    for i in range(3):
        for j in range(4):
            log_r = float(ref[i, j]) - float(logp[i, j])  # log π_ref/π
            want[i, j] = {
                alg.KLEstimator.K1: -log_r,
                alg.KLEstimator.K2: 0.5 * log_r**2,
                alg.KLEstimator.K3: math.exp(log_r) - 1 - log_r,
            }[estimator]
    _close(got, want)


def test_k3_is_unbiased_kl_on_a_categorical():
    # E_{x~p}[k3] = KL(p‖q) exactly when averaged with the true probabilities.
    p = np.array([0.5, 0.3, 0.2])
    q = np.array([0.2, 0.2, 0.6])
    log_p, log_q = jnp.log(jnp.asarray([p, q], jnp.float32))
    k3 = alg.kl_per_token(log_p[None], log_q[None], alg.KLEstimator.K3)
    kl = sum(pi * math.log(pi / qi) for pi, qi in zip(p, q))
    np.testing.assert_allclose(float(jnp.sum(k3[0] * p)), kl, rtol=1e-6)


def test_kl_penalized_rewards_matches_loop():
    rng = _rng(11)
    mask = _prefix_mask()
    scores = np.array([3.0, -0.4, 0.8, 2.0, -7.0], np.float32)
    logp = (-rng.random(mask.shape) * 2).astype(np.float32)
    ref = (-rng.random(mask.shape) * 2).astype(np.float32)
    rewards, kl = jax.jit(alg.kl_penalized_rewards, static_argnums=(5, 6))(
        jnp.asarray(scores), jnp.asarray(_with_padding(logp, mask)), jnp.asarray(ref),
        jnp.asarray(mask), jnp.float32(0.05), alg.KLEstimator.K1, 5.0,
    )
    want_r = np.zeros(mask.shape)
    want_kl = np.zeros(mask.shape)
    for b, length in enumerate(LENGTHS):
        for t in range(length):
            want_kl[b, t] = float(logp[b, t]) - float(ref[b, t])
            want_r[b, t] = -0.05 * want_kl[b, t]
        if length:
            want_r[b, length - 1] += min(max(float(scores[b]), -5.0), 5.0)
    _close(kl, want_kl)
    _close(rewards, want_r)


def test_last_token_one_hot_general_mask():
    mask = jnp.array([[1, 1, 0, 1, 0], [0, 0, 0, 0, 0], [1, 1, 1, 1, 1]])
    want = [[0, 0, 0, 1, 0], [0, 0, 0, 0, 0], [0, 0, 0, 0, 1]]
    np.testing.assert_array_equal(alg.last_token_one_hot(mask), want)


def test_adaptive_kl_controller_trajectory():
    config = alg.KLControllerConfig(
        kind=alg.KLControllerKind.ADAPTIVE, init_kl_coef=0.2, target=6.0, horizon=1000.0
    )
    observed = [1.0, 5.0, 6.0, 8.0, 20.0, 0.0, 7.2]
    update = jax.jit(alg.update_kl_coef, static_argnums=3)
    coef = jnp.float32(config.init_kl_coef)
    want = 0.2
    for kl in observed:
        coef = update(coef, jnp.float32(kl), 64, config)
        error = min(max(kl / 6.0 - 1.0, -0.2), 0.2)
        want *= 1.0 + error * 64 / 1000.0
        np.testing.assert_allclose(float(coef), want, rtol=1e-6)
    fixed = alg.KLControllerConfig(init_kl_coef=0.2)
    assert float(alg.update_kl_coef(0.2, 50.0, 64, fixed)) == np.float32(0.2)
    with pytest.raises(ValueError):
        alg.KLControllerConfig(kind=alg.KLControllerKind.ADAPTIVE, target=0.0)


# ----------------------------------------------------------------------------- policy losses


def _np_policy_loss(
    logp, old, adv, mask, eps, dual=None, prox=None, cap=None, ent=None, ent_coef=0.0
):
    """Per-token PPO losses as a loop; returns (Σ loss, Σ mask, Σ clipped)."""
    total, weight, clipped = 0.0, 0.0, 0.0
    for b in range(logp.shape[0]):
        for t in range(logp.shape[1]):
            if not mask[b, t]:
                continue
            denom = float(old[b, t] if prox is None else prox[b, t])
            ratio = math.exp(float(logp[b, t]) - denom)
            a = float(adv[b, t])
            surrogate = min(ratio * a, min(max(ratio, 1 - eps), 1 + eps) * a)
            loss = -surrogate
            clipped += float(-min(max(ratio, 1 - eps), 1 + eps) * a > -ratio * a)
            if dual is not None and a < 0:
                loss = min(loss, -dual * a)
            if prox is not None:
                w = math.exp(float(prox[b, t]) - float(old[b, t]))
                loss *= w if cap is None or w <= cap else 0.0
            if ent is not None:
                loss -= ent_coef * float(ent[b, t])
            total += loss
            weight += 1
    return total, weight, clipped


def _policy_inputs(seed=12):
    rng = _rng(seed)
    mask = _prefix_mask()
    old = (-rng.random(mask.shape) * 2).astype(np.float32)
    logp = (old + 0.6 * rng.standard_normal(mask.shape)).astype(np.float32)
    adv = rng.standard_normal(mask.shape).astype(np.float32)
    return logp, old, adv, mask


@pytest.mark.parametrize("dual_clip", [None, 2.0])
def test_ppo_policy_loss_matches_loop(dual_clip):
    logp, old, adv, mask = _policy_inputs()
    config = alg.PPOLossConfig(clip_eps=0.2, dual_clip=dual_clip)
    loss_fn = jax.jit(alg.ppo_policy_loss, static_argnums=4)
    loss_sum, weight, stats = loss_fn(
        jnp.asarray(_with_padding(logp, mask)), jnp.asarray(_with_padding(old, mask)),
        jnp.asarray(_with_padding(adv, mask)), jnp.asarray(mask), config,
    )
    want_sum, want_weight, want_clipped = _np_policy_loss(logp, old, adv, mask, 0.2, dual_clip)
    _close(loss_sum, want_sum)
    assert float(weight) == want_weight == sum(LENGTHS)
    assert float(stats["clip_frac"]) == want_clipped > 0
    if dual_clip is not None:
        assert float(stats["dual_clip_frac"]) > 0  # the inputs exercise the dual clip


def test_ppo_decoupled_loss_matches_loop():
    logp, behav, adv, mask = _policy_inputs(13)
    prox = (behav + 0.5 * _rng(14).standard_normal(mask.shape)).astype(np.float32)
    ent = _rng(15).random(mask.shape).astype(np.float32)
    config = alg.PPOLossConfig(clip_eps=0.2, behav_imp_weight_cap=1.5, entropy_coef=0.01)
    loss_sum, weight, stats = jax.jit(alg.ppo_policy_loss, static_argnums=4)(
        jnp.asarray(logp), jnp.asarray(behav), jnp.asarray(adv), jnp.asarray(mask), config,
        proximal_logp_bn=jnp.asarray(prox), entropy_bn=jnp.asarray(_with_padding(ent, mask)),
    )
    want_sum, want_weight, _ = _np_policy_loss(
        logp, behav, adv, mask, 0.2, prox=prox, cap=1.5, ent=ent, ent_coef=0.01
    )
    _close(loss_sum, want_sum)
    assert float(weight) == want_weight
    assert 0 < float(stats["behav_kept_frac"]) < want_weight  # the cap dropped some tokens
    _close(stats["entropy"], float(np.sum(ent * mask, dtype=np.float64)))


def test_ppo_sequence_mean_aggregation():
    logp, old, adv, mask = _policy_inputs(16)
    config = alg.PPOLossConfig(aggregation=alg.LossAggregation.SEQ_MEAN_TOKEN_MEAN)
    loss_sum, weight, _ = jax.jit(alg.ppo_policy_loss, static_argnums=4)(
        jnp.asarray(logp), jnp.asarray(old), jnp.asarray(adv), jnp.asarray(mask), config
    )
    want = 0.0
    for b in range(mask.shape[0]):
        row_sum, row_weight, _ = _np_policy_loss(
            logp[b : b + 1], old[b : b + 1], adv[b : b + 1], mask[b : b + 1], 0.2
        )
        want += row_sum / row_weight if row_weight else 0.0
    _close(loss_sum, want)
    assert float(weight) == sum(1 for length in LENGTHS if length)  # the empty row has no say


def test_ppo_gradient_signs():
    # Token 0: A>0 inside the trust region → push logp up. Token 1: A>0, ratio above 1+ε →
    # clipped, no gradient. Token 2: A<0, ratio huge → dual-clipped, no gradient.
    # Token 3: A<0 inside → push logp down. Token 4: padding holding nan.
    logp = jnp.array([[0.0, 1.0, 3.0, 0.0, jnp.nan]])
    old = jnp.zeros((1, 5))
    adv = jnp.array([[1.0, 1.0, -1.0, -1.0, jnp.nan]])
    mask = jnp.array([[1, 1, 1, 1, 0]])
    config = alg.PPOLossConfig(clip_eps=0.2, dual_clip=3.0)
    grad = jax.jit(jax.grad(lambda lp: alg.ppo_policy_loss(lp, old, adv, mask, config)[0]))(
        logp
    )
    assert grad[0, 0] < 0 and grad[0, 3] > 0
    np.testing.assert_array_equal(np.asarray(grad[0, [1, 2, 4]]), 0.0)


def test_grpo_loss_matches_loop():
    logp, old, adv, mask = _policy_inputs(17)
    ref = (old + 0.3 * _rng(18).standard_normal(mask.shape)).astype(np.float32)
    config = alg.GRPOLossConfig(kl_coef=0.04)
    loss_sum, weight, stats = jax.jit(alg.grpo_loss, static_argnums=5)(
        jnp.asarray(logp), jnp.asarray(old), jnp.asarray(_with_padding(ref, mask)),
        jnp.asarray(adv), jnp.asarray(mask), config,
    )
    want, want_kl = 0.0, 0.0
    for b, length in enumerate(LENGTHS):
        row, row_kl = 0.0, 0.0
        for t in range(length):
            ratio = math.exp(float(logp[b, t]) - float(old[b, t]))
            a = float(adv[b, t])
            log_r = float(ref[b, t]) - float(logp[b, t])
            k3 = math.exp(log_r) - 1 - log_r
            row += -min(ratio * a, min(max(ratio, 0.8), 1.2) * a) + 0.04 * k3
            row_kl += k3
        if length:
            want += row / length
            want_kl += row_kl / length
    _close(loss_sum, want)
    _close(stats["ref_kl"], want_kl)
    assert float(weight) == 4
    # The KL term alone pulls logp towards the reference.
    zero_adv = jnp.zeros(mask.shape)
    def loss_of(lp):
        return alg.grpo_loss(lp, old, ref, zero_adv, mask, config)[0]

    grad = jax.jit(jax.grad(loss_of))(jnp.asarray(logp))
    sign = np.sign(np.asarray(grad))[mask > 0]
    np.testing.assert_array_equal(sign, np.sign(logp - ref)[mask > 0])


# ----------------------------------------------------------------------------- other losses


@pytest.mark.parametrize("clip", [0.2, None])
def test_value_loss_matches_loop(clip):
    rng = _rng(19)
    mask = _prefix_mask()
    old = rng.standard_normal(mask.shape).astype(np.float32)
    values = (old + 0.5 * rng.standard_normal(mask.shape)).astype(np.float32)
    returns = rng.standard_normal(mask.shape).astype(np.float32)
    loss_sum, weight, stats = jax.jit(alg.value_loss, static_argnums=4)(
        jnp.asarray(_with_padding(values, mask)), jnp.asarray(old), jnp.asarray(returns),
        jnp.asarray(mask), alg.ValueLossConfig(clip_eps_value=clip),
    )
    want, want_clipped = 0.0, 0
    for b, length in enumerate(LENGTHS):
        for t in range(length):
            v, o, r = float(values[b, t]), float(old[b, t]), float(returns[b, t])
            plain = (v - r) ** 2
            if clip is None:
                want += 0.5 * plain
                continue
            clipped = (o + min(max(v - o, -clip), clip) - r) ** 2
            want += 0.5 * max(plain, clipped)
            want_clipped += clipped > plain
    _close(loss_sum, want)
    assert float(weight) == sum(LENGTHS)
    assert float(stats["value_clip_frac"]) == want_clipped
    def loss_of(v):
        return alg.value_loss(v, values, returns, mask, alg.ValueLossConfig(clip))[0]

    grad = jax.jit(jax.grad(loss_of))(jnp.asarray(values))
    valid = mask > 0
    np.testing.assert_array_equal(np.sign(grad)[valid], np.sign(values - returns)[valid])


def test_sft_loss():
    mask = _prefix_mask()
    logp = (-_rng(20).random(mask.shape) * 4).astype(np.float32)
    loss_sum, weight, stats = jax.jit(alg.sft_loss)(jnp.asarray(_with_padding(logp, mask)), mask)
    want = -sum(float(logp[b, t]) for b, length in enumerate(LENGTHS) for t in range(length))
    _close(loss_sum, want)
    _close(stats["nll"], want)
    assert float(weight) == sum(LENGTHS)


def test_reward_model_loss_and_accuracy():
    chosen = np.array([2.0, -1.0, 0.3, 5.0, np.nan], np.float32)
    rejected = np.array([1.0, 0.5, 0.3, -20.0, np.nan], np.float32)
    valid = jnp.array([1, 1, 1, 1, 0])
    loss_sum, weight, stats = jax.jit(alg.reward_model_loss)(chosen, rejected, valid)
    margins = [float(c) - float(r) for c, r in zip(chosen[:4], rejected[:4])]
    _close(loss_sum, sum(math.log1p(math.exp(-m)) for m in margins))
    assert float(weight) == 4
    assert float(stats["accuracy"]) == 2  # the tie (0.3 vs 0.3) is not a correct ranking
    _close(stats["margin"], sum(margins))
    def loss_of(c, r):
        return alg.reward_model_loss(c, r, valid)[0]

    grad_c, grad_r = jax.jit(jax.grad(loss_of, (0, 1)))(chosen, rejected)
    assert np.all(np.asarray(grad_c[:4]) < 0) and np.all(np.asarray(grad_r[:4]) > 0)
    assert np.all(np.isfinite(np.asarray(grad_c)))


@pytest.mark.parametrize("beta,smoothing", [(0.1, 0.0), (0.5, 0.2)])
def test_dpo_loss_matches_formula(beta, smoothing):
    rng = _rng(21)
    pc, pr, rc, rr = (-rng.random((4, 6)) * 30 - 1).astype(np.float32)
    config = alg.DPOLossConfig(beta=beta, label_smoothing=smoothing)
    loss_sum, weight, stats = jax.jit(alg.dpo_loss, static_argnums=4)(
        jnp.asarray(pc), jnp.asarray(pr), jnp.asarray(rc), jnp.asarray(rr), config
    )
    want, want_acc = 0.0, 0
    for i in range(len(pc)):
        h = beta * ((float(pc[i]) - float(rc[i])) - (float(pr[i]) - float(rr[i])))
        want += (1 - smoothing) * math.log1p(math.exp(-h)) + smoothing * math.log1p(math.exp(h))
        want_acc += h > 0
    _close(loss_sum, want)
    assert float(weight) == len(pc)
    assert float(stats["reward_accuracy"]) == want_acc
    _close(stats["chosen_reward"], beta * float(np.sum(pc.astype(np.float64) - rc)))
    def loss_of(c, r):
        return alg.dpo_loss(c, r, rc, rr, alg.DPOLossConfig(beta))[0]

    grad_c, grad_r = jax.jit(jax.grad(loss_of, (0, 1)))(pc, pr)
    assert np.all(np.asarray(grad_c) < 0) and np.all(np.asarray(grad_r) > 0)


def test_lagrange_multiplier_trajectory():
    config = alg.LagrangeConfig(cost_limit=0.5, lambda_init=1.0, lambda_lr=0.1, lambda_max=2.0)
    update = jax.jit(alg.lagrange_update, static_argnums=2)
    log_lambda = alg.lagrange_init(config)
    want = math.log(1.0)
    for cost in [1.5, 2.0, -1.0, 0.5, 4.0, 4.0, 4.0, -3.0]:
        log_lambda = update(log_lambda, jnp.float32(cost), config)
        want = min(want + 0.1 * (cost - 0.5) * math.exp(want), math.log(2.0))
        np.testing.assert_allclose(float(log_lambda), want, rtol=1e-6, atol=1e-6)
    # Cost above the limit raises λ, below lowers it.
    up, down = update(jnp.float32(0.0), 1.0, config), update(jnp.float32(0.0), 0.0, config)
    assert float(up) > 0 > float(down)
