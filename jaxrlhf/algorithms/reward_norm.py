"""Reward normalisation: sequence scores scaled by running statistics, then clipped.

A reward model's scores have an arbitrary offset and scale (and drift as the policy moves), so
RLHF systems commonly standardise them with a running mean and standard deviation over every
score seen so far, and clip the result. Here:

  merged stats = running stats (count, mean, M2) of earlier steps ∪ this step's scores
  score' = clip((score - mean) / sqrt(M2 / count + eps), ±clip)      (either part optional)

The running statistics live in the algorithm's controller state (host floats, saved in
checkpoints, so a resumed run normalises exactly as the uninterrupted one). Every trained
model's `prepare` merges the same controller state with the same batch, so actor and critic see
the same scores; the actor's `prepare` also reports the merged statistics, which the controller
update then keeps for the next step.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from jaxrlhf.algorithms.spec import Algorithm
from jaxrlhf.mfc import Role

# Controller keys (and, from the actor's prepare, metric names) of the running statistics.
COUNT, MEAN, M2 = "reward_count", "reward_mean", "reward_m2"
_EPS = 1e-8
SCORE_KEYS = ("scores_b", "greedy_scores_b")  # what is scaled (statistics: scores_b only)


@dataclasses.dataclass(frozen=True)
class RewardNormConfig:
    """normalize: standardise by running mean/std; clip: |score| bound after it (0 = none)."""

    normalize: bool = False
    clip: float = 0.0

    @property
    def enabled(self) -> bool:
        return self.normalize or self.clip > 0


def merge(count, mean, m2, scores_b):
    """(count, mean, M2) of the earlier scores and `scores_b` [b] together (Chan et al.)."""
    n = scores_b.shape[0]
    batch_mean = jnp.mean(scores_b)
    batch_m2 = jnp.sum(jnp.square(scores_b - batch_mean))
    total = count + n
    delta = batch_mean - mean
    return total, mean + delta * n / total, m2 + batch_m2 + jnp.square(delta) * count * n / total


def normalized(scores_b, count, mean, m2, cfg: RewardNormConfig):
    """[b] scores standardised by (count, mean, M2) if configured, then clipped."""
    out_b = scores_b
    if cfg.normalize:
        out_b = (out_b - mean) / jnp.sqrt(m2 / jnp.maximum(count, 1.0) + _EPS)
    if cfg.clip > 0:
        out_b = jnp.clip(out_b, -cfg.clip, cfg.clip)
    return out_b


def _prepare(inner, cfg: RewardNormConfig, report: bool):
    def prepare(buf, controller):
        stats = merge(controller[COUNT], controller[MEAN], controller[M2], buf["scores_b"])
        # ReMax's greedy baseline is scaled like the scores it is subtracted from.
        scaled = {k: normalized(buf[k], *stats, cfg) for k in SCORE_KEYS if k in buf}
        batch, out = inner({**buf, **scaled}, controller)
        if report:
            out = {**out, **dict(zip((COUNT, MEAN, M2), stats))}
        return batch, out

    return prepare


def with_reward_norm(algorithm: Algorithm, cfg: RewardNormConfig) -> Algorithm:
    """`algorithm` whose trained models see normalised, clipped scores (`scores_b`)."""
    if not cfg.enabled:
        return algorithm
    if algorithm.offline:
        raise ValueError(f"reward normalisation needs an RL algorithm, not {algorithm.name}")
    train = {role: dataclasses.replace(
                 spec, prepare=_prepare(spec.prepare, cfg, report=role is Role.ACTOR))
             for role, spec in algorithm.train.items()}
    inner = algorithm.controller_update

    def update(controller, stats):
        new = dict(controller) if inner is None else inner(controller, stats)
        return {**new, **{k: float(stats[k]) for k in (COUNT, MEAN, M2)}}

    init = {**algorithm.controller_init, COUNT: 0.0, MEAN: 0.0, M2: 0.0}
    return dataclasses.replace(algorithm, train=train, controller_init=init,
                               controller_update=update)
