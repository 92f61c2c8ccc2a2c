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

The same transformation corrects the mismatch between generation's and training's log-probs
of the same policy (different kernels, precisions, batch shapes): with `prox_call` the
`actor_prox` call runs whatever the number of updates, π_prox is the training engine's
log-prob before the update, π_prox / π_behav the mismatch's importance weight, truncated at
`PPOLossConfig.tis_cap` (truncated importance sampling, Yao et al. 2025), and every step logs
the mismatch |log π_prox − log π_behav| over the response tokens (mean and max). (Under
asynchronous RL, where π_behav may be older weights, the same figures measure staleness and
mismatch together.)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp

from jaxrlhf.algorithms.advantages import masked_mean
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


def mismatch_stats(prox_logp_bn, behav_logp_bn, mask_bn) -> dict[str, jax.Array]:
    """Mean and max over the valid tokens of |log π_prox − log π_behav| ([b, n] each)."""
    gap_bn = jnp.abs(prox_logp_bn.astype(jnp.float32) - behav_logp_bn.astype(jnp.float32))
    valid_bn = mask_bn > 0
    return {"mismatch_mean": masked_mean(gap_bn, mask_bn),
            "mismatch_max": jnp.max(jnp.where(valid_bn, gap_bn, 0.0))}


def _with_prox(prepare):
    """The actor's prepare, passing the proximal log-probs through to the train batch (unless
    the prepare did, with rows of its choosing) and reporting the mismatch."""

    def wrapped(buf, controller):
        batch, stats = prepare(buf, controller)
        stats = {**stats, **mismatch_stats(buf[PROX_KEY], buf["behav_logp_bn"],
                                           buf["response_mask_bn"])}
        return {PROX_KEY: buf[PROX_KEY], **batch}, stats

    return wrapped


def decouple(algorithm: Algorithm, actor_loss: Callable[[Proximal], LossFn], *,
             prox_call: bool = False) -> Algorithm:
    """`algorithm` (PPO-family: one actor generate and train_step) with the decoupled objective.

    `actor_loss(proximal)` is the algorithm's actor loss reading log π_prox through
    `proximal`. With several updates per batch (mini-batches or epochs) the weights move
    between them, so the `actor_prox` inference call runs before the actor's train step and
    the train step reads its output. With one update, the train step's own forward pass is
    π_prox, and that extra call over the whole batch is skipped, unless `prox_call` asks for
    it (the mismatch correction, which reports the mismatch of the whole batch).
    """
    spec = algorithm.train[Role.ACTOR]
    if spec.mini_batches * spec.epochs == 1 and not prox_call:
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
