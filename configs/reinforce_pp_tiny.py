"""REINFORCE++ on a tiny model and the built-in digit-reversal task.

As configs/grpo_tiny.py (the same warm start and 32 sequences per step), but with no group
baseline: each token's reward-to-go (the exact-match score at the last token, −β·KL to the
reference on every token) is normalised by the mean and std over every token of the batch.
"""

from jaxrlhf.schema import base_config


def get_config(arg=None):
    if arg not in (None, "smoke"):
        raise ValueError(f"unknown variant {arg!r}; known: smoke")
    config = base_config()
    config.algorithm = "reinforce_pp"
    config.steps = 40
    config.warm_start.sft_steps = 300
    config.rollout.batch_size = 8
    config.rollout.group_size = 4
    if arg == "smoke":  # the same job in seconds (`--config=configs/reinforce_pp_tiny.py:smoke`)
        config.steps = 2
        config.warm_start.sft_steps = min(config.warm_start.sft_steps, 2)
    return config
