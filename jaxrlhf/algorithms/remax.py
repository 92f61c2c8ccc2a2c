"""ReMax (Li et al. 2023): REINFORCE with the greedy response's reward as the baseline.

Graph:
    actor_gen ─────────► reward ────────┐
              ├► ref_inf ───────────────┼► actor_train
    actor_gen_greedy ─► reward_greedy ──┘

Per prompt, one response is sampled and one decoded greedily by the same actor. The sampled
response gets the PPO-style dense reward (score at its last token, −β·KL to the reference on
every token); its advantage at token t is the reward-to-go minus the greedy response's score.
No critic: the greedy decode is the baseline, which is why ReMax saves the critic's memory and
both of its calls.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from jaxrlhf.algorithms import advantages as adv_lib
from jaxrlhf.algorithms import kl as kl_lib
from jaxrlhf.algorithms import losses, ppo
from jaxrlhf.algorithms.registry import Built, Registration, Request, from_section
from jaxrlhf.algorithms.spec import (
    GEN_KEYS, PPO_CLIP, PPO_KL_PENALTY, PPO_UPDATES, PROMPT_KEYS, SEQ_KEYS, Algorithm, TrainSpec,
    clipped_surrogate, model_inputs, policy_readout,
)
from jaxrlhf.mfc import MFC, Call, Role

# The greedy decode's keys, in the order of GEN_KEYS / SEQ_KEYS.
GREEDY_GEN_KEYS = ("greedy_seq_tokens_bs", "greedy_seq_mask_bs", "greedy_response_mask_bn",
                   "greedy_logp_bn")
GREEDY_SEQ_KEYS = GREEDY_GEN_KEYS[:3]


@dataclasses.dataclass(frozen=True)
class ReMaxConfig:
    """ReMax hyper-parameters.

    Attributes:
      kl: the KL controller (β of the per-token penalty in the reward).
      kl_estimator: per-token KL estimator.
      policy: the surrogate; with one epoch of one mini-batch its gradient is REINFORCE's.
      mini_batches, epochs: updates per step.
      temperature: sampling temperature of the non-greedy response.
    """

    kl: kl_lib.KLControllerConfig = kl_lib.KLControllerConfig()
    kl_estimator: kl_lib.KLEstimator = kl_lib.KLEstimator.K1
    policy: losses.PPOLossConfig = losses.PPOLossConfig()
    mini_batches: int = 1
    epochs: int = 1
    temperature: float = 1.0


def mfcs(reward_model: bool) -> tuple[MFC, ...]:
    """The ReMax graph; both responses are scored by the same reward (model or function)."""
    host = not reward_model
    return (
        MFC("actor_gen", Role.ACTOR, Call.GENERATE, PROMPT_KEYS, GEN_KEYS),
        MFC("actor_gen_greedy", Role.ACTOR, Call.GENERATE, PROMPT_KEYS, GREEDY_GEN_KEYS,
            greedy=True),
        MFC("reward", Role.REWARD, Call.INFERENCE, SEQ_KEYS + ("answer",), ("scores_b",),
            host=host),
        MFC("reward_greedy", Role.REWARD, Call.INFERENCE, GREEDY_SEQ_KEYS + ("answer",),
            ("greedy_scores_b",), host=host),
        MFC("ref_inf", Role.REF, Call.INFERENCE, SEQ_KEYS, ("ref_logp_bn",)),
        MFC("actor_train", Role.ACTOR, Call.TRAIN_STEP,
            GEN_KEYS + ("ref_logp_bn", "scores_b", "greedy_scores_b"), ("actor_stats",)),
    )


def remax_targets(buf, controller, cfg: ReMaxConfig):
    """KL-shaped rewards of the sampled response minus the greedy baseline.

    Args:
      buf: step buffer with scores_b and greedy_scores_b [b], behav_logp_bn, ref_logp_bn and
        response_mask_bn [b, n] of the sampled response.
      controller: {"kl_coef": β}.
      cfg: the ReMax config.

    Returns:
      ({"advantages_bn": [b, n] float32}, stats) with stats score, greedy_score,
      score_over_greedy (mean of score − greedy score), kl and response_length.
    """
    mask_bn = buf["response_mask_bn"].astype(jnp.float32)
    rewards_bn, kl_bn = kl_lib.kl_penalized_rewards(
        buf["scores_b"], buf["behav_logp_bn"], buf["ref_logp_bn"], mask_bn,
        controller["kl_coef"], cfg.kl_estimator)
    advantages_bn = adv_lib.remax_advantages(rewards_bn, mask_bn, buf["greedy_scores_b"])
    stats = {
        "score": jnp.mean(buf["scores_b"]),
        "greedy_score": jnp.mean(buf["greedy_scores_b"]),
        "score_over_greedy": jnp.mean(buf["scores_b"] - buf["greedy_scores_b"]),
        "kl": jnp.mean(jnp.sum(kl_bn, axis=1)),
        "response_length": jnp.mean(jnp.sum(mask_bn, axis=1)),
    }
    return {"advantages_bn": advantages_bn}, stats


def _train_batch(buf, controller, cfg: ReMaxConfig):
    targets, stats = remax_targets(buf, controller, cfg)
    batch = model_inputs(buf["seq_tokens_bs"], buf["seq_mask_bs"])
    batch.update(targets)
    batch.update(mask_bn=buf["response_mask_bn"].astype(jnp.float32),
                 old_logp_bn=buf["behav_logp_bn"])
    return batch, stats


def make(cfg: ReMaxConfig, *, reward_model: bool, batch_size: int) -> Algorithm:
    prepare = lambda buf, controller: _train_batch(buf, controller, cfg)
    return Algorithm(
        name="remax",
        mfcs=mfcs(reward_model),
        train={Role.ACTOR: TrainSpec(prepare, clipped_surrogate(cfg.policy), cfg.mini_batches, cfg.epochs,
                                     policy_readout(cfg.temperature))},
        controller_init={"kl_coef": cfg.kl.init_kl_coef},
        controller_update=lambda c, s: kl_lib.update_controller(c, s, batch_size, cfg.kl),
        temperature=cfg.temperature,
    )


def _build(request: Request) -> Built:  # PPO's settings, those of them ReMax has
    cfg = from_section(ReMaxConfig, ppo.from_config(request.config))
    return Built(make(cfg, reward_model=request.reward_model, batch_size=request.rows))


ALGORITHMS = (Registration("remax", _build, reads=(*PPO_UPDATES, *PPO_CLIP, *PPO_KL_PENALTY)),)
