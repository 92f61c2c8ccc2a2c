"""RLOO on a tiny model and the built-in digit-reversal task.

As configs/grpo_tiny.py (the same warm start, leaving the actor mostly wrong when greedy, and
8 prompts × 4 responses per step), but each response's return (its exact-match score minus
β·KL to the reference) is judged against the mean return of the OTHER three responses to its
prompt (the leave-one-out baseline), and the loss is a token-level mean.
"""

from jaxrlhf.schema import base_config


def get_config(arg=None):
    if arg not in (None, "smoke"):
        raise ValueError(f"unknown variant {arg!r}; known: smoke")
    config = base_config()
    config.algorithm = "rloo"
    config.steps = 40
    config.warm_start.sft_steps = 300
    config.rollout.batch_size = 8
    config.rollout.group_size = 4
    if arg == "smoke":  # the same job in seconds (`--config=configs/rloo_tiny.py:smoke`)
        config.steps = 2
        config.warm_start.sft_steps = min(config.warm_start.sft_steps, 2)
    return config
