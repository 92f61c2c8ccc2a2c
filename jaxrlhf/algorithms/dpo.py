"""DPO (Rafailov et al. 2023): preference optimisation against a frozen reference, offline.

Graph:
    ref_inf ─► actor_train

Each step's batch holds preference pairs, chosen rows then rejected rows (see
`algorithms.pairs`). The reference scores both responses once; the actor's loss is
−log σ(β·[(log π − log π_ref)(chosen) − (log π − log π_ref)(rejected)]) over sequence
log-probabilities of the response tokens (EOS included), with optional label smoothing (cDPO).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from jaxrlhf.algorithms import losses
from jaxrlhf.algorithms.logprob import sequence_logprobs
from jaxrlhf.algorithms.pairs import split_pairs
from jaxrlhf.algorithms.registry import Built, Registration, Request, Section, from_section
from jaxrlhf.algorithms.spec import (
    Algorithm, BatchKind, Evaluation, Metric, TrainSpec, model_inputs, response_logprobs,
)
from jaxrlhf.mfc import MFC, Call, Role

# Chosen rows then rejected rows, in the generation layout of `data.encode.sequence_batch`.
PAIR_KEYS = ("seq_tokens_bs", "seq_mask_bs", "response_mask_bn")


@dataclasses.dataclass(frozen=True)
class DPOConfig:
    """DPO hyper-parameters.

    Attributes:
      loss: β and the label smoothing ε.
    """

    loss: losses.DPOLossConfig = losses.DPOLossConfig()


def mfcs() -> tuple[MFC, ...]:
    return (
        MFC("ref_inf", Role.REF, Call.INFERENCE, PAIR_KEYS, ("ref_logp_bn",)),
        MFC("actor_train", Role.ACTOR, Call.TRAIN_STEP, PAIR_KEYS + ("ref_logp_bn",),
            ("actor_stats",)),
    )


def _train_batch(buf, controller):
    del controller
    batch = model_inputs(buf["seq_tokens_bs"], buf["seq_mask_bs"])
    batch.update(mask_bn=buf["response_mask_bn"].astype(jnp.float32),
                 ref_logp_bn=buf["ref_logp_bn"])
    return batch, {}


def actor_loss(cfg: DPOConfig):
    def loss_fn(out, batch):
        mask_bn = batch["mask_bn"]
        logp_bn = response_logprobs(out, mask_bn.shape[1])
        chosen_b, rejected_b = split_pairs(sequence_logprobs(logp_bn, mask_bn))
        ref_chosen_b, ref_rejected_b = split_pairs(sequence_logprobs(batch["ref_logp_bn"],
                                                                     mask_bn))
        return losses.dpo_loss(chosen_b, rejected_b, ref_chosen_b, ref_rejected_b, cfg.loss)

    return loss_fn


def make(cfg: DPOConfig) -> Algorithm:
    return Algorithm(name="dpo", mfcs=mfcs(),
                     train={Role.ACTOR: TrainSpec(_train_batch, actor_loss(cfg))},
                     batches=BatchKind.PAIRS, evaluation=Evaluation.PREFERENCE_LOGP,
                     shown=(Metric("loss", Role.ACTOR),
                            Metric("reward_accuracy", Role.ACTOR)))


SECTION = Section("dpo", {"beta": 0.1, "label_smoothing": 0.0})


def _build(request: Request) -> Built:
    return Built(make(DPOConfig(from_section(losses.DPOLossConfig, request.config.dpo))))


ALGORITHMS = (Registration("dpo", _build, sections=(SECTION,)),)
