"""GRPO (Shao et al. 2024, DeepSeekMath): group-relative advantages, no critic.

Graph:
    actor_gen ─► reward ──┐
              └► ref_inf ─┴► actor_train

Every prompt is sampled `group_size` times (the prompt batch repeats each prompt on consecutive
rows). A response's advantage is its score relative to the other responses to the same prompt,
(s − mean_group) / std_group, given to every token of the response; the KL to the reference is
a term of the loss (β·k3 per token) rather than a penalty inside the reward, so the advantage
stays a pure outcome signal.
"""

from __future__ import annotations

import dataclasses
import functools

import jax.numpy as jnp

from jaxrlhf.algorithms import advantages as adv_lib
from jaxrlhf.algorithms import kl as kl_lib
from jaxrlhf.algorithms import losses, multiturn, ppo
from jaxrlhf.algorithms.registry import (
    Built, Capability, Registration, Request, Section, from_section,
)
from jaxrlhf.algorithms.spec import (
    GEN_KEYS, PPO_CLIP, PPO_UPDATES, PROMPT_KEYS, SEQ_KEYS, Algorithm, Proximal, TrainSpec, model_inputs,
    policy_readout, response_policy,
)
from jaxrlhf.mfc import MFC, Call, Role
from jaxrlhf.schema import enum_value


@dataclasses.dataclass(frozen=True)
class GRPOConfig:
    """GRPO hyper-parameters.

    Attributes:
      group_size: responses per prompt (G >= 2); consecutive rows form a group.
      loss: the clipped surrogate, its aggregation, β and the KL estimator.
      scale_by_std: divide by the group's std (False: Dr. GRPO, only subtract the mean).
      mini_batches, epochs: updates per step.
      temperature: generation temperature.
    """

    group_size: int
    loss: losses.GRPOLossConfig = losses.GRPOLossConfig()
    scale_by_std: bool = True
    mini_batches: int = 1
    epochs: int = 1
    temperature: float = 1.0

    def __post_init__(self):
        adv_lib.check_group_size("GRPO", self.group_size)


def mfcs(reward_model: bool) -> tuple[MFC, ...]:
    """The GRPO graph; the reward is a model call or a host function."""
    return (
        MFC("actor_gen", Role.ACTOR, Call.GENERATE, PROMPT_KEYS, GEN_KEYS),
        MFC("reward", Role.REWARD, Call.INFERENCE, SEQ_KEYS + ("answer",), ("scores_b",),
            host=not reward_model),
        MFC("ref_inf", Role.REF, Call.INFERENCE, SEQ_KEYS, ("ref_logp_bn",)),
        MFC("actor_train", Role.ACTOR, Call.TRAIN_STEP, GEN_KEYS + ("ref_logp_bn", "scores_b"),
            ("actor_stats",)),
    )


def group_advantages(buf, cfg: GRPOConfig):
    """Group-normalised advantages on every response token, and the batch's stats.

    Args:
      buf: step buffer with scores_b [b], response_mask_bn [b, n], behav_logp_bn and
        ref_logp_bn [b, n]; b = prompts × group_size, groups on consecutive rows.
      cfg: the GRPO config.

    Returns:
      ({"advantages_bn": [b, n] float32}, stats) with stats score, kl (Σ_t k1 of the behaviour
      policy against the reference, mean over sequences), response_length, and
      flat_group_frac (groups whose scores are all equal, which give no learning signal).
    """
    mask_bn = buf["response_mask_bn"].astype(jnp.float32)
    scores_b = buf["scores_b"].astype(jnp.float32)
    advantages_b = adv_lib.group_normalized_advantages(scores_b, cfg.group_size,
                                                       scale_by_std=cfg.scale_by_std)
    kl_bn = kl_lib.kl_per_token(buf["behav_logp_bn"], buf["ref_logp_bn"], kl_lib.KLEstimator.K1)
    scores_gk = scores_b.reshape(-1, cfg.group_size)
    stats = {
        "score": jnp.mean(scores_b),
        "kl": jnp.mean(adv_lib.masked_sum(kl_bn, mask_bn, axis=1)),
        "response_length": jnp.mean(jnp.sum(mask_bn, axis=1)),
        "flat_group_frac": jnp.mean(jnp.all(scores_gk == scores_gk[:, :1], axis=1)),
    }
    return {"advantages_bn": adv_lib.broadcast_to_tokens(advantages_b, mask_bn)}, stats


def _train_batch(buf, controller, cfg: GRPOConfig):
    del controller  # GRPO's β is static (GRPOLossConfig.kl_coef)
    targets, stats = group_advantages(buf, cfg)
    batch = model_inputs(buf["seq_tokens_bs"], buf["seq_mask_bs"])
    batch.update(targets)
    batch.update(mask_bn=buf["response_mask_bn"].astype(jnp.float32),
                 old_logp_bn=buf["behav_logp_bn"], ref_logp_bn=buf["ref_logp_bn"])
    return batch, stats


def actor_loss(cfg: GRPOConfig, proximal: Proximal | None = None):
    """Surrogate + β·KL to the reference; with `proximal` (log π_prox from the step's log π_θ
    and batch), the surrogate is AReaL's decoupled one (`decoupled.py`)."""

    def loss_fn(out, batch):
        logp_bn, entropy_bn = response_policy(out, batch)
        return losses.grpo_loss(logp_bn, batch["old_logp_bn"], batch["ref_logp_bn"],
                                batch["advantages_bn"], batch["mask_bn"], cfg.loss,
                                proximal_logp_bn=proximal(logp_bn, batch) if proximal else None,
                                entropy_bn=entropy_bn)

    return loss_fn


def make(cfg: GRPOConfig, *, reward_model: bool) -> Algorithm:
    prepare = lambda buf, controller: _train_batch(buf, controller, cfg)
    return Algorithm(
        name="grpo",
        mfcs=mfcs(reward_model),
        train={Role.ACTOR: TrainSpec(prepare, actor_loss(cfg), cfg.mini_batches, cfg.epochs,
                                     policy_readout(cfg.temperature))},
        temperature=cfg.temperature,
    )


SECTION = Section("grpo", {
    "kl_coef": 0.04,  # β of the KL term in the loss (0 = none)
    "kl_estimator": "k3",  # k1 | k2 | k3
    "scale_by_std": True,  # False: Dr. GRPO (advantage = score - group mean)
    # seq_mean_token_mean | token_mean | seq_mean_token_sum_norm (Dr. GRPO: each
    # response's token sum over the constant rollout.max_new_tokens)
    "aggregation": "seq_mean_token_mean",
}, bounds=((">=", 0, ("kl_coef",)),))  # a negative β rewards drifting from the reference


def from_config(config, cap: float | None = None) -> GRPOConfig:
    """GRPO: its own β, estimator and normalisation; clipping and updates from `ppo`."""
    g, p = config.grpo, ppo.from_config(config, cap)
    aggregation = enum_value(losses.LossAggregation, g.aggregation, "grpo.aggregation")
    loss = losses.GRPOLossConfig(
        policy=dataclasses.replace(p.policy, aggregation=aggregation), kl_coef=g.kl_coef,
        kl_estimator=enum_value(kl_lib.KLEstimator, g.kl_estimator, "grpo.kl_estimator"))
    return from_section(GRPOConfig, p, group_size=config.rollout.group_size, loss=loss,
                        scale_by_std=g.scale_by_std)


def make_multiturn(cfg: GRPOConfig) -> Algorithm:
    """GRPO over trajectories (`multiturn.py`): the trajectory's reward is its score."""
    return dataclasses.replace(make(cfg, reward_model=False), name="grpo_multiturn",
                               mfcs=multiturn.mfcs())


def _build(request: Request) -> Built:
    cfg = from_config(request.config, request.cap)
    algorithm = (make_multiturn(cfg) if request.multiturn
                 else make(cfg, reward_model=request.reward_model))
    return Built(algorithm, functools.partial(actor_loss, cfg))


ALGORITHMS = (Registration(
    "grpo", _build, sections=(SECTION,), reads=(*PPO_UPDATES, *PPO_CLIP),
    capabilities=frozenset({Capability.MULTITURN, Capability.ASYNC,
                            Capability.MISMATCH_CORRECTION})),)
