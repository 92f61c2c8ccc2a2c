"""GSPO (Zheng et al. 2025, Group Sequence Policy Optimization): GRPO's groups, a sequence-level
importance ratio and clipping.

Graph: GRPO's (`grpo.py`). GRPO weighs each token by its own ratio π_θ(y_t)/π_old(y_t), whose
noise grows with the length of the response and which the sequence-level reward does not
match. GSPO uses one ratio per response, the length-normalised sequence likelihood ratio

    s_i = (π_θ(y_i) / π_old(y_i))^(1/|y_i|) = exp(mean_t log π_θ(y_t)/π_old(y_t)),

and clips it, per response, to [1 − ε_low, 1 + ε_high] with ε two or three orders of
magnitude below PPO's (3e-4 and 4e-4 in the paper): l_i = −min(s_i A_i, clip(s_i) A_i),
averaged over responses. GRPO's β·KL term to the reference stays (per-response mean of the
per-token estimate).

With the mismatch correction (`decoupled.py`, π_prox the training engine's log-probs before
the update), the ratio is taken against π_prox and the response's loss weighed by its
length-normalised mismatch ratio, truncated: min((π_prox(y_i) / π_behav(y_i))^(1/|y_i|), C).
"""

from __future__ import annotations

import dataclasses
import functools

import chex
import jax
import jax.numpy as jnp

from jaxrlhf.algorithms import grpo
from jaxrlhf.algorithms.kl import kl_per_token
from jaxrlhf.algorithms.losses import LossOutput
from jaxrlhf.algorithms.registry import (
    Built, Capability, Registration, Request, Section, from_section,
)
from jaxrlhf.algorithms.spec import (
    PPO_CLIP, PPO_UPDATES, Algorithm, Proximal, response_policy,
)
from jaxrlhf.mfc import Role
from jaxrlhf.schema import field

_sg = jax.lax.stop_gradient


@dataclasses.dataclass(frozen=True)
class GSPOConfig:
    """GSPO hyper-parameters.

    Attributes:
      grpo: groups, advantages, β and the KL estimator, updates per step, temperature (its
        surrogate's clipping is not used).
      clip_eps, clip_eps_high: the sequence ratio is clipped to [1 − clip_eps, 1 + clip_eps_high].
      tis_cap: the mismatch correction's truncation C (used with π_prox); None = no truncation.
    """

    grpo: grpo.GRPOConfig
    clip_eps: float = 3e-4
    clip_eps_high: float = 4e-4
    tis_cap: float | None = None

    def __post_init__(self):
        if self.clip_eps <= 0 or self.clip_eps_high <= 0:
            raise ValueError(f"GSPO's clip epsilons must be > 0, got {self.clip_eps} and "
                             f"{self.clip_eps_high}")


def gspo_loss(logp_bn: jax.Array, old_logp_bn: jax.Array, ref_logp_bn: jax.Array,
              advantages_bn: jax.Array, mask_bn: jax.Array, cfg: GSPOConfig,
              entropy_bn: jax.Array | None = None,
              proximal_logp_bn: jax.Array | None = None) -> LossOutput:
    """Sequence-ratio clipped surrogate plus β·KL, mean over responses.

    Args:
      logp_bn: [b, n] log π_θ of the response tokens (differentiated).
      old_logp_bn: [b, n] log π_old (the behaviour policy's, recorded at generation).
      ref_logp_bn: [b, n] log π_ref.
      advantages_bn: [b, n] the response's advantage on each of its valid tokens.
      mask_bn: [b, n] 1 = valid response token.
      cfg: clipping and the KL term.
      entropy_bn: optional [b, n] entropies (logged; no bonus).
      proximal_logp_bn: optional [b, n] log π_prox: the ratio is taken against it, and l_i
        weighed by the truncated mismatch ratio of π_prox to π_old (the behaviour policy).

    Returns:
      (Σ over responses of w_i·l_i + β·mean_t KL_t, number of responses with tokens, stat sums
      over responses: clip_frac, importance_weight (s_i), ref_kl, entropy when given, and
      behav_imp_weight (w_i) with π_prox).
    """
    chex.assert_equal_shape((logp_bn, old_logp_bn, ref_logp_bn, advantages_bn, mask_bn))
    valid_bn = mask_bn > 0
    zero = lambda x_bn: jnp.where(valid_bn, x_bn.astype(jnp.float32), 0.0)
    logp_bn, old_logp_bn, ref_logp_bn = zero(logp_bn), zero(_sg(old_logp_bn)), zero(ref_logp_bn)
    count_b = jnp.sum(valid_bn, axis=1).astype(jnp.float32)
    seq_mean = lambda x_bn: jnp.sum(zero(x_bn), axis=1) / jnp.maximum(count_b, 1.0)
    denom_bn = old_logp_bn if proximal_logp_bn is None else zero(_sg(proximal_logp_bn))
    ratio_b = jnp.exp(seq_mean(logp_bn - denom_bn))
    adv_b = seq_mean(_sg(advantages_bn))
    unclipped_b = -adv_b * ratio_b
    clipped_b = -adv_b * jnp.clip(ratio_b, 1.0 - cfg.clip_eps, 1.0 + cfg.clip_eps_high)
    is_clipped_b = clipped_b > unclipped_b
    loss_b = jnp.where(is_clipped_b, clipped_b, unclipped_b)  # the active branch's gradient
    stats_b = {}
    if proximal_logp_bn is not None:
        behav_weight_b = jnp.exp(seq_mean(denom_bn - old_logp_bn))
        if cfg.tis_cap is not None:
            behav_weight_b = jnp.minimum(behav_weight_b, cfg.tis_cap)
        loss_b = loss_b * behav_weight_b
        stats_b["behav_imp_weight"] = behav_weight_b
    g = cfg.grpo.loss
    kl_b = seq_mean(kl_per_token(logp_bn, _sg(ref_logp_bn), g.kl_estimator))
    has_b = (count_b > 0).astype(jnp.float32)
    stats_b |= {"clip_frac": is_clipped_b.astype(jnp.float32), "importance_weight": ratio_b,
                "ref_kl": kl_b}
    if entropy_bn is not None:
        stats_b["entropy"] = seq_mean(entropy_bn)
    stats = {k: jnp.sum(has_b * _sg(v)) for k, v in stats_b.items()}
    return jnp.sum(has_b * (loss_b + g.kl_coef * kl_b)), jnp.sum(has_b), stats


def actor_loss(cfg: GSPOConfig, proximal: Proximal | None = None):
    """The sequence-ratio loss; with `proximal`, against π_prox (the mismatch correction)."""

    def loss_fn(out, batch):
        logp_bn, entropy_bn = response_policy(out, batch)
        return gspo_loss(logp_bn, batch["old_logp_bn"], batch["ref_logp_bn"],
                         batch["advantages_bn"], batch["mask_bn"], cfg, entropy_bn=entropy_bn,
                         proximal_logp_bn=proximal(logp_bn, batch) if proximal else None)

    return loss_fn


def make(cfg: GSPOConfig, *, reward_model: bool) -> Algorithm:
    base = grpo.make(cfg.grpo, reward_model=reward_model)
    actor = dataclasses.replace(base.train[Role.ACTOR], loss_fn=actor_loss(cfg))
    return dataclasses.replace(base, name="gspo", train={Role.ACTOR: actor})


SECTION = Section("gspo", {"clip_eps": 3e-4, "clip_eps_high": 4e-4},  # the sequence ratio's
                  bounds=((">", 0, ("clip_eps", "clip_eps_high")),))  # clip range


def _build(request: Request) -> Built:
    config = request.config
    with field("gspo"):
        cfg = from_section(GSPOConfig, config.gspo, grpo=grpo.from_config(config),
                           tis_cap=config.ppo.tis_cap or None)
    return Built(make(cfg, reward_model=request.reward_model), functools.partial(actor_loss, cfg))


ALGORITHMS = (Registration("gspo", _build, sections=(SECTION,),
                           reads=(*PPO_UPDATES, *PPO_CLIP, "grpo"),
                           capabilities=frozenset({Capability.MISMATCH_CORRECTION})),)
