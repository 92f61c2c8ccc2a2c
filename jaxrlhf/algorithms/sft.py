"""Supervised fine-tuning: one train_step MFC, token NLL on the response tokens.

Rows are laid out exactly as generation lays them out (left-padded prompt, then the response
and EOS right-padded), so the warm-started model sees at training time what it will see when
it samples.
"""

from __future__ import annotations

from jaxrlhf.algorithms import losses
from jaxrlhf.algorithms.registry import Built, Registration
from jaxrlhf.algorithms.spec import (
    Algorithm, BatchKind, Evaluation, Metric, TrainSpec, model_inputs, response_logprobs,
)
from jaxrlhf.mfc import MFC, Call, Role

SFT_KEYS = ("seq_tokens_bs", "seq_mask_bs", "response_mask_bn")


def _prepare(buf, controller):
    del controller
    batch = model_inputs(buf["seq_tokens_bs"], buf["seq_mask_bs"])
    batch["mask_bn"] = buf["response_mask_bn"].astype("float32")
    return batch, {}


def _loss(out, batch):
    logp_bn = response_logprobs(out, batch["mask_bn"].shape[1])
    return losses.sft_loss(logp_bn, batch["mask_bn"])


def make() -> Algorithm:
    return Algorithm(
        name="sft",
        mfcs=(MFC("actor_train", Role.ACTOR, Call.TRAIN_STEP, SFT_KEYS, ("actor_stats",)),),
        train={Role.ACTOR: TrainSpec(_prepare, _loss)},
        batches=BatchKind.SFT_ROWS, evaluation=Evaluation.SFT,
        shown=(Metric("loss", Role.ACTOR),),
    )


ALGORITHMS = (Registration("sft", lambda request: Built(make())),)
