"""GRPO on Qwen3-30B-A3B (a mixture of experts) for math answers, planned for a TPU v5p-64
slice (`meshes/tpu_v5p_64.py`, 32 chips) or, as the `h100` variant, one host of 8 H100s
(`meshes/h100_8.py`).

The actor and its frozen reference are Qwen3-30B-A3B (48 layers, hidden 2048, 32 query and 4
key/value heads of 128, vocabulary 151,936; every layer a block of 128 experts of width 768, 8
a token: 30.5B parameters, 3.35B of them used by a token) in bf16 with full rematerialisation;
64 prompts × 8 responses per step (512 sequences), prompts up to 1,024 tokens and responses up
to 2,048; the reward is math-verify's equivalence of the boxed answer with the row's `answer`.
The router's load-balancing loss is the model's (0.001). Placement is searched by the planner.

On 8 H100s the fp32 master and AdamW moments (12 bytes a parameter, 42.7 GiB a GPU over f8)
with the bf16 parameters, the fp32 gradients and their micro-batch sum (28.4 GiB) leave no room
in 80 GB (78.2 GiB a GPU by the planner's model), so the `h100` variant keeps the moments in
bf16 and no master (14.2 GiB): the plan fits, but an update below half a bf16 ulp of its weight
(about 1e-4 relative) is lost, so at this learning rate most updates would vanish; it is the
variant to plan with, and a run on 8 H100s wants a learning rate or an optimizer that survives
bf16 (LoRA adapters or more GPUs). Give the model, its tokenizer and the data:

  --config.models.actor.path=DIR --config.models.ref.path=DIR --config.tokenizer=DIR
  --config.data.train_path=FILE.jsonl (rows with `prompt` and `answer`)

`:smoke` is the same graph at CPU scale with tiny mixture-of-experts models (`tiny-moe`) on the
8 CPU devices of `meshes/cpu_8.py`, 2 steps; it too starts from the models' directories (a tiny
Qwen3-MoE's, whose config.json sets the shapes, as tests/test_config_runs.py makes one), with
the byte tokenizer. Whether the job fits is answered on any host, without weights or
accelerators:

  python -m jaxrlhf.plan --config=configs/grpo_qwen3_30b_a3b.py --cluster=meshes/tpu_v5p_64.py \\
      --compile
  python -m jaxrlhf.plan --config=configs/grpo_qwen3_30b_a3b.py:h100 --cluster=meshes/h100_8.py
"""

from jaxrlhf.schema import base_config
from jaxrlhf.configs.ppo_70b import big_model, smoke as smoke_70b

ROLES = ("actor", "ref")
_CLUSTERS = {None: "meshes/tpu_v5p_64.py", "h100": "meshes/h100_8.py",
             "smoke": "meshes/cpu_8.py"}


def smoke(config):
    """`ppo_70b.smoke`'s CPU scale with the tiny mixture of experts."""
    smoke_70b(config)
    for role in ROLES:
        config.models[role].size = "tiny-moe"
    config.rollout.group_size = 4


def get_config(arg=None):
    if arg not in _CLUSTERS:
        raise ValueError(f"unknown variant {arg!r}; known: {sorted(k for k in _CLUSTERS if k)}")
    config = base_config()
    config.algorithm = "grpo"
    config.steps = 200
    for role in ROLES:
        big_model(config, role, "qwen3-30b-a3b")
    config.require_model_paths = True  # models.<role>.path for every role
    config.tokenizer = ""  # the HF directory of the model's tokenizer (required)
    config.reward.function = "math"
    config.rollout.update(batch_size=64, group_size=8, max_prompt_len=1024,
                          max_new_tokens=2048)
    config.optimizer.actor.update(lr=1e-6, warmup_steps=10, min_lr_ratio=0.1, weight_decay=0.0,
                                  fp32_master=True)
    config.placement.update(kind="auto", cluster=_CLUSTERS[arg], offload_frozen=True)
    if arg == "h100":  # fp32 master and moments do not fit 8 x 80 GB (module docstring)
        config.optimizer.actor.fp32_master = False
    if arg == "smoke":
        smoke(config)
    return config
