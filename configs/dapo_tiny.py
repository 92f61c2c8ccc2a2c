"""DAPO on a tiny model and the built-in digit-reversal task.

The warm start of configs/grpo_tiny.py, then DAPO: no KL term (no reference model), the ratio
clipped to [0.8, 1.28] (clip-higher), a token-level loss, responses longer than 5 tokens (a
right answer is 4 digits and EOS) penalised up to −1 at the 8-token budget (overlong shaping),
and dynamic sampling: each step samples 16 prompts × 4 responses and trains on 8 of the
groups, those whose rewards are not all equal first.
"""

from jaxrlhf.schema import base_config


def get_config(arg=None):
    if arg not in (None, "smoke"):
        raise ValueError(f"unknown variant {arg!r}; known: smoke")
    config = base_config()
    config.algorithm = "dapo"
    config.steps = 40
    config.warm_start.sft_steps = 300
    config.rollout.batch_size = 16  # prompts generated per step; 16 / oversample trained
    config.rollout.group_size = 4
    config.dapo.oversample = 2
    config.dapo.overlong_buffer = 3  # max_new_tokens 8: lengths 6..8 lose 1/3..1
    if arg == "smoke":  # the same job in seconds (`--config=configs/dapo_tiny.py:smoke`)
        config.steps = 2
        config.warm_start.sft_steps = min(config.warm_start.sft_steps, 2)
    return config
