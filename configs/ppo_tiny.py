"""PPO on a tiny model and the built-in digit-reversal task: the CPU default that visibly learns.

The built-in task is digit reversal ("4821>" -> "1284"). The actor is first fine-tuned on
demonstrations of which 60% copy instead of reverse, so it answers mostly wrong when greedy;
PPO with an exact-match reward then moves it to the right answers (held-out accuracy about
0.27 before RL and above 0.9 after, in about a minute on 2 CPU cores).
"""

from jaxrlhf.schema import base_config


def get_config(arg=None):
    if arg not in (None, "smoke"):
        raise ValueError(f"unknown variant {arg!r}; known: smoke")
    config = base_config()
    config.algorithm = "ppo"
    config.steps = 40
    config.warm_start.sft_steps = 300
    if arg == "smoke":  # the same job in seconds (`--config=configs/ppo_tiny.py:smoke`)
        config.steps = 2
        config.warm_start.sft_steps = min(config.warm_start.sft_steps, 2)
    return config
