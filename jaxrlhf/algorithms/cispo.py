"""CISPO (MiniMax 2025, MiniMax-M1): REINFORCE whose importance-sampling weights are clipped
and held constant; GRPO's group-relative advantages, a token-level mean, no KL term.

Graph (no reference model, as DAPO's):
    actor_gen ─► reward ─► actor_train

PPO's and GRPO's clipped surrogate drops a token's gradient once its ratio leaves the clip
range in the direction its advantage pushes: the tokens that drop out are often the rare ones
(forks of a reasoning chain) whose probability an update raises most. CISPO clips the weight,
not the update, so every token keeps its gradient:

    L = −(1 / Σ_i |o_i|) Σ_i Σ_t sg(clip(r_it, 1 − ε_low, 1 + ε_high)) · Â_i · log π_θ(o_it)

with r_it = π_θ(o_it) / π_old(o_it), sg the stop-gradient and Â_i = (R_i − mean_group) /
std_group. A token's gradient is REINFORCE's times its clipped weight; the clip bounds the
weight's variance. The paper bounds the weight from above only (ε_low large, ε_high tuned):
here ε_low = 1, the default, is that, since a ratio is positive and 1 − 1 = 0 never clips.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxrlhf.algorithms import advantages as adv_lib
from jaxrlhf.algorithms import losses
from jaxrlhf.algorithms.registry import Built, Registration, Request, Section
from jaxrlhf.algorithms.spec import (
    GEN_KEYS, PPO_UPDATES, PROMPT_KEYS, SEQ_KEYS, Algorithm, Metric, TrainSpec, model_inputs, policy_readout,
    response_policy,
)
from jaxrlhf.mfc import MFC, Call, Role

_sg = jax.lax.stop_gradient


@dataclasses.dataclass(frozen=True)
class CISPOConfig:
    """CISPO hyper-parameters.

    Attributes:
      group_size: responses per prompt (G >= 2), on consecutive rows.
      clip_eps_low, clip_eps_high: the weight is clipped to [1 − clip_eps_low,
        1 + clip_eps_high] (clip_eps_low = 1: no lower bound).
      mini_batches, epochs: updates per step.
      temperature: generation temperature.
    """

    group_size: int
    clip_eps_low: float = 1.0
    clip_eps_high: float = 0.28
    mini_batches: int = 1
    epochs: int = 1
    temperature: float = 1.0

    def __post_init__(self):
        adv_lib.check_group_size("CISPO", self.group_size)


def cispo_loss(logp_bn: jax.Array, old_logp_bn: jax.Array, advantages_bn: jax.Array,
               mask_bn: jax.Array, cfg: CISPOConfig,
               entropy_bn: jax.Array | None = None) -> losses.LossOutput:
    """The clipped-weight REINFORCE loss, summed over tokens (the token-level mean's parts).

    Args:
      logp_bn: [b, n] log π_θ of the response tokens (differentiated).
      old_logp_bn: [b, n] log π_old, the behaviour policy's (recorded at generation).
      advantages_bn: [b, n] the response's advantage on each of its valid tokens.
      mask_bn: [b, n] 1 = valid response token.
      cfg: the weight's clip range.
      entropy_bn: optional [b, n] entropies (logged; no bonus).

    Returns:
      (Σ_bt −w·A·log π_θ over valid tokens, their count, stat sums over them: clip_frac (the
      share of weights the clip changed), importance_weight (w), entropy when given).
    """
    valid_bn = mask_bn > 0
    zero = lambda x_bn: jnp.where(valid_bn, x_bn.astype(jnp.float32), 0.0)
    logp_bn, old_logp_bn, advantages_bn = zero(logp_bn), zero(old_logp_bn), zero(advantages_bn)
    ratio_bn = jnp.exp(_sg(logp_bn) - _sg(old_logp_bn))
    weight_bn = jnp.clip(ratio_bn, 1.0 - cfg.clip_eps_low, 1.0 + cfg.clip_eps_high)
    loss_bn = -_sg(weight_bn) * _sg(advantages_bn) * logp_bn
    stats_bn = {"clip_frac": (weight_bn != ratio_bn).astype(jnp.float32),
                "importance_weight": weight_bn}
    if entropy_bn is not None:
        stats_bn["entropy"] = _sg(entropy_bn)
    aggregate = lambda x_bn: losses.aggregate(x_bn, mask_bn, losses.LossAggregation.TOKEN_MEAN)
    loss_sum, weight = aggregate(loss_bn)
    return loss_sum, weight, {k: aggregate(v)[0] for k, v in stats_bn.items()}


def mfcs(reward_model: bool) -> tuple[MFC, ...]:
    """The CISPO graph; the reward is a model call or a host function."""
    return (
        MFC("actor_gen", Role.ACTOR, Call.GENERATE, PROMPT_KEYS, GEN_KEYS),
        MFC("reward", Role.REWARD, Call.INFERENCE, SEQ_KEYS + ("answer",), ("scores_b",),
            host=not reward_model),
        MFC("actor_train", Role.ACTOR, Call.TRAIN_STEP, GEN_KEYS + ("scores_b",),
            ("actor_stats",)),
    )


def _train_batch(buf, controller, cfg: CISPOConfig):
    """The train batch: GRPO's group-normalised advantages on every response token."""
    del controller  # no KL term, no controller
    mask_bn = buf["response_mask_bn"].astype(jnp.float32)
    scores_b = buf["scores_b"].astype(jnp.float32)
    advantages_b = adv_lib.group_normalized_advantages(scores_b, cfg.group_size)
    batch = model_inputs(buf["seq_tokens_bs"], buf["seq_mask_bs"])
    batch.update(advantages_bn=adv_lib.broadcast_to_tokens(advantages_b, mask_bn),
                 mask_bn=mask_bn, old_logp_bn=buf["behav_logp_bn"])
    scores_gk = scores_b.reshape(-1, cfg.group_size)
    stats = {"score": jnp.mean(scores_b), "response_length": jnp.mean(jnp.sum(mask_bn, axis=1)),
             "flat_group_frac": jnp.mean(jnp.all(scores_gk == scores_gk[:, :1], axis=1))}
    return batch, stats


def actor_loss(cfg: CISPOConfig):
    def loss_fn(out, batch):
        logp_bn, entropy_bn = response_policy(out, batch)
        return cispo_loss(logp_bn, batch["old_logp_bn"], batch["advantages_bn"],
                          batch["mask_bn"], cfg, entropy_bn=entropy_bn)

    return loss_fn


def make(cfg: CISPOConfig, *, reward_model: bool) -> Algorithm:
    prepare = lambda buf, controller: _train_batch(buf, controller, cfg)
    return Algorithm(
        name="cispo",
        mfcs=mfcs(reward_model),
        train={Role.ACTOR: TrainSpec(prepare, actor_loss(cfg), cfg.mini_batches, cfg.epochs,
                                     policy_readout(cfg.temperature))},
        temperature=cfg.temperature,
        shown=(Metric("reward"), Metric("clip_frac", Role.ACTOR)),
    )


SECTION = Section("cispo", {
    "clip_eps_high": 0.28,  # the weight's upper bound is 1 + this (the paper tunes it)
    "clip_eps_low": 1.0,  # its lower bound is 1 - this; 1: none (the paper's choice)
}, bounds=((">", 0, ("clip_eps_high", "clip_eps_low")), ("<=", 1, ("clip_eps_low",))))


def _build(request: Request) -> Built:
    """CISPO: its clip range; updates from `ppo` (its clip_eps is PPO's surrogate's, unused)."""
    c, p = request.config, request.config.ppo
    cfg = CISPOConfig(group_size=c.rollout.group_size, clip_eps_low=c.cispo.clip_eps_low,
                      clip_eps_high=c.cispo.clip_eps_high, mini_batches=p.mini_batches,
                      epochs=p.epochs, temperature=c.rollout.temperature)
    return Built(make(cfg, reward_model=request.reward_model))


ALGORITHMS = (Registration("cispo", _build, sections=(SECTION,), reads=PPO_UPDATES),)
