"""Supervised fine-tuning as a standalone algorithm, on a tiny model and the built-in task.

A freshly initialised tiny model learns digit reversal from clean demonstrations (noise 0;
the RL configs use 60% copied demonstrations to leave room for RL). metrics.jsonl logs the
train loss per step.

accuracy_before / accuracy_after are greedy exact-match accuracy on the held-out prompts;
eval_loss_before / eval_loss_after are the token NLL of their reference answers (EOS included).
"""

from jaxrlhf.schema import base_config


def get_config(arg=None):
    if arg not in (None, "smoke"):
        raise ValueError(f"unknown variant {arg!r}; known: smoke")
    config = base_config()
    config.algorithm = "sft"
    config.steps = 300
    config.data.task.sft_noise = 0.0
    config.rollout.batch_size = 32  # demonstrations per step
    config.optimizer.actor.lr = 3e-3
    config.optimizer.actor.min_lr_ratio = 0.1
    if arg == "smoke":  # the same job in seconds (`--config=configs/sft_tiny.py:smoke`)
        config.steps = 2
        config.warm_start.sft_steps = min(config.warm_start.sft_steps, 2)
    return config
