"""GRPO on a tiny model and the built-in digit-reversal task.

As configs/ppo_tiny.py: a supervised warm start on demonstrations that mostly copy instead of
reverse leaves the actor mostly wrong when greedy (held-out accuracy about 0.27), then GRPO with
an exact-match reward and 4 responses per prompt (8 prompts, 32 sequences per step) moves it to
reversing. No critic: each response is judged against the other three answers to its prompt.

Variant `dr_grpo` (`--config=configs/grpo_tiny.py:dr_grpo`): Dr. GRPO (Liu et al. 2025), the
advantage not divided by the group's std, and each response's token losses summed over the
constant 8-token budget rather than averaged over its own length.
"""

from jaxrlhf.schema import base_config


def get_config(arg=None):
    if arg not in (None, "smoke", "dr_grpo"):
        raise ValueError(f"unknown variant {arg!r}; known: smoke, dr_grpo")
    config = base_config()
    config.algorithm = "grpo"
    config.steps = 40
    config.warm_start.sft_steps = 300
    config.rollout.batch_size = 8
    config.rollout.group_size = 4
    if arg == "dr_grpo":
        config.grpo.scale_by_std = False
        config.grpo.aggregation = "seq_mean_token_sum_norm"
    if arg == "smoke":  # the same job in seconds (`--config=configs/grpo_tiny.py:smoke`)
        config.steps = 2
        config.warm_start.sft_steps = min(config.warm_start.sft_steps, 2)
    return config
