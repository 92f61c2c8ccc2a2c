"""AReaL's decoupled PPO objective, as a transformation of the PPO and GRPO algorithms.

Asynchronous RL trains on samples that older policies generated, some of them by several
policies (a sequence interrupted by a weight update continues under the new weights). Standard
PPO clips the ratio π_θ / π_behav against that mixture of stale policies, so its trust region
moves with how stale the data is. AReaL decouples the two roles of the old policy:

  l_t = −(π_prox / π_behav) · min(u_t A_t, clip(u_t, 1 ± ε) A_t),   u_t = π_θ / π_prox,

where π_behav is the policy that sampled token t (its log-prob recorded at generation) and
π_prox is the trainer's policy before this step's updates. The math is
`losses.ppo_policy_loss(..., proximal_logp_bn=...)`; this module adds what the graph needs to
feed it: one more actor call, `actor_prox` (log-probs of the sampled sequences under the
trainer's current weights, on the actor's train layout), whose output the actor's train step
reads, where a batch takes several updates; with one update (the default) the train step's own
forward pass gives π_prox. With fresh on-policy data π_prox = π_behav and the objective equals
standard PPO.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax

from jaxrlhf.algorithms import grpo, ppo
from jaxrlhf.algorithms.spec import Algorithm, LossFn, Proximal
from jaxrlhf.mfc import MFC, Call, Role

PROX_KEY = "prox_logp_bn"  # [b, n] log π_prox of the response tokens
PROX_MFC = "actor_prox"


def batch_proximal(logp_bn, batch):
    """log π_prox as the `actor_prox` call computed it, before this step's first update."""
    del logp_bn
    return batch[PROX_KEY]


def own_proximal(logp_bn, batch):
    """log π_prox as this step's own forward pass: with one update per batch, the weights it
    differentiates are π_prox (u = π_θ / π_prox = 1, the clip inactive, the same gradient)."""
    del batch
    return jax.lax.stop_gradient(logp_bn)


def _with_prox(prepare):
    """The actor's prepare, passing the proximal log-probs through to the train batch."""

    def wrapped(buf, controller):
        batch, stats = prepare(buf, controller)
        return {**batch, PROX_KEY: buf[PROX_KEY]}, stats

    return wrapped


def decouple(algorithm: Algorithm, actor_loss: Callable[[Proximal], LossFn]) -> Algorithm:
    """`algorithm` (PPO-family: one actor generate and train_step) with the decoupled objective.

    `actor_loss(proximal)` is the algorithm's actor loss reading log π_prox through
    `proximal`. With several updates per batch (mini-batches or epochs) the weights move
    between them, so the `actor_prox` inference call runs before the actor's train step and
    the train step reads its output. With one update, the train step's own forward pass is
    π_prox, and that extra call over the whole batch is skipped.
    """
    spec = algorithm.train[Role.ACTOR]
    if spec.mini_batches * spec.epochs == 1:
        actor = dataclasses.replace(spec, loss_fn=actor_loss(own_proximal))
        return dataclasses.replace(algorithm, train={**algorithm.train, Role.ACTOR: actor})
    (gen,) = [m for m in algorithm.mfcs if m.role is Role.ACTOR and m.call is Call.GENERATE]
    (train,) = [m for m in algorithm.mfcs if m.role is Role.ACTOR and m.call is Call.TRAIN_STEP]
    seq_keys = gen.outputs[:3]  # sequence tokens, sequence mask, response mask
    prox = MFC(PROX_MFC, Role.ACTOR, Call.INFERENCE, seq_keys, (PROX_KEY,))
    mfcs = []
    for mfc in algorithm.mfcs:
        if mfc is train:
            mfcs += [prox, dataclasses.replace(mfc, inputs=mfc.inputs + (PROX_KEY,))]
        else:
            mfcs.append(mfc)
    actor = dataclasses.replace(spec, prepare=_with_prox(spec.prepare),
                                loss_fn=actor_loss(batch_proximal))
    return dataclasses.replace(algorithm, mfcs=tuple(mfcs),
                               train={**algorithm.train, Role.ACTOR: actor})


def decoupled_ppo(cfg: ppo.PPOConfig, *, reward_model: bool, batch_size: int) -> Algorithm:
    return decouple(ppo.make(cfg, reward_model=reward_model, batch_size=batch_size),
                    functools.partial(ppo.actor_loss, cfg))


def decoupled_grpo(cfg: grpo.GRPOConfig, *, reward_model: bool) -> Algorithm:
    return decouple(grpo.make(cfg, reward_model=reward_model),
                    functools.partial(grpo.actor_loss, cfg))
