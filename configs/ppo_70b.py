"""ReaL's base setting: LLaMA-3 70B actor/ref with 7B critic/reward, on 16 × 8 A100-80GB.

Global batch 512 prompts, context 2048 (max prompt 1024 + 1024 new tokens), 8 PPO mini-batches
(ReaL Table 6 / Appendix). Placement is searched by the planner for the cluster
(`python -m jaxrlhf.plan --config=configs/ppo_70b.py --cluster=meshes/a100_16x8.py` shows it).
Variants: `configs/ppo_70b.py:h800` plans for 16 × 8 H800.
"""

from jaxrlhf.schema import base_config

_CLUSTERS = {None: "meshes/a100_16x8.py", "h800": "meshes/h800_16x8.py"}


def big_model(config, role, size):
    m = config.models[role]
    m.size, m.dtype, m.param_dtype, m.remat = size, "bfloat16", "bfloat16", "full"


def get_config(arg=None):
    if arg not in _CLUSTERS:
        raise ValueError(f"unknown variant {arg!r}; known: {sorted(k for k in _CLUSTERS if k)}")
    config = base_config()
    config.algorithm = "ppo"
    config.steps = 100
    for role, size in (("actor", "llama3-70b"), ("ref", "llama3-70b"),
                       ("critic", "llama3-7b"), ("reward", "llama3-7b")):
        big_model(config, role, size)
    config.reward.kind = "model"
    config.tokenizer = ""  # set to the HF directory of the actor's tokenizer
    config.rollout.update(batch_size=512, max_prompt_len=1024, max_new_tokens=1024)
    config.ppo.mini_batches = 8
    for role in ("actor", "critic"):
        config.optimizer[role].update(lr=1e-6 if role == "actor" else 5e-6, warmup_steps=10,
                                      min_lr_ratio=0.1, weight_decay=0.0, fp32_master=True)
    config.placement.update(kind="auto", cluster=_CLUSTERS[arg], offload_frozen=True)
    return config
