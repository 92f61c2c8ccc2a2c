"""What an algorithm tells the runtime: its MFCs, and how it trains each trainable model.

An algorithm is data plus pure functions. The runtime (jaxrlhf.dataflow) executes the MFCs; for
each train_step MFC it asks the algorithm's `TrainSpec` to turn the step buffer into a train
batch (`prepare`, jitted on the train layout) and then runs `epochs × mini_batches` updates with
`loss_fn` under the train_step contract of jaxrlhf.engine.train_step.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp

from jaxrlhf.algorithms import losses
from jaxrlhf.engine.inference import InferenceConfig, InferenceKind, InferenceOutput
from jaxrlhf.mfc import MFC, Role

Batch = dict[str, jax.Array]
# Step-buffer keys of the policy-gradient graphs: the prompts, the generated rows (with their
# behaviour log-probs) and what an inference call over those rows reads.
PROMPT_KEYS = ("prompt_tokens_bp", "prompt_mask_bp")
GEN_KEYS = ("seq_tokens_bs", "seq_mask_bs", "response_mask_bn", "behav_logp_bn")
SEQ_KEYS = ("seq_tokens_bs", "seq_mask_bs", "response_mask_bn")
# The shared `ppo` section's keys by the part of PPO that reads them; an algorithm that reads
# only some parts names them in its `Registration.reads` (PPO and Safe-RLHF read all of `ppo`),
# so a key it never reads is refused when set (`jaxrlhf/run/unread.py`).
PPO_UPDATES = ("ppo.mini_batches", "ppo.epochs", "ppo.tis_cap")  # updates per step, TIS
PPO_CLIP = ("ppo.clip_eps", "ppo.entropy_coef")  # the clipped surrogate's ε and entropy bonus
PPO_KL_PENALTY = ("ppo.kl_coef", "ppo.kl_adaptive", "ppo.kl_target", "ppo.kl_horizon")  # β
# GAE (gamma, lam, value_clip, whiten_advantages) and kl_in_reward: a critic's algorithms only
# (the model's per-token readout of the batch, batch) -> (loss_sum, weight, stats); see
# jaxrlhf.engine.train_step.
LossFn = Callable[[InferenceOutput, Batch], tuple[jax.Array, jax.Array, dict[str, jax.Array]]]
# (log π_θ [b, n] of this step's forward pass, batch) -> log π_prox [b, n] (decoupled PPO).
Proximal = Callable[[jax.Array, Batch], jax.Array]
# prepare(buffer arrays, controller state) -> (train batch, stats of the batch)
PrepareFn = Callable[[Batch, Mapping[str, jax.Array]], tuple[Batch, dict[str, jax.Array]]]


@dataclasses.dataclass(frozen=True)
class TrainSpec:
    """How one model is trained inside a step.

    Attributes:
      prepare: pure function building the train batch (model inputs `tokens_bt`,
        `positions_bt`, `segment_ids_bt` plus the loss's keys) from the MFC's input keys.
      loss_fn: the train_step loss.
      mini_batches: optimizer updates per epoch, each on an equal slice of the batch.
      epochs: passes over the batch.
      readout: what `loss_fn` reads of the model (None: the train step's default, log-probs
        at temperature 1 of an LM head, values of a scalar head).
    """

    prepare: PrepareFn
    loss_fn: LossFn
    mini_batches: int = 1
    epochs: int = 1
    readout: InferenceConfig | None = None


class BatchKind(enum.Enum):
    """What one step of an algorithm is fed."""

    PROMPTS = "prompts"  # RL: prompts; the step generates its own samples
    SFT_ROWS = "sft_rows"  # prompt + reference response rows
    PAIRS = "pairs"  # preference pairs, batched as chosen rows then rejected rows


class Evaluation(enum.Enum):
    """What the job's held-out "accuracy" (before and after training) means."""

    EXACT_MATCH = "exact_match"  # greedy exact match of the actor on held-out prompts
    SFT = "sft"  # exact match, plus the token NLL of the reference answers (eval_loss)
    PREFERENCE_LOGP = "preference_logp"  # log π(chosen) > log π(rejected); plus exact match
    PREFERENCE_SCORE = "preference_score"  # r(chosen) > r(rejected) of the reward model


@dataclasses.dataclass(frozen=True)
class Metric:
    """A figure of one step, typed: statistic `name` of `role`'s train step, or with no role
    the step's mean reward. Loops look figures up by it; names are only made for output."""

    name: str
    role: Role | None = None


@dataclasses.dataclass(frozen=True)
class Algorithm:
    """An algorithm: the MFC list, train specs per trained role, and controller updates.

    Attributes:
      name: for reports.
      mfcs: the dataflow graph's calls.
      train: role -> TrainSpec for each model with a train_step MFC.
      controller_init: initial controller state (e.g. {"kl_coef": 0.1}); part of checkpoints.
      controller_update: (state, step stats) -> new state, run once per step on the host.
      temperature: sampling temperature of generation; log-probs everywhere use it.
      batches: what a step is fed.
      evaluation: what the held-out accuracy measures.
      trained_role: the model the job evaluates and reports.
      shown: the progress bar's figures.
      oversample: generated rows per trained row (DAPO's dynamic sampling trains 1/k).
    """

    name: str
    mfcs: tuple[MFC, ...]
    train: Mapping[Role, TrainSpec]
    controller_init: Mapping[str, float] = dataclasses.field(default_factory=dict)
    controller_update: Callable[[Mapping[str, Any], Mapping[str, float]], dict] | None = None
    temperature: float = 1.0
    batches: BatchKind = BatchKind.PROMPTS
    evaluation: Evaluation = Evaluation.EXACT_MATCH
    trained_role: Role = Role.ACTOR
    shown: tuple[Metric, ...] = (Metric("reward"), Metric("kl", Role.ACTOR))
    oversample: int = 1

    @property
    def offline(self) -> bool:
        """Trains on a fixed dataset (no generation in the step)."""
        return self.batches is not BatchKind.PROMPTS


def model_inputs(tokens_bt: jax.Array, mask_bt: jax.Array) -> Batch:
    """Model input keys for one left-padded sequence per row (positions = cumsum(mask) - 1)."""
    mask_bt = mask_bt.astype(jnp.int32)
    positions_bt = jnp.maximum(jnp.cumsum(mask_bt, axis=1) - 1, 0)
    return {"tokens_bt": tokens_bt.astype(jnp.int32), "positions_bt": positions_bt,
            "segment_ids_bt": mask_bt}


def policy_readout(temperature: float) -> InferenceConfig:
    """A policy loss's readout: log-probs and entropies of the sampling distribution
    (temperature 0, greedy, reads as 1: the engine records greedy samples' log-probs at
    temperature 1, `engine/sampling.py`, and the loss must see the same distribution)."""
    return InferenceConfig(InferenceKind.LOGPROBS, temperature=temperature or 1.0,
                           with_entropy=True)


def response_logprobs(out: InferenceOutput, num_response: int) -> jax.Array:
    """[b, n] log-probs of the last `num_response` tokens of every row."""
    return out.logprobs_bt[:, -num_response:]


def response_policy(out: InferenceOutput, batch: Batch):
    """([b, n] log-probs, [b, n] entropies of the distributions that drew them) of the response
    tokens; n = batch["mask_bn"] width."""
    n = batch["mask_bn"].shape[1]
    return out.logprobs_bt[:, -n:], out.entropy_bt[:, -n:]


def clipped_surrogate(policy: losses.PPOLossConfig, proximal: Proximal | None = None) -> LossFn:
    """PPO's clipped surrogate on the response tokens under `policy` (clip ranges, token or
    sequence aggregation), no KL term; with `proximal`, the decoupled objective."""

    def loss_fn(out: InferenceOutput, batch: Batch):
        logp_bn, entropy_bn = response_policy(out, batch)
        return losses.ppo_policy_loss(
            logp_bn, batch["old_logp_bn"], batch["advantages_bn"], batch["mask_bn"], policy,
            proximal_logp_bn=proximal(logp_bn, batch) if proximal else None, entropy_bn=entropy_bn)

    return loss_fn


def response_values(values_bt: jax.Array, num_response: int) -> jax.Array:
    """[b, n] V(s_t): the value at the position that predicts response token t."""
    return values_bt[:, -num_response - 1:-1]
