"""Training objectives for every call kind's `train_step`: PPO/GRPO, critic, SFT, RM, DPO,
plus the Safe-RLHF Lagrange multiplier.

Train-step contract: each loss returns `(loss_sum, weight, stats)`. The optimised quantity is
Σ_micro loss_sum / Σ_micro weight, so micro-batching and data-parallel splits never change
the objective. `stats` are float32 scalar SUMS to be divided by the same total weight.

Per-token arrays are `[batch, n]` over response tokens with `mask_bn` (1 = valid). Inputs that
are targets (old logprobs, advantages, returns, reference logprobs) are wrapped in
`stop_gradient` here, so callers may pass arrays that share a graph with the parameters.
"""

from __future__ import annotations

import dataclasses
import enum

import chex
import jax
import jax.numpy as jnp

from jaxrlhf.algorithms.kl import KLEstimator, kl_per_token

LossOutput = tuple[jax.Array, jax.Array, dict[str, jax.Array]]
_sg = jax.lax.stop_gradient


class LossAggregation(enum.Enum):
    """How per-token losses are reduced to `(loss_sum, weight)`."""

    TOKEN_MEAN = "token_mean"  # Σ_bt l·m / Σ_bt m: every token weighs the same (PPO, DAPO)
    SEQ_MEAN_TOKEN_MEAN = "seq_mean_token_mean"  # mean over sequences of per-sequence means (GRPO)
    # Dr. GRPO (Liu et al. 2025): each sequence's token SUM over a constant, the response
    # budget n (mask width), then the mean over sequences: no length normalisation, so a long
    # wrong answer is not penalised less per token than a short one.
    SEQ_MEAN_TOKEN_SUM_NORM = "seq_mean_token_sum_norm"


def aggregate(
    per_token_bn: jax.Array, mask_bn: jax.Array, aggregation: LossAggregation
) -> tuple[jax.Array, jax.Array]:
    """Reduce a per-token quantity to (sum, weight) following `aggregation`.

    Args:
      per_token_bn: [batch, n] per-token values (anything at masked positions is ignored).
      mask_bn: [batch, n] 1 = valid token.
      aggregation: token-level or sequence-level mean.

    Returns:
      (sum, weight) float32 scalars; sum / weight is the aggregated mean. For the
      sequence-level mean, rows without valid tokens count neither in sum nor in weight.
    """
    chex.assert_equal_shape((per_token_bn, mask_bn))
    valid_bn = mask_bn > 0
    masked_bn = jnp.where(valid_bn, per_token_bn.astype(jnp.float32), 0.0)
    count_b = jnp.sum(valid_bn, axis=-1).astype(jnp.float32)
    match aggregation:
        case LossAggregation.TOKEN_MEAN:
            return jnp.sum(masked_bn), jnp.sum(count_b)
        case LossAggregation.SEQ_MEAN_TOKEN_MEAN:
            seq_mean_b = jnp.sum(masked_bn, axis=-1) / jnp.maximum(count_b, 1.0)
            # Summed in f32, not as a count: a data-parallel step then all-reduces it together
            # with the gradients at the end, not alone mid-step (an early rendezvous blocks
            # a worker thread until the slowest device gets there; XLA only combines
            # all-reduces of one element type).
            return jnp.sum(seq_mean_b), jnp.sum((count_b > 0).astype(jnp.float32))
        case LossAggregation.SEQ_MEAN_TOKEN_SUM_NORM:
            seq_sum_b = jnp.sum(masked_bn, axis=-1) / per_token_bn.shape[-1]
            return jnp.sum(seq_sum_b), jnp.sum((count_b > 0).astype(jnp.float32))
        case _:
            raise ValueError(f"unknown aggregation {aggregation}")


def _zero_padding(mask: jax.Array, *arrays: jax.Array | None) -> list[jax.Array | None]:
    """Replace masked entries by 0 before any arithmetic.

    Padding may hold garbage (inf/nan from a padded forward pass); masking only the result
    would still leak nan into gradients through exp/square (0·nan = nan in the backward).
    """
    valid = mask > 0
    return [None if x is None else jnp.where(valid, x, jnp.zeros_like(x)) for x in arrays]


def _reduce(
    loss_bn: jax.Array,
    stats_bn: dict[str, jax.Array],
    mask_bn: jax.Array,
    aggregation: LossAggregation,
) -> LossOutput:
    loss_sum, weight = aggregate(loss_bn, mask_bn, aggregation)
    stats = {k: aggregate(_sg(v), mask_bn, aggregation)[0] for k, v in stats_bn.items()}
    return loss_sum, weight, stats


@dataclasses.dataclass(frozen=True)
class PPOLossConfig:
    """Clipped-surrogate policy loss.

    Attributes:
      clip_eps: ratio clipped to [1 − clip_eps, 1 + clip_eps_high].
      clip_eps_high: upper clip (DAPO "clip-higher"); None = clip_eps.
      dual_clip: c > 1 of dual-clip PPO (Ye et al. 2020): for A < 0 the loss is capped at
        −c·A, so a huge ratio on a bad token cannot dominate. None disables it.
      behav_imp_weight_cap: decoupled PPO only: tokens whose π_prox/π_behav exceeds this are
        dropped from the loss (kept in the weight), as in AReaL. None keeps all.
      tis_cap: decoupled PPO only: truncated importance sampling (Yao et al. 2025) of the
        generation/training mismatch: π_prox/π_behav is truncated at this (min(w, C)) rather
        than its tokens dropped. None leaves the weight as it is.
      entropy_coef: weight of the entropy bonus (loss −= coef·H) when entropies are given.
      aggregation: token-level or sequence-level mean.
    """

    clip_eps: float = 0.2
    clip_eps_high: float | None = None
    dual_clip: float | None = None
    behav_imp_weight_cap: float | None = None
    tis_cap: float | None = None
    entropy_coef: float = 0.0
    aggregation: LossAggregation = LossAggregation.TOKEN_MEAN

    def __post_init__(self):
        if self.dual_clip is not None and self.dual_clip <= 1.0:
            raise ValueError(f"dual_clip={self.dual_clip} must be > 1")
        if self.clip_eps <= 0 or (self.clip_eps_high is not None and self.clip_eps_high <= 0):
            raise ValueError(f"clip epsilons must be > 0: {self}")
        if self.tis_cap is not None and self.tis_cap <= 0:
            raise ValueError(f"tis_cap={self.tis_cap} must be > 0")


def _clipped_surrogate_bn(
    logp_bn: jax.Array, denom_logp_bn: jax.Array, advantages_bn: jax.Array, config: PPOLossConfig
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Per-token −min(r·A, clip(r)·A) with optional dual clip; r = π_θ / π_denom."""
    log_ratio_bn = logp_bn.astype(jnp.float32) - _sg(denom_logp_bn).astype(jnp.float32)
    ratio_bn = jnp.exp(log_ratio_bn)
    adv_bn = _sg(advantages_bn).astype(jnp.float32)
    high = config.clip_eps if config.clip_eps_high is None else config.clip_eps_high
    unclipped_bn = -adv_bn * ratio_bn
    clipped_bn = -adv_bn * jnp.clip(ratio_bn, 1.0 - config.clip_eps, 1.0 + high)
    # `where` instead of `maximum` so the gradient is exactly the active branch's.
    is_clipped_bn = clipped_bn > unclipped_bn
    loss_bn = jnp.where(is_clipped_bn, clipped_bn, unclipped_bn)
    is_dual_clipped_bn = jnp.zeros_like(is_clipped_bn)
    if config.dual_clip is not None:
        capped_bn = -adv_bn * config.dual_clip
        is_dual_clipped_bn = (adv_bn < 0) & (capped_bn < loss_bn)
        loss_bn = jnp.where(is_dual_clipped_bn, capped_bn, loss_bn)
    stats_bn = {
        "clip_frac": is_clipped_bn.astype(jnp.float32),
        "dual_clip_frac": is_dual_clipped_bn.astype(jnp.float32),
        "importance_weight": ratio_bn,
        # k3 estimate of KL(π_denom ‖ π_θ) on tokens sampled from π_denom.
        "approx_kl": jnp.expm1(log_ratio_bn) - log_ratio_bn,
    }
    return loss_bn, stats_bn


def _policy_loss_bn(
    logp_bn: jax.Array,
    old_logp_bn: jax.Array,
    advantages_bn: jax.Array,
    config: PPOLossConfig,
    proximal_logp_bn: jax.Array | None,
    entropy_bn: jax.Array | None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Per-token PPO loss (standard or decoupled) plus the entropy bonus, unmasked."""
    if proximal_logp_bn is None:
        loss_bn, stats_bn = _clipped_surrogate_bn(logp_bn, old_logp_bn, advantages_bn, config)
    else:
        # AReaL's decoupled objective: trust region around π_prox, off-policy correction
        # π_prox / π_behav for tokens generated by an older (behaviour) policy.
        loss_bn, stats_bn = _clipped_surrogate_bn(
            logp_bn, proximal_logp_bn, advantages_bn, config
        )
        behav_log_ratio_bn = _sg(proximal_logp_bn - old_logp_bn).astype(jnp.float32)
        behav_weight_bn = jnp.exp(behav_log_ratio_bn)
        kept_bn = jnp.ones_like(behav_weight_bn, dtype=bool)
        if config.behav_imp_weight_cap is not None:
            kept_bn = behav_weight_bn <= config.behav_imp_weight_cap
        behav_weight_bn = jnp.where(kept_bn, behav_weight_bn, 0.0)
        if config.tis_cap is not None:
            behav_weight_bn = jnp.minimum(behav_weight_bn, config.tis_cap)
        loss_bn = loss_bn * behav_weight_bn
        stats_bn |= {
            "behav_imp_weight": behav_weight_bn,
            "behav_approx_kl": jnp.where(kept_bn, behav_log_ratio_bn, 0.0),
            "behav_kept_frac": kept_bn.astype(jnp.float32),
        }
    if entropy_bn is not None:
        loss_bn = loss_bn - config.entropy_coef * entropy_bn.astype(jnp.float32)
        stats_bn["entropy"] = entropy_bn.astype(jnp.float32)
    return loss_bn, stats_bn


def ppo_policy_loss(
    logp_bn: jax.Array,
    old_logp_bn: jax.Array,
    advantages_bn: jax.Array,
    mask_bn: jax.Array,
    config: PPOLossConfig,
    proximal_logp_bn: jax.Array | None = None,
    entropy_bn: jax.Array | None = None,
) -> LossOutput:
    """PPO clipped policy loss, optionally dual-clipped, decoupled, with entropy bonus.

    Standard: l_t = −min(r_t A_t, clip(r_t) A_t), r_t = π_θ / π_old.
    Decoupled (AReaL, pass `proximal_logp_bn`): r_t = π_θ / π_prox and l_t is multiplied by
    π_prox / π_behav, where `old_logp_bn` then holds the BEHAVIOUR logprobs recorded at
    generation time and π_prox is the policy at the start of this training step.

    Args:
      logp_bn: [batch, n] log π_θ of the response tokens (differentiated).
      old_logp_bn: [batch, n] log π_old (standard) or log π_behav (decoupled).
      advantages_bn: [batch, n] advantages.
      mask_bn: [batch, n] 1 = valid response token.
      config: static loss configuration.
      proximal_logp_bn: [batch, n] log π_prox, enables the decoupled objective.
      entropy_bn: [batch, n] per-token policy entropies for the bonus (differentiated).

    Returns:
      (loss_sum, weight, stats) with stats clip_frac, dual_clip_frac, importance_weight,
      approx_kl (+ behav_imp_weight, behav_approx_kl, behav_kept_frac when decoupled,
      + entropy when given).
    """
    chex.assert_equal_shape((logp_bn, old_logp_bn, advantages_bn, mask_bn))
    logp_bn, old_logp_bn, advantages_bn, proximal_logp_bn, entropy_bn = _zero_padding(
        mask_bn, logp_bn, old_logp_bn, advantages_bn, proximal_logp_bn, entropy_bn
    )
    loss_bn, stats_bn = _policy_loss_bn(
        logp_bn, old_logp_bn, advantages_bn, config, proximal_logp_bn, entropy_bn
    )
    return _reduce(loss_bn, stats_bn, mask_bn, config.aggregation)


@dataclasses.dataclass(frozen=True)
class GRPOLossConfig:
    """GRPO (DeepSeekMath): clipped surrogate plus β·KL(π_θ ‖ π_ref) inside the loss.

    Attributes:
      policy: the surrogate's clipping/aggregation; GRPO averages per sequence first.
      kl_coef: β; 0 turns the KL term off (any finite reference logprobs may be passed).
      kl_estimator: per-token KL estimator (k3 in the paper).
    """

    policy: PPOLossConfig = PPOLossConfig(aggregation=LossAggregation.SEQ_MEAN_TOKEN_MEAN)
    kl_coef: float = 0.04
    kl_estimator: KLEstimator = KLEstimator.K3


def grpo_loss(
    logp_bn: jax.Array,
    old_logp_bn: jax.Array,
    ref_logp_bn: jax.Array,
    advantages_bn: jax.Array,
    mask_bn: jax.Array,
    config: GRPOLossConfig,
    proximal_logp_bn: jax.Array | None = None,
    entropy_bn: jax.Array | None = None,
) -> LossOutput:
    """GRPO loss: l_t = PPO surrogate_t + β·k(π_θ, π_ref)_t, aggregated per `config.policy`.

    Args:
      logp_bn: [batch, n] log π_θ (differentiated, also through the KL term).
      old_logp_bn: [batch, n] log π_old (or π_behav when decoupled).
      ref_logp_bn: [batch, n] log π_ref.
      advantages_bn: [batch, n] group-normalised advantages broadcast to tokens.
      mask_bn: [batch, n] 1 = valid response token.
      config: static loss configuration.
      proximal_logp_bn: optional [batch, n] log π_prox for the decoupled objective.
      entropy_bn: optional [batch, n] entropies for the bonus.

    Returns:
      (loss_sum, weight, stats): the policy-loss stats plus `ref_kl`.
    """
    chex.assert_equal_shape((logp_bn, old_logp_bn, ref_logp_bn, advantages_bn, mask_bn))
    logp_bn, old_logp_bn, ref_logp_bn, advantages_bn, proximal_logp_bn, entropy_bn = (
        _zero_padding(
            mask_bn, logp_bn, old_logp_bn, ref_logp_bn, advantages_bn, proximal_logp_bn, entropy_bn
        )
    )
    loss_bn, stats_bn = _policy_loss_bn(
        logp_bn, old_logp_bn, advantages_bn, config.policy, proximal_logp_bn, entropy_bn
    )
    kl_bn = kl_per_token(logp_bn, _sg(ref_logp_bn), config.kl_estimator)
    stats_bn["ref_kl"] = kl_bn
    return _reduce(loss_bn + config.kl_coef * kl_bn, stats_bn, mask_bn, config.policy.aggregation)


@dataclasses.dataclass(frozen=True)
class ValueLossConfig:
    """Critic regression loss ½·max((V − R)², (V_clip − R)²).

    Attributes:
      clip_eps_value: V_clip = V_old + clip(V − V_old, ±clip_eps_value); None = plain MSE.
      aggregation: token-level or sequence-level mean.
    """

    clip_eps_value: float | None = 0.2
    aggregation: LossAggregation = LossAggregation.TOKEN_MEAN


def value_loss(
    values_bn: jax.Array,
    old_values_bn: jax.Array,
    returns_bn: jax.Array,
    mask_bn: jax.Array,
    config: ValueLossConfig,
) -> LossOutput:
    """Clipped value loss of the PPO critic.

    Args:
      values_bn: [batch, n] current critic values (differentiated).
      old_values_bn: [batch, n] values recorded when the advantages were computed.
      returns_bn: [batch, n] regression targets (GAE returns).
      mask_bn: [batch, n] 1 = valid response token.
      config: static loss configuration.

    Returns:
      (loss_sum, weight, stats) with stats value_clip_frac (tokens where the clipped
      branch is active) and value_error ((V − R)²).
    """
    chex.assert_equal_shape((values_bn, old_values_bn, returns_bn, mask_bn))
    values_bn, old_values_bn, returns_bn = _zero_padding(
        mask_bn, values_bn, old_values_bn, returns_bn
    )
    values_bn = values_bn.astype(jnp.float32)
    returns_bn = _sg(returns_bn).astype(jnp.float32)
    unclipped_bn = jnp.square(values_bn - returns_bn)
    loss_bn, is_clipped_bn = unclipped_bn, jnp.zeros_like(unclipped_bn, dtype=bool)
    if config.clip_eps_value is not None:
        old_bn = _sg(old_values_bn).astype(jnp.float32)
        eps = config.clip_eps_value
        clipped_bn = jnp.square(old_bn + jnp.clip(values_bn - old_bn, -eps, eps) - returns_bn)
        is_clipped_bn = clipped_bn > unclipped_bn
        loss_bn = jnp.where(is_clipped_bn, clipped_bn, unclipped_bn)
    stats_bn = {"value_clip_frac": is_clipped_bn.astype(jnp.float32), "value_error": unclipped_bn}
    return _reduce(0.5 * loss_bn, stats_bn, mask_bn, config.aggregation)


def sft_loss(
    logp_bn: jax.Array,
    mask_bn: jax.Array,
    aggregation: LossAggregation = LossAggregation.TOKEN_MEAN,
) -> LossOutput:
    """Token negative log-likelihood for supervised fine-tuning.

    Args:
      logp_bn: [batch, n] log-probabilities of the target tokens (differentiated).
      mask_bn: [batch, n] 1 = token is trained on (typically answer tokens only).
      aggregation: token-level or sequence-level mean.

    Returns:
      (loss_sum, weight, stats) with stats nll (= loss_sum, for logging next to others).
    """
    chex.assert_equal_shape((logp_bn, mask_bn))
    (logp_bn,) = _zero_padding(mask_bn, logp_bn)
    nll_bn = -logp_bn.astype(jnp.float32)
    return _reduce(nll_bn, {"nll": nll_bn}, mask_bn, aggregation)


def _sequence_reduce(
    loss_b: jax.Array, stats_b: dict[str, jax.Array], valid_b: jax.Array | None
) -> LossOutput:
    """Sequence-level (sum, count, stat sums); `valid_b` drops padding rows of a bucket."""
    valid_b = jnp.ones(loss_b.shape, bool) if valid_b is None else valid_b > 0

    def total(x_b):
        return jnp.sum(jnp.where(valid_b, x_b.astype(jnp.float32), 0.0))

    stats = {k: _sg(total(v)) for k, v in stats_b.items()}
    # The count in f32 (see `aggregate`): all-reduced with the gradients, not alone mid-step.
    return total(loss_b), jnp.sum(valid_b.astype(jnp.float32)), stats


def reward_model_loss(
    chosen_scores_b: jax.Array, rejected_scores_b: jax.Array, valid_b: jax.Array | None = None
) -> LossOutput:
    """Bradley–Terry pairwise loss −log σ(r_chosen − r_rejected), one term per pair.

    Args:
      chosen_scores_b: [batch] scalar scores of the preferred responses (differentiated).
      rejected_scores_b: [batch] scores of the dispreferred responses (differentiated).
      valid_b: optional [batch] 1 = real pair, 0 = padding.

    Returns:
      (loss_sum, number of pairs, stats) with stats accuracy (chosen strictly above
      rejected), margin, chosen_score, rejected_score.
    """
    chex.assert_rank(chosen_scores_b, 1)
    chex.assert_equal_shape((chosen_scores_b, rejected_scores_b))
    if valid_b is not None:
        chosen_scores_b, rejected_scores_b = _zero_padding(
            valid_b, chosen_scores_b, rejected_scores_b
        )
    margin_b = chosen_scores_b.astype(jnp.float32) - rejected_scores_b.astype(jnp.float32)
    stats_b = {
        "accuracy": (margin_b > 0).astype(jnp.float32),
        "margin": margin_b,
        "chosen_score": chosen_scores_b,
        "rejected_score": rejected_scores_b,
    }
    return _sequence_reduce(-jax.nn.log_sigmoid(margin_b), stats_b, valid_b)


@dataclasses.dataclass(frozen=True)
class DPOLossConfig:
    """Sigmoid DPO (Rafailov et al. 2023) with conservative label smoothing (cDPO).

    Attributes:
      beta: inverse temperature of the implicit reward β·log(π_θ / π_ref).
      label_smoothing: probability ε that a preference label is flipped; 0 = plain DPO.
    """

    beta: float = 0.1
    label_smoothing: float = 0.0

    def __post_init__(self):
        if not 0.0 <= self.label_smoothing < 0.5:
            raise ValueError(f"label_smoothing={self.label_smoothing} must be in [0, 0.5)")


def dpo_loss(
    chosen_logp_b: jax.Array,
    rejected_logp_b: jax.Array,
    ref_chosen_logp_b: jax.Array,
    ref_rejected_logp_b: jax.Array,
    config: DPOLossConfig,
    valid_b: jax.Array | None = None,
) -> LossOutput:
    """DPO loss −(1−ε)·log σ(βh) − ε·log σ(−βh), h = chosen minus rejected log-ratio.

    Args:
      chosen_logp_b: [batch] Σ log π_θ over the chosen response (differentiated).
      rejected_logp_b: [batch] Σ log π_θ over the rejected response (differentiated).
      ref_chosen_logp_b: [batch] Σ log π_ref over the chosen response.
      ref_rejected_logp_b: [batch] Σ log π_ref over the rejected response.
      config: static loss configuration.
      valid_b: optional [batch] 1 = real pair, 0 = padding.

    Returns:
      (loss_sum, number of pairs, stats) with the implicit rewards' stats reward_accuracy,
      reward_margin, chosen_reward, rejected_reward.
    """
    chex.assert_rank(chosen_logp_b, 1)
    chex.assert_equal_shape(
        (chosen_logp_b, rejected_logp_b, ref_chosen_logp_b, ref_rejected_logp_b)
    )
    if valid_b is not None:
        chosen_logp_b, rejected_logp_b, ref_chosen_logp_b, ref_rejected_logp_b = _zero_padding(
            valid_b, chosen_logp_b, rejected_logp_b, ref_chosen_logp_b, ref_rejected_logp_b
        )
    chosen_log_ratio_b = chosen_logp_b - _sg(ref_chosen_logp_b)
    rejected_log_ratio_b = rejected_logp_b - _sg(ref_rejected_logp_b)
    chosen_reward_b = config.beta * chosen_log_ratio_b.astype(jnp.float32)
    rejected_reward_b = config.beta * rejected_log_ratio_b.astype(jnp.float32)
    margin_b = chosen_reward_b - rejected_reward_b
    eps = config.label_smoothing
    loss_b = -(1.0 - eps) * jax.nn.log_sigmoid(margin_b) - eps * jax.nn.log_sigmoid(-margin_b)
    stats_b = {
        "reward_accuracy": (margin_b > 0).astype(jnp.float32),
        "reward_margin": margin_b,
        "chosen_reward": chosen_reward_b,
        "rejected_reward": rejected_reward_b,
    }
    return _sequence_reduce(loss_b, stats_b, valid_b)


@dataclasses.dataclass(frozen=True)
class LagrangeConfig:
    """Safe-RLHF's Lagrange multiplier λ ≥ 0 on the constraint E[cost] ≤ cost_limit.

    λ is kept as log λ (so it stays positive) and moved by one SGD step of dual ascent on
    −(E[cost] − cost_limit)·λ per training step, as in Dai et al. 2023.

    Attributes:
      cost_limit: constraint threshold d on the mean episode cost.
      lambda_init: λ at step 0 (> 0).
      lambda_lr: SGD step size on log λ.
      lambda_max: upper bound on λ; None = unbounded.
    """

    cost_limit: float = 0.0
    lambda_init: float = 1.0
    lambda_lr: float = 0.1
    lambda_max: float | None = None

    def __post_init__(self):
        if self.lambda_init <= 0 or (self.lambda_max is not None and self.lambda_max <= 0):
            raise ValueError(f"lambda_init and lambda_max must be > 0: {self}")


def lagrange_init(config: LagrangeConfig) -> jax.Array:
    """Initial log λ as a float32 scalar."""
    return jnp.log(jnp.float32(config.lambda_init))


def lagrange_update(
    log_lambda: jax.Array, mean_episode_cost: float | jax.Array, config: LagrangeConfig
) -> jax.Array:
    """One dual-ascent step: log λ ← log λ + lr·(E[cost] − d)·λ, then clamp at log λ_max.

    Args:
      log_lambda: current log λ (scalar).
      mean_episode_cost: mean sequence cost over the recent window (scalar).
      config: static multiplier configuration.

    Returns:
      float32 scalar, the next log λ.
    """
    log_lambda = jnp.asarray(log_lambda, jnp.float32)
    # d/dlogλ of −(C − d)·exp(logλ) is −(C − d)·λ; SGD subtracts lr times that.
    violation = mean_episode_cost - config.cost_limit
    log_lambda = log_lambda + config.lambda_lr * violation * jnp.exp(log_lambda)
    if config.lambda_max is not None:
        log_lambda = jnp.minimum(log_lambda, jnp.log(jnp.float32(config.lambda_max)))
    return log_lambda
