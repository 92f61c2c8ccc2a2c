"""Safe-RLHF on a tiny model and the built-in digit-reversal task.

Reward: exact match of the reversed digits. Cost: 1 when the answer contains the digit 9
(`jaxrlhf.data.costs:contains_nine`), so about a third of the prompts, those with a 9, cannot be
answered correctly at zero cost. The warm-started actor (see configs/ppo_tiny.py) starts at a
mean cost of about 0.3; the constraint E[cost] <= 0.1 raises the Lagrange multiplier until the
policy stops writing 9s, while the reward on the other prompts still goes up. metrics.jsonl
logs actor/cost, actor/score and actor/lambda per step.

accuracy_before / accuracy_after are greedy exact-match accuracy on held-out prompts, capped near
two thirds for a policy that keeps the constraint.
"""

from jaxrlhf.schema import base_config


def get_config(arg=None):
    if arg not in (None, "smoke"):
        raise ValueError(f"unknown variant {arg!r}; known: smoke")
    config = base_config()
    config.algorithm = "safe_rlhf"
    config.steps = 40
    config.warm_start.sft_steps = 300
    config.cost.function = "jaxrlhf.data.costs:contains_nine"
    config.safe_rlhf.cost_limit = 0.1
    config.safe_rlhf.lambda_init = 1.0
    config.safe_rlhf.lambda_lr = 0.5
    if arg == "smoke":  # the same job in seconds (`--config=configs/safe_rlhf_tiny.py:smoke`)
        config.steps = 2
        config.warm_start.sft_steps = min(config.warm_start.sft_steps, 2)
    return config
