"""The RLHF pipeline on a tiny model and the built-in task, stage 1 of 3: supervised fine-tuning.

The classic pipeline (Ouyang et al. 2022) in three configs run in order, each stage starting
from the previous one's exported Hugging Face directory:

  1. SFT (this config): a fresh tiny model learns from demonstrations of which 60% copy the
     digits instead of reversing them (as ppo_tiny's warm start), so it answers mostly wrong
     when greedy and leaves RL room to improve it.
  2. reward model (configs/rlhf_rw_tiny.py): the SFT model's trunk with a new score head, trained
     on preference pairs (reversed answer chosen over copied).
  3. PPO (configs/rlhf_ppo_tiny.py): the SFT model trained against the learned reward, kept
     honest by KL control toward a target and normalised, clipped rewards.

```
python -m jaxrlhf.train --config=configs/rlhf_sft_tiny.py --workdir=/tmp/rlhf/sft
python -m jaxrlhf.export --workdir=/tmp/rlhf/sft --out=/tmp/rlhf/sft_hf
python -m jaxrlhf.train --config=configs/rlhf_rw_tiny.py --workdir=/tmp/rlhf/rw \
    --config.models.actor.path=/tmp/rlhf/sft_hf
python -m jaxrlhf.export --workdir=/tmp/rlhf/rw --out=/tmp/rlhf/rm_hf --role=reward
python -m jaxrlhf.train --config=configs/rlhf_ppo_tiny.py --workdir=/tmp/rlhf/ppo \
    --config.models.actor.path=/tmp/rlhf/sft_hf --config.models.reward.path=/tmp/rlhf/rm_hf
```
"""

from jaxrlhf.configs import sft_tiny


def get_config(arg=None):
    """sft_tiny's job (`:smoke`: the same in seconds) on noisy demonstrations."""
    config = sft_tiny.get_config(arg)
    config.data.task.sft_noise = 0.6  # 60% of the demonstrations copy instead of reversing
    return config
