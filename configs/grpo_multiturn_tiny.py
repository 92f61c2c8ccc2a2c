"""GRPO over multi-turn, tool-using trajectories on a tiny model: the built-in `tools`
environment (jaxrlhf/data/environments.py) answers the policy's calculator calls
(`<tool_call>{"name": "calculator", "arguments": {"expression": "12+34"}}</tool_call>`) and
scores its final answer to a two-digit addition (1 when right after a calculator call).

Each trajectory holds at most 3 policy turns and 96 tokens after its prompt (the policy's and
the environment's); only the policy's are trained. Run as
`python -m jaxrlhf.train --config=configs/grpo_multiturn_tiny.py[:smoke]`. The byte-level tiny
model starts untrained here (no tool-call demonstrations yet), so this config exercises the
machinery rather than showing learning.
"""

from jaxrlhf.schema import base_config


def get_config(arg=None):
    if arg not in (None, "smoke"):
        raise ValueError(f"unknown variant {arg!r}; known: smoke")
    config = base_config()
    config.algorithm = "grpo"
    config.env["class"] = "tools"
    config.env.max_turns = 3
    config.data.task.kind = "arithmetic"
    config.data.task.num_digits = 2
    config.rollout.batch_size = 4
    config.rollout.group_size = 4
    config.rollout.max_new_tokens = 96
    config.steps = 20
    config.eval.max_prompts = 64  # held-out greedy trajectories before and after
    if arg == "smoke":  # the same job in seconds
        config.steps = 2
        config.eval.max_prompts = 8
    return config
