"""GRPO over multi-turn trajectories on a tiny model, where the answer depends on facts the
policy must ask its environment for, turn by turn: the built-in `lookup` environment
(jaxrlhf/data/environments.py) knows each row's chain from the prompt's key ("q=") to a second
key and from that to a two-digit value; the policy asks "q?" (reply: "n"), then "n?" (reply:
"58"), then answers "58", reward 1 when right.

The actor is first fine-tuned on trajectories (only the policy's turns trained) of which 60%
take the first reply ("n") for the answer (`data.task.kind=lookup`), so its greedy
trajectories stop after one question and score 0; GRPO over trajectories (8 prompts × 4
trajectories a step) moves it to asking the second question: held-out accuracy 0.17 before
RL and 1.0 after 30 steps, turns per trajectory 2.2 -> 3.0, in about 8 minutes with the warm
start on 2 loaded CPU cores (tests/test_multiturn_run.py). Turns per trajectory and the tool-call error rate (questions for keys
not in the chain) are logged.

Each trajectory holds at most 3 policy turns and 128 tokens after its prompt (the policy's and
the environment's). Run as `python -m jaxrlhf.train --config=configs/multiturn_tiny.py[:smoke]`.
"""

from jaxrlhf.schema import base_config


def get_config(arg=None):
    if arg not in (None, "smoke"):
        raise ValueError(f"unknown variant {arg!r}; known: smoke")
    config = base_config()
    config.algorithm = "grpo"
    config.env["class"] = "lookup"
    config.env.max_turns = 3
    config.data.task.kind = "lookup"
    config.data.task.sft_noise = 0.6  # demonstrations that stop after one question
    config.warm_start.sft_steps = 800  # reading the value: in 40% of the demonstrations only
    config.rollout.batch_size = 8
    config.optimizer.actor.lr = 2e-4  # as tool_math_tiny's: small steps keep the copying intact
    config.rollout.group_size = 4
    config.rollout.max_new_tokens = 128
    config.steps = 30
    config.eval.max_prompts = 64  # held-out greedy trajectories before and after
    if arg == "smoke":  # the same job in seconds
        config.steps = 2
        config.warm_start.sft_steps = 2
        config.eval.max_prompts = 8
    return config
