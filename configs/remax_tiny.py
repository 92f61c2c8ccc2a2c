"""ReMax on a tiny model and the built-in digit-reversal task.

As configs/ppo_tiny.py: a supervised warm start on demonstrations that mostly copy instead of
reverse leaves the actor mostly wrong when greedy (held-out accuracy about 0.27). Each step the
actor answers every prompt twice, once sampled and once greedily; the sampled answer's
exact-match reward minus the greedy answer's reward is its REINFORCE advantage. No critic.
"""

from jaxrlhf.schema import base_config


def get_config(arg=None):
    if arg not in (None, "smoke"):
        raise ValueError(f"unknown variant {arg!r}; known: smoke")
    config = base_config()
    config.algorithm = "remax"
    config.steps = 40
    config.warm_start.sft_steps = 300
    if arg == "smoke":  # the same job in seconds (`--config=configs/remax_tiny.py:smoke`)
        config.steps = 2
        config.warm_start.sft_steps = min(config.warm_start.sft_steps, 2)
    return config
