"""GRPO over multi-turn trajectories on a tiny model, where the answer depends on facts the
policy must ask its environment for, turn by turn: the built-in `lookup` environment
(jaxrlhf/data/environments.py) knows each row's chain from the prompt's key ("q=") to a second
key and from that to a two-digit value; the policy asks "q?" (reply: "n"), then "n?" (reply:
"58"), then answers "58", reward 1 when right.

The actor is first fine-tuned on trajectories (only the policy's turns trained) of which 60%
take the first reply ("n") for the answer (`data.task.kind=lookup`), so its greedy
trajectories mostly stop after one question and score 0; GRPO over trajectories (8 prompts ×
4 trajectories a step) moves it to asking the second question: held-out accuracy 0.36 before
RL and 0.94 after 30 steps (0.95 at `async_rl.max_staleness=1`), turns per trajectory 2.4 ->
3.0, in about 8 minutes with the warm start on 2 loaded CPU cores
(tests/test_multiturn_run.py). The warm start learns to read the value from the 40% clean
demonstrations late (its loss drops near step 600): with 800 steps a small change of numerics
left it unlearnt (0.08 -> 0.47), so it takes 1,200. Turns per trajectory and the tool-call error rate (questions for keys
not in the chain) are logged.

Each trajectory holds at most 3 policy turns and 128 tokens after its prompt (the policy's and
the environment's). Run as `python -m jaxrlhf.train --config=configs/multiturn_tiny.py[:smoke]`.
"""

from jaxrlhf.configs import tool_math_tiny
from jaxrlhf.schema import base_config


def get_config(arg=None):
    """tool_math_tiny's job (`:smoke`: the same in seconds) on the lookup task."""
    config = tool_math_tiny.get_config(arg)
    config.env.name = "lookup"
    config.data.task.kind = "lookup"
    # tool_math_tiny's digits back to the default: the lookup task has none, and a key set
    # but unread is refused
    config.data.task.num_digits = base_config().data.task.num_digits
    # sft_noise 0.6: demonstrations that stop after one question.
    if arg is None:
        config.warm_start.sft_steps = 1200  # reading the value: in 40% of the demonstrations only
        config.steps = 30
    return config
