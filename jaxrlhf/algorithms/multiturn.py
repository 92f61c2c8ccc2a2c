"""GRPO over multi-turn trajectories: the environment scores them, no reward call.

Graph:
    actor_gen (trajectories: policy turns and environment replies, their rewards) ─► ref_inf ─┐
              └─────────────────────────────────────────────────────────────────────┴► actor_train

The generate call is the trajectory rollout (`dataflow/trajectories.py`): its response mask is
True only on tokens the policy wrote, so GRPO's loss, KL and statistics (`grpo.py`, unchanged)
count those alone; the trajectory's reward (the sum of its turns') is its score, given to every
policy token of it as the group-relative advantage.
"""

from __future__ import annotations

import dataclasses

from jaxrlhf.algorithms import grpo
from jaxrlhf.algorithms.ppo import GEN_KEYS, PROMPT_KEYS, SEQ_KEYS
from jaxrlhf.algorithms.spec import Algorithm
from jaxrlhf.mfc import MFC, Call, Role

# The prompt rows the environment starts from (host lists of the batch).
ROW_KEYS = ("prompt_text", "answer")


def mfcs() -> tuple[MFC, ...]:
    return (
        MFC("actor_gen", Role.ACTOR, Call.GENERATE, PROMPT_KEYS + ROW_KEYS,
            GEN_KEYS + ("scores_b",)),
        MFC("ref_inf", Role.REF, Call.INFERENCE, SEQ_KEYS, ("ref_logp_bn",)),
        MFC("actor_train", Role.ACTOR, Call.TRAIN_STEP, GEN_KEYS + ("ref_logp_bn", "scores_b"),
            ("actor_stats",)),
    )


def make(cfg: grpo.GRPOConfig) -> Algorithm:
    return dataclasses.replace(grpo.make(cfg, reward_model=False), name="grpo_multiturn",
                               mfcs=mfcs())
