"""PPO for RLHF (Ouyang et al. 2022; ReaL's and HybridFlow's main workload).

Graph:
    actor_gen ─► reward ─┐
              ├► ref_inf ├► actor_train
              └► critic_inf ─► critic_train

Math per step: dense rewards = score at the last token − β·KL(actor‖ref) per token (or a KL
loss term instead), GAE advantages and returns from the critic's values, optional advantage
whitening, then `epochs × mini_batches` clipped-surrogate updates of the actor and clipped
value updates of the critic. β follows a fixed or adaptive (Ziegler et al.) controller.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from jaxrlhf.algorithms import advantages as adv_lib
from jaxrlhf.algorithms import kl as kl_lib
from jaxrlhf.algorithms import losses
from jaxrlhf.algorithms.spec import (
    Algorithm, Proximal, TrainSpec, model_inputs, policy_readout, response_policy,
    response_values,
)
from jaxrlhf.mfc import MFC, Call, Role

# Keys of the step buffer.
PROMPT_KEYS = ("prompt_tokens_bp", "prompt_mask_bp")
GEN_KEYS = ("seq_tokens_bs", "seq_mask_bs", "response_mask_bn", "behav_logp_bn")
SEQ_KEYS = ("seq_tokens_bs", "seq_mask_bs", "response_mask_bn")


@dataclasses.dataclass(frozen=True)
class PPOConfig:
    """PPO hyper-parameters.

    Attributes:
      gamma, lam: GAE discount and λ.
      kl: the KL controller (β).
      kl_estimator: per-token KL estimator.
      kl_in_reward: True puts −β·KL into the rewards; False adds β·KL to the actor loss.
      whiten_advantages: normalise advantages over the batch.
      policy, value: loss settings.
      mini_batches, epochs: updates per step.
      temperature: generation temperature.
      score_clip: clip sequence scores to ±score_clip.
    """

    gamma: float = 1.0
    lam: float = 0.95
    kl: kl_lib.KLControllerConfig = kl_lib.KLControllerConfig()
    kl_estimator: kl_lib.KLEstimator = kl_lib.KLEstimator.K1
    kl_in_reward: bool = True
    whiten_advantages: bool = True
    policy: losses.PPOLossConfig = losses.PPOLossConfig()
    value: losses.ValueLossConfig = losses.ValueLossConfig()
    mini_batches: int = 1
    epochs: int = 1
    temperature: float = 1.0
    score_clip: float | None = None


def mfcs(reward_model: bool) -> tuple[MFC, ...]:
    """The PPO graph; the reward is a model call or a host function."""
    return (
        MFC("actor_gen", Role.ACTOR, Call.GENERATE, PROMPT_KEYS, GEN_KEYS),
        MFC("reward", Role.REWARD, Call.INFERENCE, SEQ_KEYS + ("answer",), ("scores_b",),
            host=not reward_model),
        MFC("ref_inf", Role.REF, Call.INFERENCE, SEQ_KEYS, ("ref_logp_bn",)),
        MFC("critic_inf", Role.CRITIC, Call.INFERENCE, SEQ_KEYS, ("values_bn",)),
        MFC("actor_train", Role.ACTOR, Call.TRAIN_STEP,
            GEN_KEYS + ("ref_logp_bn", "scores_b", "values_bn"), ("actor_stats",)),
        MFC("critic_train", Role.CRITIC, Call.TRAIN_STEP,
            GEN_KEYS + ("ref_logp_bn", "scores_b", "values_bn"), ("critic_stats",)),
    )


def advantages_and_returns(buf, controller, cfg: PPOConfig):
    """KL-shaped rewards, GAE, whitening. Returns ({advantages_bn, returns_bn}, stats)."""
    mask_bn = buf["response_mask_bn"].astype(jnp.float32)
    kl_coef = controller["kl_coef"] if cfg.kl_in_reward else 0.0
    rewards_bn, kl_bn = kl_lib.kl_penalized_rewards(
        buf["scores_b"], buf["behav_logp_bn"], buf["ref_logp_bn"], mask_bn, kl_coef,
        cfg.kl_estimator, cfg.score_clip,
    )
    advantages_bn, returns_bn = adv_lib.gae(rewards_bn, buf["values_bn"], mask_bn, cfg.gamma,
                                            cfg.lam)
    if cfg.whiten_advantages:
        advantages_bn = adv_lib.masked_whiten(advantages_bn, mask_bn)
    stats = {
        "score": jnp.mean(buf["scores_b"]),
        "kl": jnp.mean(jnp.sum(kl_bn, axis=1)),
        "response_length": jnp.mean(jnp.sum(mask_bn, axis=1)),
        "returns": adv_lib.masked_mean(returns_bn, mask_bn),
        "values": adv_lib.masked_mean(buf["values_bn"], mask_bn),
    }
    return {"advantages_bn": advantages_bn, "returns_bn": returns_bn}, stats


def _train_batch(buf, controller, cfg: PPOConfig):
    targets, stats = advantages_and_returns(buf, controller, cfg)
    batch = model_inputs(buf["seq_tokens_bs"], buf["seq_mask_bs"])
    batch.update(targets)
    batch.update(
        mask_bn=buf["response_mask_bn"].astype(jnp.float32), old_logp_bn=buf["behav_logp_bn"],
        ref_logp_bn=buf["ref_logp_bn"], old_values_bn=buf["values_bn"],
        kl_coef=jnp.full(buf["scores_b"].shape, controller["kl_coef"], jnp.float32),
    )
    return batch, stats


def actor_loss(cfg: PPOConfig, proximal: Proximal | None = None):
    """The clipped surrogate (plus β·KL when it is not in the reward); with `proximal` (log
    π_prox from the step's log π_θ and batch), AReaL's decoupled objective (`decoupled.py`)."""

    def loss_fn(out, batch):
        logp_bn, entropy_bn = response_policy(out, batch)
        loss_sum, weight, stats = losses.ppo_policy_loss(
            logp_bn, batch["old_logp_bn"], batch["advantages_bn"], batch["mask_bn"], cfg.policy,
            proximal_logp_bn=proximal(logp_bn, batch) if proximal else None, entropy_bn=entropy_bn,
        )
        if not cfg.kl_in_reward:
            kl_bn = kl_lib.kl_per_token(logp_bn, batch["ref_logp_bn"], cfg.kl_estimator)
            kl_sum = jnp.sum(kl_bn * batch["mask_bn"] * batch["kl_coef"][:, None])
            loss_sum = loss_sum + kl_sum
            stats = {**stats, "kl_loss": kl_sum}
        return loss_sum, weight, stats

    return loss_fn


def critic_loss(cfg: PPOConfig):
    def loss_fn(out, batch):
        n = batch["mask_bn"].shape[1]
        return losses.value_loss(response_values(out.values_bt, n), batch["old_values_bn"],
                                 batch["returns_bn"], batch["mask_bn"], cfg.value)

    return loss_fn


def make(cfg: PPOConfig, *, reward_model: bool, batch_size: int) -> Algorithm:
    prepare = lambda buf, controller: _train_batch(buf, controller, cfg)
    return Algorithm(
        name="ppo",
        mfcs=mfcs(reward_model),
        train={
            Role.ACTOR: TrainSpec(prepare, actor_loss(cfg), cfg.mini_batches, cfg.epochs,
                                  policy_readout(cfg.temperature)),
            Role.CRITIC: TrainSpec(prepare, critic_loss(cfg), cfg.mini_batches, cfg.epochs),
        },
        controller_init={"kl_coef": cfg.kl.init_kl_coef},
        controller_update=lambda c, s: kl_lib.update_controller(c, s, batch_size, cfg.kl),
        temperature=cfg.temperature,
    )
