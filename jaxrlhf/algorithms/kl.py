"""KL divergence to the reference policy: per-token estimators, penalised rewards, controllers.

The estimators follow J. Schulman, "Approximating KL divergence" (2020). With tokens drawn
from the policy π and r = π_ref(x) / π(x):

  k1 = −log r               unbiased, high variance, can be negative per token
  k2 = ½ (log r)²           biased, low variance, ≥ 0
  k3 = (r − 1) − log r      unbiased, low variance, ≥ 0 (used by GRPO)
"""

from __future__ import annotations

import dataclasses
import enum

import chex
import jax
import jax.numpy as jnp


class KLEstimator(enum.Enum):
    """Per-token estimator of KL(π ‖ π_ref) from the two log-probabilities of the token."""

    K1 = "k1"
    K2 = "k2"
    K3 = "k3"


def kl_per_token(
    logp_bn: jax.Array,
    ref_logp_bn: jax.Array,
    estimator: KLEstimator,
    log_ratio_clip: float | None = None,
) -> jax.Array:
    """Estimate KL(π ‖ π_ref) at each token; differentiable in both inputs.

    Args:
      logp_bn: [batch, n] log π(token) of the policy the tokens were sampled from.
      ref_logp_bn: [batch, n] log π_ref(token).
      estimator: which of k1/k2/k3.
      log_ratio_clip: if set, clip log(π/π_ref) to ±this first; k3 exponentiates the
        ratio and overflows float32 when the reference is far more confident than π.

    Returns:
      [batch, n] float32 per-token estimates (not masked).
    """
    chex.assert_equal_shape((logp_bn, ref_logp_bn))
    log_ratio_bn = logp_bn.astype(jnp.float32) - ref_logp_bn.astype(jnp.float32)
    if log_ratio_clip is not None:
        log_ratio_bn = jnp.clip(log_ratio_bn, -log_ratio_clip, log_ratio_clip)
    match estimator:
        case KLEstimator.K1:
            return log_ratio_bn
        case KLEstimator.K2:
            return 0.5 * jnp.square(log_ratio_bn)
        case KLEstimator.K3:
            # expm1 keeps precision when π ≈ π_ref, where (r − 1) and log r nearly cancel.
            return jnp.expm1(-log_ratio_bn) + log_ratio_bn
        case _:
            raise ValueError(f"unknown KL estimator {estimator}")


def last_token_one_hot(mask_bn: jax.Array) -> jax.Array:
    """1 at the last valid token of each row, 0 elsewhere (all 0 for an empty row).

    Args:
      mask_bn: [batch, n] 1 = valid token; need not be a prefix.

    Returns:
      [batch, n] float32 one-hot rows.
    """
    valid_bn = mask_bn > 0
    n = mask_bn.shape[-1]
    last_b = n - 1 - jnp.argmax(valid_bn[:, ::-1], axis=-1)
    one_hot_bn = jax.nn.one_hot(last_b, n, dtype=jnp.float32)
    return jnp.where(valid_bn, one_hot_bn, 0.0)


def kl_penalized_rewards(
    scores_b: jax.Array,
    logp_bn: jax.Array,
    ref_logp_bn: jax.Array,
    mask_bn: jax.Array,
    kl_coef: float | jax.Array,
    estimator: KLEstimator = KLEstimator.K1,
    score_clip: float | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Dense RLHF rewards: −β·KL on every valid token, plus the score on the last one.

    r_t = −β·k(t) + [t = last valid token]·clip(score, ±score_clip)   (Ziegler et al. 2019).

    Args:
      scores_b: [batch] sequence-level reward-model (or rule) scores.
      logp_bn: [batch, n] behaviour-policy log-probabilities of the response tokens.
      ref_logp_bn: [batch, n] reference-model log-probabilities of the same tokens.
      mask_bn: [batch, n] 1 = valid response token.
      kl_coef: β, a float or a traced scalar from the KL controller.
      estimator: per-token KL estimator.
      score_clip: clip scores to [−score_clip, score_clip] if set.

    Returns:
      (rewards_bn, kl_bn), both [batch, n] float32 and 0 where masked; kl_bn is the
      unscaled per-token KL, for logging and the adaptive controller.
    """
    chex.assert_rank(scores_b, 1)
    chex.assert_equal_shape((logp_bn, ref_logp_bn, mask_bn))
    chex.assert_equal_shape_prefix((scores_b, mask_bn), 1)
    scores_b = scores_b.astype(jnp.float32)
    if score_clip is not None:
        scores_b = jnp.clip(scores_b, -score_clip, score_clip)
    kl_bn = jnp.where(mask_bn > 0, kl_per_token(logp_bn, ref_logp_bn, estimator), 0.0)
    rewards_bn = -kl_coef * kl_bn + scores_b[:, None] * last_token_one_hot(mask_bn)
    return rewards_bn, kl_bn


class KLControllerKind(enum.Enum):
    """How the KL coefficient β evolves over training."""

    FIXED = "fixed"
    ADAPTIVE = "adaptive"  # proportional controller of Ziegler et al. 2019


@dataclasses.dataclass(frozen=True)
class KLControllerConfig:
    """KL-coefficient controller.

    Attributes:
      kind: fixed β or the adaptive controller.
      init_kl_coef: β at step 0.
      target: KL (per sequence, nats) the adaptive controller steers towards.
      horizon: number of samples over which a relative error is corrected.
      max_error: the proportional error is clipped to ±this (0.2 in the paper).
    """

    kind: KLControllerKind = KLControllerKind.FIXED
    init_kl_coef: float = 0.1
    target: float = 6.0
    horizon: float = 10000.0
    max_error: float = 0.2

    def __post_init__(self):
        if self.init_kl_coef < 0:
            raise ValueError(f"init_kl_coef={self.init_kl_coef} must be >= 0")
        if self.kind is KLControllerKind.ADAPTIVE and (self.target <= 0 or self.horizon <= 0):
            raise ValueError(f"adaptive KL needs target > 0 and horizon > 0, got {self}")


def update_kl_coef(
    kl_coef: float | jax.Array,
    current_kl: float | jax.Array,
    n_steps: int | jax.Array,
    config: KLControllerConfig,
) -> jax.Array:
    """One controller update after observing `current_kl` on a batch of `n_steps` samples.

    Adaptive: e = clip(KL / target − 1, ±max_error); β ← β · (1 + e · n_steps / horizon).

    Args:
      kl_coef: current β (scalar).
      current_kl: mean KL per sequence observed on the batch (scalar).
      n_steps: samples in the batch (scalar).
      config: controller configuration (static).

    Returns:
      float32 scalar, the next β.
    """
    kl_coef = jnp.asarray(kl_coef, jnp.float32)
    match config.kind:
        case KLControllerKind.FIXED:
            return kl_coef
        case KLControllerKind.ADAPTIVE:
            error = jnp.clip(current_kl / config.target - 1.0, -config.max_error, config.max_error)
            return kl_coef * (1.0 + error * n_steps / config.horizon)
        case _:
            raise ValueError(f"unknown KL controller {config.kind}")


def update_controller(
    controller: dict, stats: dict, batch_size: int, config: KLControllerConfig
) -> dict:
    """The host-side controller state after one step: β from `update_kl_coef` on the step's
    mean KL per sequence (`stats["kl"]`) over `batch_size` sequences; other entries (e.g.
    Safe-RLHF's λ) carried over unchanged.

    Args:
      controller: {"kl_coef": β, ...} of the previous step.
      stats: the step's statistics, with "kl".
      batch_size: sequences in the step's batch.
      config: the KL controller.

    Returns:
      A new dict, β a Python float.
    """
    new = update_kl_coef(controller["kl_coef"], stats["kl"], batch_size, config)
    return {**controller, "kl_coef": float(new)}
