"""The RLHF pipeline, stage 2 of 3: the reward model (commands: configs/rlhf_sft_tiny.py).

The reward model is the SFT model's trunk (`--config.models.actor.path=` the exported SFT
directory) with a new zero score head, trained with the Bradley–Terry loss on the built-in
task's preference pairs (reversed answer chosen, copied answer rejected). accuracy_before /
accuracy_after are held-out preference accuracy (the zero head starts at 0: every pair tied).
"""

from jaxrlhf.configs import rw_tiny


def get_config(arg=None):
    """rw_tiny's job (`:smoke`: the same in seconds) without its warm start: the trunk is the
    SFT stage's."""
    config = rw_tiny.get_config(arg)
    config.warm_start.sft_steps = 0
    return config
