"""The RLHF pipeline, stage 2 of 3: the reward model (commands: configs/rlhf_sft_tiny.py).

The reward model is the SFT model's trunk (`--config.models.actor.path=` the exported SFT
directory) with a new zero score head, trained with the Bradley–Terry loss on the built-in
task's preference pairs (reversed answer chosen, copied answer rejected). accuracy_before /
accuracy_after are held-out preference accuracy (the zero head starts at 0: every pair tied).
"""

from jaxrlhf.schema import base_config


def get_config(arg=None):
    if arg not in (None, "smoke"):
        raise ValueError(f"unknown variant {arg!r}; known: smoke")
    config = base_config()
    config.algorithm = "rw"
    config.steps = 60
    config.rollout.batch_size = 32  # preference pairs per step (64 sequences)
    if arg == "smoke":  # the same job in seconds (`--config=configs/rlhf_rw_tiny.py:smoke`)
        config.steps = 2
    return config
