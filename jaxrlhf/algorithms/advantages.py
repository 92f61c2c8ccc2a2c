"""Advantage estimators: GAE, returns, masked whitening, GRPO groups, ReMax, Safe-RLHF.

Per-token arrays are `[batch, n]` over RESPONSE tokens; `mask_bn` is 1 on valid response
tokens and 0 on padding (after EOS, or anywhere a token must not be trained on). Every
function returns zeros at masked positions, so callers can sum without re-masking.
"""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp


def _valid(mask_bn: jax.Array) -> jax.Array:
    return mask_bn > 0


def masked_sum(x: jax.Array, mask: jax.Array, axis: int | None = None) -> jax.Array:
    """Σ x over mask, treating masked entries as exactly 0 (even if they hold inf/nan).

    Args:
      x: array of any shape.
      mask: array of the same shape, nonzero = valid.
      axis: reduction axis, None for all.

    Returns:
      float32 sums over `axis`.
    """
    chex.assert_equal_shape((x, mask))
    return jnp.sum(jnp.where(_valid(mask), x.astype(jnp.float32), 0.0), axis=axis)


def masked_mean(x: jax.Array, mask: jax.Array, axis: int | None = None) -> jax.Array:
    """Mean of x over the valid entries; 0 where nothing is valid."""
    count = jnp.sum(_valid(mask), axis=axis).astype(jnp.float32)
    return masked_sum(x, mask, axis) / jnp.maximum(count, 1.0)


def masked_var(x: jax.Array, mask: jax.Array, unbiased: bool = False) -> jax.Array:
    """Variance of x over all valid entries (two-pass, so no E[x²]−E[x]² cancellation).

    Args:
      x: array of any shape.
      mask: same shape, nonzero = valid.
      unbiased: divide by (count − 1) instead of count (Bessel's correction).

    Returns:
      float32 scalar variance.
    """
    count = jnp.sum(_valid(mask)).astype(jnp.float32)
    centred = x.astype(jnp.float32) - masked_mean(x, mask)
    denominator = count - 1.0 if unbiased else count
    return masked_sum(centred * centred, mask) / jnp.maximum(denominator, 1.0)


def masked_whiten(
    x_bn: jax.Array,
    mask_bn: jax.Array,
    *,
    shift_mean: bool = True,
    unbiased: bool = False,
    eps: float = 1e-5,
) -> jax.Array:
    """Normalise x to zero mean and unit variance over the valid tokens of the whole batch.

    Statistics are global over every valid entry (not per row), as PPO advantage whitening
    wants. Under SPMD the batch is one global array, so this is global across data ranks.

    Args:
      x_bn: [batch, n] values (typically advantages).
      mask_bn: [batch, n] 1 = valid token.
      shift_mean: subtract the mean; if False only divide by the std (keeps the sign of
        each entry, as is customary when whitening rewards).
      unbiased: use Bessel's correction for the variance.
      eps: added to the variance before the square root.

    Returns:
      [batch, n] float32 whitened values, 0 at masked positions.
    """
    chex.assert_equal_shape((x_bn, mask_bn))
    x_bn = x_bn.astype(jnp.float32)
    inv_std = jax.lax.rsqrt(masked_var(x_bn, mask_bn, unbiased) + eps)
    if shift_mean:
        x_bn = x_bn - masked_mean(x_bn, mask_bn)
    scaled_bn = x_bn * inv_std
    return jnp.where(_valid(mask_bn), scaled_bn, 0.0)


def gae(
    rewards_bn: jax.Array,
    values_bn: jax.Array,
    mask_bn: jax.Array,
    gamma: float | jax.Array,
    lam: float | jax.Array,
) -> tuple[jax.Array, jax.Array]:
    """Generalised advantage estimation (Schulman et al. 2016), backward over tokens.

    δ_t = r_t + γ V_{t'} − V_t and A_t = δ_t + γλ A_{t'}, where t' is the next VALID
    token after t. Masked positions are skipped entirely (their reward and value are
    ignored and they pass the running quantities through unchanged), and after the last
    valid token the bootstrap value and advantage are 0 (the episode ends at EOS).

    Args:
      rewards_bn: [batch, n] per-token rewards (e.g. KL-penalised, score at the last token).
      values_bn: [batch, n] critic values V(s_t) of each response token's state.
      mask_bn: [batch, n] 1 = valid response token.
      gamma: discount γ.
      lam: GAE λ.

    Returns:
      (advantages_bn, returns_bn), both [batch, n] float32 and 0 where masked;
      returns = advantages + values (the critic's regression target).
    """
    chex.assert_equal_shape((rewards_bn, values_bn, mask_bn))
    valid_nb = _valid(mask_bn).T
    rewards_nb = rewards_bn.astype(jnp.float32).T
    values_nb = values_bn.astype(jnp.float32).T

    def step(carry, xs):
        next_value_b, next_adv_b = carry
        reward_b, value_b, valid_b = xs
        delta_b = reward_b + gamma * next_value_b - value_b
        adv_b = delta_b + gamma * lam * next_adv_b
        carry = (jnp.where(valid_b, value_b, next_value_b), jnp.where(valid_b, adv_b, next_adv_b))
        return carry, jnp.where(valid_b, adv_b, 0.0)

    zeros_b = jnp.zeros(rewards_nb.shape[1], jnp.float32)
    _, adv_nb = jax.lax.scan(
        step, (zeros_b, zeros_b), (rewards_nb, values_nb, valid_nb), reverse=True
    )
    advantages_bn = adv_nb.T
    returns_bn = jnp.where(_valid(mask_bn), advantages_bn + values_bn.astype(jnp.float32), 0.0)
    return advantages_bn, returns_bn


def discounted_returns(
    rewards_bn: jax.Array, mask_bn: jax.Array, gamma: float | jax.Array = 1.0
) -> jax.Array:
    """Reward-to-go G_t = r_t + γ G_{t'} over valid tokens (t' = next valid token).

    Args:
      rewards_bn: [batch, n] per-token rewards.
      mask_bn: [batch, n] 1 = valid token; masked rewards are ignored.
      gamma: discount γ.

    Returns:
      [batch, n] float32 returns, 0 where masked.
    """
    chex.assert_equal_shape((rewards_bn, mask_bn))

    def step(next_return_b, xs):
        reward_b, valid_b = xs
        return_b = reward_b + gamma * next_return_b
        return jnp.where(valid_b, return_b, next_return_b), jnp.where(valid_b, return_b, 0.0)

    zeros_b = jnp.zeros(rewards_bn.shape[0], jnp.float32)
    _, returns_nb = jax.lax.scan(
        step, zeros_b, (rewards_bn.astype(jnp.float32).T, _valid(mask_bn).T), reverse=True
    )
    return returns_nb.T


def group_normalized_advantages(
    scores_b: jax.Array,
    group_size: int,
    *,
    scale_by_std: bool = True,
    unbiased: bool = True,
    eps: float = 1e-6,
) -> jax.Array:
    """GRPO outcome advantages: each score relative to the other answers to its prompt.

    The batch holds `batch // group_size` prompts, each with `group_size` consecutive
    samples: rows [g*G, (g+1)*G) belong to prompt g. A_i = (s_i − mean_g) / (std_g + eps)
    (DeepSeekMath); with `scale_by_std=False` only the mean is removed (Dr. GRPO).

    Args:
      scores_b: [batch] sequence-level scores.
      group_size: G, samples per prompt (static); must divide batch.
      scale_by_std: divide by the group standard deviation.
      unbiased: Bessel-corrected std (as torch.std, used by the reference implementations).
      eps: added to the std so groups of identical scores get advantage 0, not nan.

    Returns:
      [batch] float32 advantages.
    """
    chex.assert_rank(scores_b, 1)
    batch = scores_b.shape[0]
    if group_size < 1 or batch % group_size:
        raise ValueError(f"group_size={group_size} must divide batch={batch}")
    if scale_by_std and unbiased and group_size == 1:
        raise ValueError("an unbiased std needs group_size >= 2")
    scores_gk = scores_b.astype(jnp.float32).reshape(batch // group_size, group_size)
    centred_gk = scores_gk - jnp.mean(scores_gk, axis=1, keepdims=True)
    if scale_by_std:
        std_g1 = jnp.std(scores_gk, axis=1, keepdims=True, ddof=1 if unbiased else 0)
        centred_gk = centred_gk / (std_g1 + eps)
    return centred_gk.reshape(batch)


def leave_one_out_advantages(returns_b: jax.Array, group_size: int) -> jax.Array:
    """RLOO (Kool et al. 2019; Ahmadian et al. 2024): each return minus the mean of the OTHER
    returns to the same prompt, A_i = R_i − Σ_{j≠i} R_j / (G − 1), an unbiased baseline.

    Args:
      returns_b: [batch] sequence returns; rows [g*G, (g+1)*G) answer prompt g.
      group_size: G >= 2 (static); must divide batch.

    Returns:
      [batch] float32 advantages; G/(G−1) times the return minus the group mean.
    """
    chex.assert_rank(returns_b, 1)
    batch = returns_b.shape[0]
    if group_size < 2 or batch % group_size:
        raise ValueError(f"group_size={group_size} must be >= 2 and divide batch={batch}")
    returns_gk = returns_b.astype(jnp.float32).reshape(batch // group_size, group_size)
    others_gk = (jnp.sum(returns_gk, axis=1, keepdims=True) - returns_gk) / (group_size - 1)
    return (returns_gk - others_gk).reshape(batch)


def broadcast_to_tokens(values_b: jax.Array, mask_bn: jax.Array) -> jax.Array:
    """Give every valid token of a sequence its sequence-level value (e.g. GRPO advantage).

    Args:
      values_b: [batch] one value per sequence.
      mask_bn: [batch, n] 1 = valid token.

    Returns:
      [batch, n] float32, values_b[i] on the valid tokens of row i, 0 elsewhere.
    """
    chex.assert_rank(values_b, 1)
    chex.assert_equal_shape_prefix((values_b, mask_bn), 1)
    return jnp.where(_valid(mask_bn), values_b.astype(jnp.float32)[:, None], 0.0)


def remax_advantages(
    rewards_bn: jax.Array, mask_bn: jax.Array, baseline_return_b: jax.Array
) -> jax.Array:
    """ReMax (Li et al. 2023): REINFORCE return minus the greedy response's return.

    A_t = Σ_{t'≥t} r_{t'} − b, where b is the (undiscounted) return of the greedy decode
    of the same prompt; with only a terminal score this is r(sample) − r(greedy) on every
    token. KL-penalised token rewards are allowed; pass the baseline's total return.

    Args:
      rewards_bn: [batch, n] per-token rewards of the sampled response.
      mask_bn: [batch, n] 1 = valid token.
      baseline_return_b: [batch] return of the greedy response to the same prompt.

    Returns:
      [batch, n] float32 advantages, 0 where masked.
    """
    chex.assert_rank(baseline_return_b, 1)
    returns_bn = discounted_returns(rewards_bn, mask_bn, 1.0)
    return returns_bn - broadcast_to_tokens(baseline_return_b, mask_bn)


def lagrangian_advantages(
    reward_advantages_bn: jax.Array,
    cost_advantages_bn: jax.Array,
    mask_bn: jax.Array,
    log_lambda: jax.Array,
) -> jax.Array:
    """Safe-RLHF combined advantage (A_r − λ·A_c) / (1 + λ).

    Dividing by 1 + λ keeps the advantage scale bounded as λ grows.

    Args:
      reward_advantages_bn: [batch, n] advantages from the reward critic.
      cost_advantages_bn: [batch, n] advantages from the cost critic.
      mask_bn: [batch, n] 1 = valid token.
      log_lambda: log λ (scalar), from `losses.lagrange_update`.

    Returns:
      [batch, n] float32 advantages for the policy loss.
    """
    chex.assert_equal_shape((reward_advantages_bn, cost_advantages_bn, mask_bn))
    lam = jnp.exp(jax.lax.stop_gradient(jnp.asarray(log_lambda, jnp.float32)))
    combined_bn = (reward_advantages_bn - lam * cost_advantages_bn) / (1.0 + lam)
    return jnp.where(_valid(mask_bn), combined_bn, 0.0)


def check_group_size(algorithm: str, group_size: int) -> None:
    """Group-relative advantages compare a prompt's responses with each other: `algorithm`
    needs at least two a group.

    Raises:
      ValueError: fewer than two.
    """
    if group_size < 2:
        raise ValueError(f"{algorithm} needs group_size >= 2 responses per prompt, got "
                         f"{group_size}")
