"""REINFORCE with a baseline and the KL in the reward: RLOO and REINFORCE++. No critic.

Graph (GRPO's):
    actor_gen ─► reward ──┐
              └► ref_inf ─┴► actor_train

Both shape the reward with −β·KL(π_behav ‖ π_ref) (β from the KL controller, fixed or
adaptive) and differ in the baseline:

  RLOO (Ahmadian et al. 2024)     every prompt sampled G times; a response's return is its
                                  score − β·Σ_t KL_t, its advantage that return minus the mean
                                  return of the other G − 1 responses (leave-one-out), given
                                  to every token.
  REINFORCE++ (Hu 2025)           per-token rewards (−β·KL_t on every token, the score at the
                                  last), the reward-to-go at each token, then normalised by
                                  the mean and std over every valid token of the whole batch
                                  (global, not per prompt: any group size, even 1).

The update is the PPO clipped surrogate with a token-level mean: with one update per batch
its gradient is REINFORCE's; more updates stay in PPO's trust region.
"""

from __future__ import annotations

import dataclasses
import enum
import functools

import jax.numpy as jnp

from jaxrlhf.algorithms import advantages as adv_lib
from jaxrlhf.algorithms import grpo
from jaxrlhf.algorithms import kl as kl_lib
from jaxrlhf.algorithms import losses, ppo
from jaxrlhf.algorithms.registry import (
    Built, Capability, Registration, Request, from_section,
)
from jaxrlhf.algorithms.spec import (
    PPO_CLIP, PPO_KL_PENALTY, PPO_UPDATES, Algorithm, Proximal, TrainSpec, model_inputs, clipped_surrogate, policy_readout,
)
from jaxrlhf.mfc import Role


class Baseline(enum.Enum):
    """What is subtracted from a response's return."""

    LEAVE_ONE_OUT = "rloo"  # the other responses to the same prompt (RLOO)
    BATCH_NORM = "reinforce_pp"  # the batch's mean, then divided by its std (REINFORCE++)


@dataclasses.dataclass(frozen=True)
class ReinforceConfig:
    """RLOO / REINFORCE++ hyper-parameters.

    Attributes:
      baseline: leave-one-out (RLOO) or global normalisation (REINFORCE++).
      group_size: responses per prompt on consecutive rows (RLOO: >= 2).
      kl: the KL controller (β of the penalty in the reward).
      kl_estimator: per-token KL estimator.
      policy: the surrogate (token-level mean).
      mini_batches, epochs: updates per step.
      temperature: generation temperature.
    """

    baseline: Baseline
    group_size: int
    kl: kl_lib.KLControllerConfig = kl_lib.KLControllerConfig()
    kl_estimator: kl_lib.KLEstimator = kl_lib.KLEstimator.K1
    policy: losses.PPOLossConfig = losses.PPOLossConfig()
    mini_batches: int = 1
    epochs: int = 1
    temperature: float = 1.0

    def __post_init__(self):
        if self.baseline is Baseline.LEAVE_ONE_OUT:
            adv_lib.check_group_size("RLOO", self.group_size)


def reinforce_advantages(scores_b, behav_logp_bn, ref_logp_bn, mask_bn, kl_coef,
                         cfg: ReinforceConfig):
    """Advantages of every response token and the per-token KL.

    Args:
      scores_b: [b] sequence scores; b = prompts × group_size, groups on consecutive rows.
      behav_logp_bn, ref_logp_bn: [b, n] log-probs of the response tokens under the behaviour
        (generating) policy and the reference.
      mask_bn: [b, n] 1 = valid response token.
      kl_coef: β (scalar).
      cfg: the config (baseline, group size, estimator).

    Returns:
      (advantages_bn [b, n] float32, 0 where masked; kl_bn [b, n], the unscaled KL).
    """
    rewards_bn, kl_bn = kl_lib.kl_penalized_rewards(scores_b, behav_logp_bn, ref_logp_bn,
                                                    mask_bn, kl_coef, cfg.kl_estimator)
    match cfg.baseline:
        case Baseline.LEAVE_ONE_OUT:
            returns_b = adv_lib.masked_sum(rewards_bn, mask_bn, axis=1)
            advantages_b = adv_lib.leave_one_out_advantages(returns_b, cfg.group_size)
            return adv_lib.broadcast_to_tokens(advantages_b, mask_bn), kl_bn
        case Baseline.BATCH_NORM:
            returns_bn = adv_lib.discounted_returns(rewards_bn, mask_bn, 1.0)
            return adv_lib.masked_whiten(returns_bn, mask_bn), kl_bn


def _train_batch(buf, controller, cfg: ReinforceConfig):
    mask_bn = buf["response_mask_bn"].astype(jnp.float32)
    advantages_bn, kl_bn = reinforce_advantages(buf["scores_b"], buf["behav_logp_bn"],
                                                buf["ref_logp_bn"], mask_bn,
                                                controller["kl_coef"], cfg)
    batch = model_inputs(buf["seq_tokens_bs"], buf["seq_mask_bs"])
    batch.update(advantages_bn=advantages_bn, mask_bn=mask_bn, old_logp_bn=buf["behav_logp_bn"])
    stats = {
        "score": jnp.mean(buf["scores_b"]),
        "kl": jnp.mean(jnp.sum(kl_bn, axis=1)),
        "response_length": jnp.mean(jnp.sum(mask_bn, axis=1)),
    }
    return batch, stats


def actor_loss(cfg: ReinforceConfig, proximal: Proximal | None = None):
    """The clipped surrogate; with `proximal`, the decoupled one (mismatch correction)."""
    return clipped_surrogate(cfg.policy, proximal)


def make(cfg: ReinforceConfig, *, reward_model: bool, batch_size: int) -> Algorithm:
    prepare = lambda buf, controller: _train_batch(buf, controller, cfg)
    return Algorithm(
        name=cfg.baseline.value,
        mfcs=grpo.mfcs(reward_model),
        train={Role.ACTOR: TrainSpec(prepare, actor_loss(cfg), cfg.mini_batches, cfg.epochs,
                                     policy_readout(cfg.temperature))},
        controller_init={"kl_coef": cfg.kl.init_kl_coef},
        controller_update=lambda c, s: kl_lib.update_controller(c, s, batch_size, cfg.kl),
        temperature=cfg.temperature,
    )


def _builder(baseline: Baseline):
    """The build of RLOO or REINFORCE++: PPO's β, controller, estimator, clipping and updates;
    token mean."""

    def build(request: Request) -> Built:
        cfg = from_section(ReinforceConfig, ppo.from_config(request.config), baseline=baseline,
                           group_size=request.config.rollout.group_size)
        return Built(make(cfg, reward_model=request.reward_model, batch_size=request.rows),
                     functools.partial(actor_loss, cfg))

    return build


ALGORITHMS = tuple(
    Registration(b.value, _builder(b), reads=(*PPO_UPDATES, *PPO_CLIP, *PPO_KL_PENALTY),
                 capabilities=frozenset({Capability.MISMATCH_CORRECTION}))
    for b in Baseline)
