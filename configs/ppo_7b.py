"""PPO with LLaMA-3 7B actor, critic, ref and reward on 2 × 8 A100-80GB (ReaL's 16-GPU case).

`configs/ppo_7b.py:smoke` keeps the shapes of the real run but only 2 steps and 8 prompts,
to check a cluster end to end before booking it for long.
"""

from jaxrlhf.schema import base_config
from configs.ppo_70b import big_model


def get_config(arg=None):
    if arg not in (None, "smoke"):
        raise ValueError(f"unknown variant {arg!r}; known: smoke")
    config = base_config()
    config.algorithm = "ppo"
    config.steps = 2 if arg == "smoke" else 100
    for role in ("actor", "ref", "critic", "reward"):
        big_model(config, role, "llama3-7b")
    config.reward.kind = "model"
    config.tokenizer = ""  # set to the HF directory of the actor's tokenizer
    config.rollout.update(batch_size=8 if arg == "smoke" else 512, max_prompt_len=1024,
                          max_new_tokens=1024)
    config.ppo.mini_batches = 1 if arg == "smoke" else 8
    for role in ("actor", "critic"):
        config.optimizer[role].update(lr=1e-6 if role == "actor" else 5e-6, warmup_steps=10,
                                      min_lr_ratio=0.1, fp32_master=True)
    config.placement.update(kind="auto", cluster="meshes/a100_16x8.py")
    return config
