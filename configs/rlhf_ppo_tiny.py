"""The RLHF pipeline, stage 3 of 3: PPO against the learned reward model (commands:
configs/rlhf_sft_tiny.py).

The actor (and the reference, its copy) start from the exported SFT model
(`--config.models.actor.path=`), the critic from its trunk with a zero value head, and each
response is scored by the exported reward model (`--config.models.reward.path=`). A learned
reward is only right near the answers it was trained on (here: reversed or copied digits), so a
policy that maximises it freely drifts to outputs it scores high but that are wrong (InstructGPT's
over-optimisation). What keeps this run honest:

  * KL control toward a target: −β·KL(π ‖ π_SFT) in every token's reward, β adapted each step
    (Ziegler et al. 2019) so the KL to the SFT policy stays near `ppo.kl_target` nats;
  * reward normalisation: scores standardised by their running mean and std over the run, so
    β weighs the KL against a reward of known scale whatever the reward model's offset and scale;
  * reward clipping: normalised scores beyond ±`reward.clip` (outliers the policy found) count
    no more than the bound.

accuracy_before / accuracy_after are held-out exact match of greedy answers against the task's
answers (the reward model never sees them): the SFT model's, then the trained policy's.
"""

from jaxrlhf.configs import ppo_tiny


def get_config(arg=None):
    """ppo_tiny's job (`:smoke`: the same in seconds) from the SFT stage's model, without a warm
    start, against the learned reward."""
    config = ppo_tiny.get_config(arg)
    config.warm_start.sft_steps = 0
    config.reward.kind = "model"
    config.reward.normalize = True
    config.reward.clip = 3.0
    config.ppo.kl_adaptive = True
    config.ppo.kl_coef = 0.5  # β at step 0
    config.ppo.kl_target = 2.0  # nats per response
    config.ppo.kl_horizon = 640.0  # β moves at most 0.2 · 32 / 640 = 1% a step
    return config
