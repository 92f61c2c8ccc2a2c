"""The newer objectives (RLOO, REINFORCE++, DAPO, Dr. GRPO, GSPO) and the mismatch correction
(truncated importance sampling) against numpy references written as plain loops.

References run in float64 on the same float32 inputs; padding holds nan on purpose. The
learning runs of the shipped configs are in tests/test_entry_objectives.py (slow).
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrlhf import algorithms as alg
from jaxrlhf.algorithms import dapo, decoupled, gspo, grpo, reinforce
from jaxrlhf.engine.inference import InferenceOutput
from jaxrlhf.schema import ConfigError, base_config
from jaxrlhf.spec import run_spec

TOL = dict(rtol=1e-6, atol=1e-6)
G = 4
LENGTHS = (5, 1, 8, 3, 2, 8, 4, 6)  # two groups of 4 responses
N = 8


def _mask(lengths=LENGTHS, n=N):
    mask = np.zeros((len(lengths), n), np.float32)
    for b, length in enumerate(lengths):
        mask[b, :length] = 1
    return mask


def _pad(x, mask):
    return np.where(mask > 0, x, np.nan).astype(np.float32)


def _close(actual, expected):
    np.testing.assert_allclose(np.asarray(actual, np.float64), expected, **TOL)


def _logps(seed, mask, spread=0.3):
    rng = np.random.default_rng(seed)
    behav = (-2 * rng.random(mask.shape)).astype(np.float32)
    other = (behav + spread * rng.standard_normal(mask.shape)).astype(np.float32)
    return behav, other


# --------------------------------------------------------------------------- RLOO, REINFORCE++


def test_leave_one_out_advantages_match_loop():
    returns = np.random.default_rng(0).standard_normal(8).astype(np.float32)
    got = alg.advantages.leave_one_out_advantages(jnp.asarray(returns), G)
    want = [returns[i] - np.mean([returns[j] for j in range(i // G * G, i // G * G + G)
                                  if j != i], dtype=np.float64) for i in range(8)]
    _close(got, np.array(want))
    with pytest.raises(ValueError, match="group_size"):
        alg.advantages.leave_one_out_advantages(jnp.asarray(returns), 3)


def _np_kl_rewards(scores, behav, ref, mask, beta):
    """Per-token rewards −β·k1, plus the score at the last valid token, as lists of rows."""
    rows = []
    for b in range(mask.shape[0]):
        length = int(mask[b].sum())
        r = [-beta * (float(behav[b, t]) - float(ref[b, t])) for t in range(length)]
        if length:
            r[-1] += float(scores[b])
        rows.append(r)
    return rows


@pytest.mark.parametrize("baseline", list(reinforce.Baseline))
def test_reinforce_advantages_match_loop(baseline):
    mask = _mask()
    behav, ref = _logps(1, mask)
    scores = np.array([1, 0, 1, 1, 0, 0, 1, 0], np.float32)
    cfg = reinforce.ReinforceConfig(baseline=baseline, group_size=G)
    got, _ = jax.jit(reinforce.reinforce_advantages, static_argnums=5)(
        jnp.asarray(scores), jnp.asarray(_pad(behav, mask)), jnp.asarray(_pad(ref, mask)),
        jnp.asarray(mask), 0.1, cfg)
    rewards = _np_kl_rewards(scores, behav, ref, mask, 0.1)
    want = np.zeros(mask.shape)
    if baseline is reinforce.Baseline.LEAVE_ONE_OUT:
        returns = [sum(r) for r in rewards]
        for i, r in enumerate(rewards):
            group = range(i // G * G, i // G * G + G)
            want[i, :len(r)] = returns[i] - sum(returns[j] for j in group if j != i) / (G - 1)
    else:  # reward-to-go, then whitened over every valid token of the batch
        to_go = [[sum(r[t:]) for t in range(len(r))] for r in rewards]
        flat = np.array([g for row in to_go for g in row])
        mean, var = flat.mean(), flat.var()
        for i, row in enumerate(to_go):
            want[i, :len(row)] = (np.array(row) - mean) / math.sqrt(var + 1e-5)
    _close(got, want)


def test_rloo_needs_groups():
    with pytest.raises(ValueError, match="group_size >= 2"):
        reinforce.ReinforceConfig(baseline=reinforce.Baseline.LEAVE_ONE_OUT, group_size=1)
    reinforce.ReinforceConfig(baseline=reinforce.Baseline.BATCH_NORM, group_size=1)


# --------------------------------------------------------------------------------- Dr. GRPO


def test_dr_grpo_constant_normaliser_matches_loop():
    mask = _mask()
    old, logp = _logps(2, mask)
    adv = np.random.default_rng(3).standard_normal(mask.shape).astype(np.float32)
    policy = alg.PPOLossConfig(aggregation=alg.LossAggregation.SEQ_MEAN_TOKEN_SUM_NORM)
    config = alg.GRPOLossConfig(policy=policy, kl_coef=0.0)
    loss_sum, weight, _ = jax.jit(alg.grpo_loss, static_argnums=5)(
        jnp.asarray(_pad(logp, mask)), jnp.asarray(_pad(old, mask)), jnp.asarray(_pad(old, mask)),
        jnp.asarray(_pad(adv, mask)), jnp.asarray(mask), config)
    want = 0.0
    for b, length in enumerate(LENGTHS):
        for t in range(length):
            ratio = math.exp(float(logp[b, t]) - float(old[b, t]))
            a = float(adv[b, t])
            want += -min(ratio * a, min(max(ratio, 0.8), 1.2) * a) / N  # N: the budget, not length
    _close(loss_sum, want)
    assert float(weight) == len(LENGTHS)


def test_dr_grpo_advantages_only_subtract_the_group_mean():
    scores = jnp.array([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 0.0, 1.0])
    got = alg.group_normalized_advantages(scores, G, scale_by_std=False)
    _close(got, [0.75, -0.25, -0.25, -0.25, 0.25, 0.25, -0.75, 0.25])


# -------------------------------------------------------------------------------------- GSPO


def _np_gspo(logp, old, ref, adv_b, mask, cfg, beta):
    """Σ over responses of −min(s A, clip(s) A) + β·mean_t k3, and Σ clipped, as loops."""
    total, clipped = 0.0, 0
    for b in range(mask.shape[0]):
        length = int(mask[b].sum())
        if not length:
            continue
        s = math.exp(sum(float(logp[b, t]) - float(old[b, t]) for t in range(length)) / length)
        a = float(adv_b[b])
        low, high = 1 - cfg.clip_eps, 1 + cfg.clip_eps_high
        loss = -min(s * a, min(max(s, low), high) * a)
        clipped += -min(max(s, low), high) * a > -s * a
        kl = 0.0
        for t in range(length):
            log_r = float(ref[b, t]) - float(logp[b, t])
            kl += math.exp(log_r) - 1 - log_r
        total += loss + beta * kl / length
    return total, clipped


@pytest.mark.parametrize("spread", [1e-4, 0.05])  # inside the clip range; mostly outside
def test_gspo_loss_matches_loop(spread):
    mask = _mask()
    old, logp = _logps(4, mask, spread)
    _, ref = _logps(5, mask)
    adv_b = np.random.default_rng(6).standard_normal(len(LENGTHS)).astype(np.float32)
    adv = np.where(mask > 0, adv_b[:, None], np.nan).astype(np.float32)
    cfg = gspo.GSPOConfig(grpo=grpo.GRPOConfig(group_size=G))
    loss_sum, weight, stats = jax.jit(gspo.gspo_loss, static_argnums=5)(
        jnp.asarray(_pad(logp, mask)), jnp.asarray(_pad(old, mask)), jnp.asarray(_pad(ref, mask)),
        jnp.asarray(adv), jnp.asarray(mask), cfg)
    want, clipped = _np_gspo(logp, old, ref, adv_b, mask, cfg, 0.04)
    np.testing.assert_allclose(float(loss_sum), want, rtol=1e-5, atol=1e-5)
    assert float(weight) == len(LENGTHS)
    assert float(stats["clip_frac"]) == clipped
    assert (clipped > 0) == (spread > 1e-3)


def test_gspo_with_the_mismatch_correction_matches_loop():
    """Against π_prox: s_i = exp(mean_t log π_θ/π_prox), l_i weighed by min(exp(mean_t log
    π_prox/π_behav), C)."""
    mask = _mask()
    behav, prox = _logps(17, mask, 0.2)
    logp = (prox + 1e-3 * np.random.default_rng(18).standard_normal(mask.shape)).astype(np.float32)
    adv_b = np.random.default_rng(19).standard_normal(len(LENGTHS)).astype(np.float32)
    adv = np.broadcast_to(adv_b[:, None], mask.shape).astype(np.float32)
    cfg = gspo.GSPOConfig(grpo=grpo.GRPOConfig(group_size=G, loss=alg.GRPOLossConfig(
        kl_coef=0.0)), tis_cap=1.05)
    loss_sum, _, stats = jax.jit(gspo.gspo_loss, static_argnums=5)(
        jnp.asarray(_pad(logp, mask)), jnp.asarray(_pad(behav, mask)), jnp.asarray(_pad(behav, mask)),
        jnp.asarray(adv), jnp.asarray(mask), cfg, proximal_logp_bn=jnp.asarray(_pad(prox, mask)))
    want, truncated = 0.0, 0
    for b, length in enumerate(LENGTHS):
        mean = lambda x: float(np.sum(x[b, :length], dtype=np.float64)) / length
        s, a = math.exp(mean(logp - prox)), float(adv_b[b])
        w = math.exp(mean(prox.astype(np.float64) - behav))
        truncated += w > 1.05
        want += -min(w, 1.05) * min(s * a, min(max(s, 1 - 3e-4), 1 + 4e-4) * a)
    np.testing.assert_allclose(float(loss_sum), want, rtol=1e-5, atol=1e-6)
    assert 0 < truncated < len(LENGTHS) and float(stats["clip_frac"]) > 0


def test_gspo_gradient_is_the_sequence_ratio_spread_over_tokens():
    """Unclipped and without the KL term: ∂l_i/∂log π(y_t) = −A_i · s_i / |y_i| on every token
    of response i, the same for all its tokens (one ratio per response)."""
    mask = _mask()
    old, logp = _logps(7, mask, 1e-5)
    adv_b = np.random.default_rng(8).standard_normal(len(LENGTHS)).astype(np.float32)
    adv = np.broadcast_to(adv_b[:, None], mask.shape).astype(np.float32)
    cfg = gspo.GSPOConfig(grpo=grpo.GRPOConfig(
        group_size=G, loss=alg.GRPOLossConfig(kl_coef=0.0)))
    grad = jax.jit(jax.grad(lambda lp: gspo.gspo_loss(
        lp, jnp.asarray(old), jnp.asarray(old), jnp.asarray(adv), jnp.asarray(mask), cfg)[0]))(
        jnp.asarray(logp))
    want = np.zeros(mask.shape)
    for b, length in enumerate(LENGTHS):
        s = math.exp(float(np.sum(logp[b, :length] - old[b, :length], dtype=np.float64)) / length)
        want[b, :length] = -adv_b[b] * s / length
    _close(grad, want)


# -------------------------------------------------------------------------------------- DAPO


def test_overlong_penalty_matches_the_paper():
    length = jnp.array([0, 4, 5, 6, 7, 8])
    got = dapo.overlong_penalty(length, 8, 3, 1.0)  # soft zone (5, 8]
    _close(got, [0, 0, 0, -1 / 3, -2 / 3, -1])
    _close(dapo.overlong_penalty(length, 8, 0, 1.0), np.zeros(6))


def test_dynamic_sampling_keeps_informative_groups_and_refills():
    """Six generated groups, three trained: the informative ones first, in order, then flat
    ones (masked out) to fill; advantages are the group-normalised shaped rewards."""
    rng = np.random.default_rng(9)
    groups, n = 6, 4  # 3 groups trained (oversample 2)
    scores = np.array([[0, 0, 0, 0], [1, 0, 1, 1], [1, 1, 1, 1], [0, 0, 0, 0], [0, 0, 0, 0],
                       [0, 1, 0, 0]], np.float32).reshape(-1)
    lengths = np.full(groups * G, 3)
    lengths[8:12] = [2, 4, 3, 3]  # group 2: all right, but one is overlong: informative
    mask = _mask(lengths, n)
    behav, _ = _logps(10, mask)
    buf = {"scores_b": scores, "response_mask_bn": mask, "behav_logp_bn": _pad(behav, mask),
           "seq_tokens_bs": rng.integers(0, 50, (groups * G, 6)),
           "seq_mask_bs": np.ones((groups * G, 6), np.int32)}
    cfg = dapo.DAPOConfig(group_size=G, overlong_buffer=1, oversample=2)
    rows, stats = jax.jit(lambda b: dapo.dapo_targets(b, cfg))(
        {k: jnp.asarray(v) for k, v in buf.items()})
    chosen = [1, 2, 5]  # informative groups, in order
    want_rows = [g * G + i for g in chosen for i in range(G)]
    np.testing.assert_array_equal(rows["seq_tokens_bs"], buf["seq_tokens_bs"][want_rows])
    shaped = scores - np.clip(lengths - (n - 1), 0, 1)  # penalty 1 per token past n − 1
    want_adv = np.zeros((len(want_rows), n))
    for k, g in enumerate(chosen):
        s = shaped[g * G:(g + 1) * G].astype(np.float64)
        a = (s - s.mean()) / (s.std(ddof=1) + 1e-6)
        for i in range(G):
            want_adv[k * G + i, :lengths[g * G + i]] = a[i]
    _close(rows["advantages_bn"], want_adv)
    np.testing.assert_array_equal(rows["mask_bn"], mask[want_rows])
    _close(stats["informative_group_frac"], 3 / 6)
    _close(stats["filled_frac"], 1.0)
    # Only two informative groups among six: the third trained group is flat, masked out.
    scores[4:8] = 1
    rows, stats = jax.jit(lambda b: dapo.dapo_targets(b, cfg))(
        {**{k: jnp.asarray(v) for k, v in buf.items()}, "scores_b": jnp.asarray(scores)})
    _close(stats["filled_frac"], 2 / 3)
    np.testing.assert_array_equal(rows["seq_tokens_bs"][8:], buf["seq_tokens_bs"][:4])
    np.testing.assert_array_equal(rows["mask_bn"][8:], 0.0)


def test_dapo_clip_higher_matches_loop():
    mask = _mask()
    old, logp = _logps(11, mask, 0.4)
    adv = np.random.default_rng(12).standard_normal(mask.shape).astype(np.float32)
    config = alg.PPOLossConfig(clip_eps=0.2, clip_eps_high=0.28)
    loss_sum, weight, _ = jax.jit(alg.ppo_policy_loss, static_argnums=4)(
        jnp.asarray(_pad(logp, mask)), jnp.asarray(_pad(old, mask)), jnp.asarray(_pad(adv, mask)),
        jnp.asarray(mask), config)
    want = 0.0
    for b, length in enumerate(LENGTHS):
        for t in range(length):
            r, a = math.exp(float(logp[b, t]) - float(old[b, t])), float(adv[b, t])
            want += -min(r * a, min(max(r, 0.8), 1.28) * a)
    _close(loss_sum, want)
    assert float(weight) == sum(LENGTHS)  # token-level: every token weighs the same


# ------------------------------------------------------------------------- mismatch correction


def test_truncated_importance_sampling_matches_loop():
    """Decoupled with `tis_cap`: l_t = −min(π_prox/π_behav, C) · min(u A, clip(u) A), u =
    π_θ/π_prox; weights above C are truncated, not dropped."""
    mask = _mask()
    behav, prox = _logps(13, mask, 0.5)
    logp = (prox + 0.1 * np.random.default_rng(14).standard_normal(mask.shape)).astype(np.float32)
    adv = np.random.default_rng(15).standard_normal(mask.shape).astype(np.float32)
    config = alg.PPOLossConfig(clip_eps=0.2, tis_cap=1.2)
    loss_sum, _, stats = jax.jit(alg.ppo_policy_loss, static_argnums=4)(
        jnp.asarray(_pad(logp, mask)), jnp.asarray(_pad(behav, mask)),
        jnp.asarray(_pad(adv, mask)), jnp.asarray(mask), config,
        proximal_logp_bn=jnp.asarray(_pad(prox, mask)))
    want, truncated = 0.0, 0
    for b, length in enumerate(LENGTHS):
        for t in range(length):
            u, a = math.exp(float(logp[b, t]) - float(prox[b, t])), float(adv[b, t])
            w = math.exp(float(prox[b, t]) - float(behav[b, t]))
            truncated += w > 1.2
            want += -min(w, 1.2) * min(u * a, min(max(u, 0.8), 1.2) * a)
    _close(loss_sum, want)
    assert truncated > 0
    assert float(stats["behav_kept_frac"]) == sum(LENGTHS)  # nothing dropped


def test_mismatch_stats_match_numpy():
    mask = _mask()
    behav, prox = _logps(16, mask, 0.2)
    got = decoupled.mismatch_stats(jnp.asarray(_pad(prox, mask)), jnp.asarray(_pad(behav, mask)),
                                   jnp.asarray(mask))
    gap = np.abs(prox.astype(np.float64) - behav)[mask > 0]
    _close(got["mismatch_mean"], gap.mean())
    _close(got["mismatch_max"], gap.max())


# ------------------------------------------------------------------------- configs and graphs


def _config(algorithm, **overrides):
    config = base_config()
    config.algorithm = algorithm
    config.rollout.batch_size, config.rollout.group_size = 8, G
    for key, value in overrides.items():
        section, name = key.split(".")
        config[section][name] = value
    return config


@pytest.mark.parametrize("algorithm,tis,calls", [
    ("rloo", 0.0, ("actor_gen", "reward", "ref_inf", "actor_train")),
    ("reinforce_pp", 0.0, ("actor_gen", "reward", "ref_inf", "actor_train")),
    ("gspo", 0.0, ("actor_gen", "reward", "ref_inf", "actor_train")),
    ("dapo", 0.0, ("actor_gen", "reward", "actor_train")),  # no KL, no reference model
    ("dapo", 2.0, ("actor_gen", "reward", "actor_prox", "actor_train")),
    ("grpo", 2.0, ("actor_gen", "reward", "ref_inf", "actor_prox", "actor_train")),
    ("gspo", 2.0, ("actor_gen", "reward", "ref_inf", "actor_prox", "actor_train")),
])
def test_graphs(algorithm, tis, calls):
    spec = run_spec(_config(algorithm, **{"ppo.tis_cap": tis}))
    assert spec.algorithm.name == algorithm
    assert tuple(m.name for m in spec.graph.mfcs) == calls


@pytest.mark.parametrize("algorithm,overrides,message", [
    ("remax", {"ppo.tis_cap": 2.0}, "ppo.tis_cap=2.0: the mismatch correction runs"),
    ("dapo", {"dapo.oversample": 3}, "dapo.oversample=3 does not divide rollout.batch_size=8"),
    ("dapo", {"dapo.oversample": 2, "ppo.mini_batches": 32},
     "ppo.mini_batches=32 does not divide the 16 rows DAPO trains"),
    ("rloo", {"rollout.group_size": 1}, "algorithm: RLOO needs group_size >= 2"),
    ("grpo", {"grpo.aggregation": "token_sum"}, "grpo.aggregation='token_sum' is not one of"),
])
def test_bad_settings_name_the_field(algorithm, overrides, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        run_spec(_config(algorithm, **overrides))


def test_reinforce_kl_controller_is_adaptive_when_asked():
    spec = run_spec(_config("rloo", **{"ppo.kl_adaptive": True, "ppo.kl_target": 1.0}))
    update = spec.algorithm.controller_update
    assert update({"kl_coef": 0.1}, {"kl": 2.0})["kl_coef"] > 0.1  # above target: β grows
    assert update({"kl_coef": 0.1}, {"kl": 0.5})["kl_coef"] < 0.1


@pytest.mark.parametrize("algorithm,tis", [  # every new loss; the correction on each kind
    ("rloo", 0.0), ("reinforce_pp", 2.0), ("dapo", 0.0), ("dapo", 2.0), ("gspo", 2.0)])
def test_prepare_and_loss_run_together(algorithm, tis):
    """Each algorithm's train spec end to end on a step buffer, the model's readout drawn at
    random: the batch its prepare builds is what its loss reads; with the mismatch correction,
    the step's figures carry the mismatch and the loss its truncated weights."""
    spec = run_spec(_config(algorithm, **{"ppo.tis_cap": tis, "dapo.oversample": 2}))
    train = spec.algorithm.train[spec.algorithm.trained_role]
    rng = np.random.default_rng(20)
    rows, s, n = 8 * G, 12, N
    mask = _mask(rng.integers(1, n + 1, rows), n)
    behav, ref = _logps(21, mask)
    buf = {"seq_tokens_bs": rng.integers(0, 50, (rows, s)), "seq_mask_bs": np.ones((rows, s)),
           "response_mask_bn": mask, "behav_logp_bn": behav, "ref_logp_bn": ref,
           "scores_b": rng.integers(0, 2, rows).astype(np.float32),
           decoupled.PROX_KEY: behav + 0.01 * rng.standard_normal(mask.shape).astype(np.float32)}
    controller = {k: jnp.float32(v) for k, v in spec.algorithm.controller_init.items()}
    batch, stats = jax.jit(train.prepare)({k: jnp.asarray(v) for k, v in buf.items()}, controller)
    trained = rows // 2 if algorithm == "dapo" else rows
    assert batch["tokens_bt"].shape == (trained, s) and batch["mask_bn"].shape == (trained, n)
    out = InferenceOutput(
        logprobs_bt=jnp.asarray(-rng.random((trained, s)), jnp.float32),
        entropy_bt=jnp.asarray(rng.random((trained, s)), jnp.float32))
    loss_sum, weight, loss_stats = jax.jit(train.loss_fn)(out, batch)
    assert np.isfinite(float(loss_sum)) and float(weight) > 0
    assert ("mismatch_max" in stats) == (tis > 0)
    assert ("behav_imp_weight" in loss_stats) == (tis > 0)
    if tis:
        gap = np.abs(buf[decoupled.PROX_KEY].astype(np.float64) - behav)[mask > 0]
        _close(stats["mismatch_max"], gap.max())
