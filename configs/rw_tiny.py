"""Reward modelling on a tiny model and the built-in digit-reversal task.

A scalar-head model starts from the trunk of a supervised warm-started actor (as a reward model
starts from the SFT model in RLHF pipelines) with a zero head, and is trained with the
Bradley–Terry loss on pairs (reversed answer chosen, copied answer rejected).

accuracy_before / accuracy_after are held-out PREFERENCE accuracy: the fraction of held-out
pairs (never trained on) that the model scores chosen strictly above rejected. The zero head
starts at 0 (every pair tied).
"""

from jaxrlhf.schema import base_config


def get_config(arg=None):
    if arg not in (None, "smoke"):
        raise ValueError(f"unknown variant {arg!r}; known: smoke")
    config = base_config()
    config.algorithm = "rw"
    config.steps = 60
    config.warm_start.sft_steps = 150
    config.rollout.batch_size = 32  # preference pairs per step (64 sequences)
    if arg == "smoke":  # the same job in seconds (`--config=configs/rw_tiny.py:smoke`)
        config.steps = 2
        config.warm_start.sft_steps = min(config.warm_start.sft_steps, 2)
    return config
