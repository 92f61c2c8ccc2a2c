"""CISPO on a tiny model and the built-in digit-reversal task.

The warm start of configs/grpo_tiny.py (8 prompts × 4 responses, group-normalised advantages),
then CISPO (MiniMax-M1): REINFORCE on every response token, each weighed by its importance
weight π_θ/π_old clipped to at most 1.28 and held constant, a token-level mean, no KL term
(no reference model). Two updates per step (`ppo.mini_batches`), so that the second update's
weights differ from 1 and the clip has something to do.
"""

from jaxrlhf.schema import base_config


def get_config(arg=None):
    if arg not in (None, "smoke"):
        raise ValueError(f"unknown variant {arg!r}; known: smoke")
    config = base_config()
    config.algorithm = "cispo"
    config.steps = 40
    config.warm_start.sft_steps = 300
    config.rollout.batch_size = 8
    config.rollout.group_size = 4
    config.ppo.mini_batches = 2
    if arg == "smoke":  # the same job in seconds (`--config=configs/cispo_tiny.py:smoke`)
        config.steps = 2
        config.warm_start.sft_steps = min(config.warm_start.sft_steps, 2)
    return config
