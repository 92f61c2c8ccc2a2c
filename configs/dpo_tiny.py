"""DPO on a tiny model and the built-in digit-reversal task.

The actor is warm-started as in configs/ppo_tiny.py (demonstrations that mostly copy instead of
reverse), which leaves it preferring the copied answer. DPO then trains it on pairs (reversed
answer chosen, copied answer rejected) against a frozen copy of itself.

accuracy_before / accuracy_after are held-out PREFERENCE accuracy: the fraction of held-out
pairs (never trained on) where the policy gives the chosen answer a higher log-probability than
the rejected one. exact_match_before / exact_match_after are greedy exact-match accuracy on the
held-out prompts, as in the RL configs.
"""

from jaxrlhf.schema import base_config


def get_config(arg=None):
    if arg not in (None, "smoke"):
        raise ValueError(f"unknown variant {arg!r}; known: smoke")
    config = base_config()
    config.algorithm = "dpo"
    config.steps = 60
    config.warm_start.sft_steps = 300
    config.rollout.batch_size = 32  # preference pairs per step (64 sequences)
    config.dpo.beta = 0.1
    # Faster updates drive log π(chosen) down with log π(rejected) (the loss only sees their
    # gap) and greedy answers degrade although the preference accuracy is perfect.
    config.optimizer.actor.lr = 3e-4
    if arg == "smoke":  # the same job in seconds (`--config=configs/dpo_tiny.py:smoke`)
        config.steps = 2
        config.warm_start.sft_steps = min(config.warm_start.sft_steps, 2)
    return config
