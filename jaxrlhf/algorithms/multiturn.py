"""The graphs of GRPO and PPO over multi-turn trajectories: the environment scores them, no
reward call (`grpo.make_multiturn`, `ppo.make_multiturn` build the algorithms on them).

GRPO's graph:
    actor_gen (trajectories: policy turns and environment replies, their rewards) ─► ref_inf ─┐
              └─────────────────────────────────────────────────────────────────────┴► actor_train
PPO's adds the critic: critic_inf after actor_gen, critic_train beside actor_train.

The generate call is the trajectory rollout (`dataflow/trajectories.py`): its response mask is
True only on tokens the policy wrote, so every loss, KL and statistic counts those alone. GRPO
gives the trajectory's reward (the sum of its turns') to every policy token of it as the
group-relative advantage (`grpo.py`, unchanged). PPO (`ppo.py`) takes each turn's reward on the
last token of the policy's turn it answered (`turn_rewards_bn`: a reward the environment gives
only at the end is a trajectory-level one, one per turn a turn-level one), and its GAE and
value loss run over the policy's tokens only: the critic's values at the environment's tokens
are never read nor trained, and GAE carries the return across them.
"""

from __future__ import annotations

from jaxrlhf.algorithms.spec import GEN_KEYS, PROMPT_KEYS, SEQ_KEYS
from jaxrlhf.mfc import MFC, Call, Role

# The prompt rows the environment starts from (host lists of the batch).
ROW_KEYS = ("prompt_text", "answer")


def mfcs() -> tuple[MFC, ...]:
    """GRPO's graph over trajectories."""
    return (
        MFC("actor_gen", Role.ACTOR, Call.GENERATE, PROMPT_KEYS + ROW_KEYS,
            GEN_KEYS + ("scores_b",)),
        MFC("ref_inf", Role.REF, Call.INFERENCE, SEQ_KEYS, ("ref_logp_bn",)),
        MFC("actor_train", Role.ACTOR, Call.TRAIN_STEP, GEN_KEYS + ("ref_logp_bn", "scores_b"),
            ("actor_stats",)),
    )


def ppo_mfcs() -> tuple[MFC, ...]:
    """PPO's graph over trajectories (`ppo.mfcs` with the rollout's rewards for the reward's)."""
    train_in = GEN_KEYS + ("ref_logp_bn", "scores_b", "turn_rewards_bn", "values_bn")
    return (
        MFC("actor_gen", Role.ACTOR, Call.GENERATE, PROMPT_KEYS + ROW_KEYS,
            GEN_KEYS + ("scores_b", "turn_rewards_bn")),
        MFC("ref_inf", Role.REF, Call.INFERENCE, SEQ_KEYS, ("ref_logp_bn",)),
        MFC("critic_inf", Role.CRITIC, Call.INFERENCE, SEQ_KEYS, ("values_bn",)),
        MFC("actor_train", Role.ACTOR, Call.TRAIN_STEP, train_in, ("actor_stats",)),
        MFC("critic_train", Role.CRITIC, Call.TRAIN_STEP, train_in, ("critic_stats",)),
    )


