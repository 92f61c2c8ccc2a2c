"""GRPO on Qwen3-8B for math answers, planned for a TPU v6e-256 pod (`meshes/tpu_v6e_256.py`).

The actor and its frozen reference are Qwen3-8B (36 layers, hidden 4096, 32 query and 8 key/value
heads of 128, vocabulary 151,936) in bf16 with full rematerialisation; 128 prompts × 8 responses
per step (1,024 sequences), prompts up to 1,024 tokens and responses up to 2,048; the reward
is math-verify's equivalence of the boxed answer with the row's `answer` (`reward.function=
math`). Placement is searched by the planner for the pod. Give the model, its tokenizer and the
data:

  --config.models.actor.path=DIR --config.models.ref.path=DIR --config.tokenizer=DIR
  --config.data.train_path=FILE.jsonl (rows with `prompt` and `answer`)

(the check names the first one missing, before anything compiles). `:smoke` runs the same graph,
placement kind and code path with tiny models (two directories of one tiny size) on the 8 CPU
devices of `meshes/cpu_8.py`, in seconds. Whether the full job fits the pod's chips is answered
on any host, without weights or a TPU:

  python -m jaxrlhf.plan --config=configs/grpo_qwen3_8b.py --cluster=meshes/tpu_v6e_256.py \\
      --compile
"""

from jaxrlhf.schema import base_config
from jaxrlhf.configs.ppo_70b import big_model, smoke

ROLES = ("actor", "ref")


def get_config(arg=None):
    if arg not in (None, "smoke"):
        raise ValueError(f"unknown variant {arg!r}; known: smoke")
    config = base_config()
    config.algorithm = "grpo"
    config.steps = 200
    for role in ROLES:
        big_model(config, role, "qwen3-8b")
    config.require_model_paths = True  # models.<role>.path for every role
    config.tokenizer = ""  # the HF directory of the model's tokenizer (required)
    config.reward.function = "math"
    config.rollout.update(batch_size=128, group_size=8, max_prompt_len=1024,
                          max_new_tokens=2048)
    config.optimizer.actor.update(lr=1e-6, warmup_steps=10, min_lr_ratio=0.1, weight_decay=0.0,
                                  fp32_master=True)
    config.placement.update(kind="auto", cluster="meshes/tpu_v6e_256.py", offload_frozen=True)
    if arg == "smoke":
        smoke(config)
        config.rollout.group_size = 4
    return config
