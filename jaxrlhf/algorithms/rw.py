"""Reward modelling: a scalar-head model trained on preference pairs, offline.

Graph:
    reward_train

Bradley–Terry: −log σ(r(chosen) − r(rejected)), where r is the scalar head at the last token of
the sequence (its EOS) — exactly what the SCORES inference kind reads, so the trained model
serves as `reward.kind=model` in the RL algorithms. Rows are chosen then rejected (see
`algorithms.pairs`).
"""

from __future__ import annotations

from jaxrlhf.algorithms import losses
from jaxrlhf.algorithms.registry import Built, Registration
from jaxrlhf.algorithms.pairs import last_token_scores, split_pairs
from jaxrlhf.algorithms.spec import (
    Algorithm, BatchKind, Evaluation, Metric, TrainSpec, model_inputs,
)
from jaxrlhf.mfc import MFC, Call, Role

PAIR_KEYS = ("seq_tokens_bs", "seq_mask_bs", "response_mask_bn")


def mfcs() -> tuple[MFC, ...]:
    return (MFC("reward_train", Role.REWARD, Call.TRAIN_STEP, PAIR_KEYS, ("reward_stats",)),)


def _train_batch(buf, controller):
    del controller
    return model_inputs(buf["seq_tokens_bs"], buf["seq_mask_bs"]), {}


def reward_loss(out, batch):
    chosen_b, rejected_b = split_pairs(last_token_scores(out.values_bt, batch["segment_ids_bt"]))
    return losses.reward_model_loss(chosen_b, rejected_b)


def make() -> Algorithm:
    return Algorithm(name="rw", mfcs=mfcs(),
                     train={Role.REWARD: TrainSpec(_train_batch, reward_loss)},
                     batches=BatchKind.PAIRS, evaluation=Evaluation.PREFERENCE_SCORE,
                     trained_role=Role.REWARD,
                     shown=(Metric("loss", Role.REWARD), Metric("accuracy", Role.REWARD)))


ALGORITHMS = (Registration("rw", lambda request: Built(make())),)
