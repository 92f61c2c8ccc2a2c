"""GRPO over multi-turn, tool-using trajectories on a tiny model: the built-in `tools`
environment (jaxrlhf/data/environments.py) answers the policy's calculator calls
(`<tool_call>{"name":"calculator","arguments":{"expression":"12+34"}}</tool_call>`) and
scores its final answer to a two-digit addition (1 when right after a calculator call).

The actor is first fine-tuned on trajectories (call, the calculator's reply, answer; only the
policy's turns trained) of which 60% subtract instead of adding (`tool_arithmetic`), so its
greedy trajectories are mostly wrong; GRPO over trajectories (8 prompts × 4 trajectories a
step) then moves it to adding: held-out accuracy 0.0 before RL and 0.97 after 20 steps, in
about 2.5 minutes with the warm start on 2 CPU cores (tests/test_multiturn_run.py).

Each trajectory holds at most 3 policy turns and 128 tokens after its prompt (the policy's and
the environment's); only the policy's are trained. Run as
`python -m jaxrlhf.train --config=configs/tool_math_tiny.py[:smoke]`.
"""

from jaxrlhf.schema import base_config


def get_config(arg=None):
    if arg not in (None, "smoke"):
        raise ValueError(f"unknown variant {arg!r}; known: smoke")
    config = base_config()
    config.algorithm = "grpo"
    config.env.name = "tools"
    config.env.max_turns = 3
    config.data.task.kind = "tool_arithmetic"
    config.data.task.num_digits = 2
    config.data.task.sft_noise = 0.6  # demonstrations that subtract instead of adding
    config.warm_start.sft_steps = 400
    config.rollout.batch_size = 8
    # small RL steps: one Adam step at the default 1e-3 moves every weight of the tiny model
    # enough to break its copying of the operands (the policy's KL to the warm start ~0.2/token)
    config.optimizer.actor.lr = 2e-4
    config.rollout.group_size = 4
    config.rollout.max_new_tokens = 128
    config.steps = 20
    config.eval.max_prompts = 64  # held-out greedy trajectories before and after
    if arg == "smoke":  # the same job in seconds
        config.steps = 2
        config.warm_start.sft_steps = 2
        config.eval.max_prompts = 8
    return config
