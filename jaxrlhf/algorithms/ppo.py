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
import functools

import jax.numpy as jnp

from jaxrlhf.algorithms import advantages as adv_lib
from jaxrlhf.algorithms import kl as kl_lib
from jaxrlhf.algorithms import losses, multiturn
from jaxrlhf.algorithms.registry import Built, Capability, Registration, Request
from jaxrlhf.algorithms.spec import (
    GEN_KEYS, PROMPT_KEYS, SEQ_KEYS, Algorithm, Proximal, TrainSpec, model_inputs,
    policy_readout, response_policy, response_values,
)
from jaxrlhf.mfc import MFC, Call, Role

# Keys of the step buffer: PROMPT_KEYS, GEN_KEYS, SEQ_KEYS (`algorithms/spec.py`).


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


def advantages_and_returns(buf, controller, cfg: PPOConfig, task_rewards_bn=None):
    """KL-shaped rewards, GAE, whitening. Returns ({advantages_bn, returns_bn}, stats).

    `task_rewards_bn` [b, n]: the task's rewards per token in place of the score on the last
    response token (multi-turn: the environment's, each on the end of the turn it answered).
    GAE runs over the tokens of `response_mask_bn` only, so a multi-turn trajectory's values
    are read at the policy's tokens alone (the environment's pass the running return through).
    """
    mask_bn = buf["response_mask_bn"].astype(jnp.float32)
    kl_coef = controller["kl_coef"] if cfg.kl_in_reward else 0.0
    scores_b = buf["scores_b"] if task_rewards_bn is None else jnp.zeros_like(buf["scores_b"])
    rewards_bn, kl_bn = kl_lib.kl_penalized_rewards(
        scores_b, buf["behav_logp_bn"], buf["ref_logp_bn"], mask_bn, kl_coef,
        cfg.kl_estimator, cfg.score_clip,
    )
    if task_rewards_bn is not None:
        rewards_bn = rewards_bn + task_rewards_bn * mask_bn
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


def train_batch(buf, controller, cfg: PPOConfig, task_rewards_bn=None):
    """The actor's and critic's batch of a step (`task_rewards_bn`: `advantages_and_returns`)."""
    targets, stats = advantages_and_returns(buf, controller, cfg, task_rewards_bn)
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
    prepare = lambda buf, controller: train_batch(buf, controller, cfg)
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


def from_config(config, cap: float | None = None) -> PPOConfig:
    """PPO's settings of the shared `ppo` section (the policy-gradient algorithms start from
    them); `cap`: the decoupled objective's behav_imp_weight_cap."""
    c = config.ppo
    kind = kl_lib.KLControllerKind.ADAPTIVE if c.kl_adaptive else kl_lib.KLControllerKind.FIXED
    return PPOConfig(
        gamma=c.gamma, lam=c.lam,
        kl=kl_lib.KLControllerConfig(kind=kind, init_kl_coef=c.kl_coef, target=c.kl_target,
                                     horizon=c.kl_horizon),
        kl_in_reward=c.kl_in_reward, whiten_advantages=c.whiten_advantages,
        policy=losses.PPOLossConfig(clip_eps=c.clip_eps, entropy_coef=c.entropy_coef,
                                    behav_imp_weight_cap=cap, tis_cap=c.tis_cap or None),
        value=losses.ValueLossConfig(clip_eps_value=c.value_clip or None),
        mini_batches=c.mini_batches, epochs=c.epochs, temperature=config.rollout.temperature)


def make_multiturn(cfg: PPOConfig, batch_size: int) -> Algorithm:
    """PPO over trajectories (`multiturn.py`): each turn's reward on the last token of the
    policy's turn it answered."""
    base = make(cfg, reward_model=False, batch_size=batch_size)
    prepare = lambda buf, controller: train_batch(buf, controller, cfg, buf["turn_rewards_bn"])
    train = {role: dataclasses.replace(spec, prepare=prepare) for role, spec in base.train.items()}
    return dataclasses.replace(base, name="ppo_multiturn", mfcs=multiturn.ppo_mfcs(), train=train)


def _build(request: Request) -> Built:
    cfg = from_config(request.config, request.cap)
    algorithm = (make_multiturn(cfg, request.rows) if request.multiturn
                 else make(cfg, reward_model=request.reward_model, batch_size=request.rows))
    return Built(algorithm, functools.partial(actor_loss, cfg))


ALGORITHMS = (Registration(
    "ppo", _build, reads=("ppo",),
    capabilities=frozenset({Capability.MULTITURN, Capability.ASYNC, Capability.CRITIC,
                            Capability.MISMATCH_CORRECTION})),)
