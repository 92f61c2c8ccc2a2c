"""GRPO on a tiny Qwen3-MoE shape (`tiny-moe`: 8 experts of width 128, 2 a token, in both
layers; models/moe.py) and the built-in digit-reversal task, warm-started as
configs/grpo_tiny.py is: a supervised warm start on demonstrations that mostly copy, then GRPO
with an exact-match reward and 4 responses per prompt.

The train step adds the router's load-balancing loss (coefficient 0.01) and z-loss (0.001) of
the size's `MoeConfig` and logs them with the least-used expert's share of the tokens
(actor/moe_balance_loss, actor/moe_z_loss, actor/moe_min_load; 1 = an even share).

The actor learns at 3e-4 for 80 steps (grpo_tiny: 1e-3 for 40): at 1e-3 its KL to the
reference passed 2 nats within 3 steps and held-out accuracy went 0.14 -> 0.41 in 40 steps.
Measured on 8 CPU devices at the test suite's XLA flags (`XLA_FLAGS=
--xla_backend_optimization_level=0 python -m jaxrlhf.train --config=configs/grpo_moe_tiny.py`,
592 s on loaded cores): held-out accuracy 0.135 -> 0.915 (at 5e-4: 0.895), balance loss
2.03-2.20 (2 when even), z-loss 3.72 -> 3.78; the least-used expert's share of one forward's
352 tokens (actor/moe_min_load, min over both layers) had median 0.40 of an even share over
the run and 0.35 over the last 20 steps, below a quarter in 15% of the steps.
"""

from jaxrlhf.schema import base_config


def get_config(arg=None):
    if arg not in (None, "smoke"):
        raise ValueError(f"unknown variant {arg!r}; known: smoke")
    config = base_config()
    config.algorithm = "grpo"
    config.models.actor.size = "tiny-moe"
    config.models.ref.size = "tiny-moe"
    config.steps = 80
    config.optimizer.actor.lr = 3e-4
    config.warm_start.sft_steps = 300
    config.rollout.batch_size = 8
    config.rollout.group_size = 4
    if arg == "smoke":  # the same job in seconds (`--config=configs/grpo_moe_tiny.py:smoke`)
        config.steps = 2
        config.warm_start.sft_steps = 2
    return config
