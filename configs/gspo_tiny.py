"""GSPO on a tiny model and the built-in digit-reversal task.

As configs/grpo_tiny.py (the same warm start, 8 prompts × 4 responses, group-normalised
advantages, β·KL to the reference), but the importance ratio is one per response (the
length-normalised sequence likelihood ratio) and clipped per response to [1 − 3e-4, 1 + 4e-4].
"""

from jaxrlhf.schema import base_config


def get_config(arg=None):
    if arg not in (None, "smoke"):
        raise ValueError(f"unknown variant {arg!r}; known: smoke")
    config = base_config()
    config.algorithm = "gspo"
    config.steps = 40
    config.warm_start.sft_steps = 300
    config.rollout.batch_size = 8
    config.rollout.group_size = 4
    if arg == "smoke":  # the same job in seconds (`--config=configs/gspo_tiny.py:smoke`)
        config.steps = 2
        config.warm_start.sft_steps = min(config.warm_start.sft_steps, 2)
    return config
