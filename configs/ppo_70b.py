"""ReaL's base setting: LLaMA-3 70B actor/ref with 7B critic/reward, on 16 × 8 A100-80GB.

Global batch 512 prompts, context 2048 (max prompt 1024 + 1024 new tokens), 8 PPO mini-batches
(ReaL Table 6 / Appendix). Placement is searched by the planner for the cluster
(`python -m jaxrlhf.plan --config=configs/ppo_70b.py --cluster=meshes/a100_16x8.py` shows it).
Every model starts from its own Hugging Face directory and all share one tokenizer; set them:

  --config.models.actor.path=DIR --config.models.ref.path=DIR (usually the actor's)
  --config.models.critic.path=DIR --config.models.reward.path=DIR --config.tokenizer=DIR

(the check names the first one missing, before anything compiles). The critic and reward
directories hold `*ForSequenceClassification` models (a causal LM's trunk gets a new zero
score head).

Variants: `:h800` plans for 16 × 8 H800; `:smoke` runs the same graph, placement kind and code
path (every role from its own directory, the reward model's inference call, the planner's
searched plan) with tiny models on the 8 CPU devices of `meshes/cpu_8.py`, in seconds: give it
tiny directories (the actor bigger than the critic and reward model, as here) and
`--config.tokenizer=byte`-sized vocabularies (tests/test_big_configs.py builds them).
"""

from jaxrlhf.schema import base_config

_CLUSTERS = {None: "meshes/a100_16x8.py", "h800": "meshes/h800_16x8.py",
             "smoke": "meshes/a100_16x8.py"}  # smoke() moves it to the CPU
SIZES = {"actor": "llama3-70b", "ref": "llama3-70b", "critic": "llama3-7b", "reward": "llama3-7b"}


def big_model(config, role, size):
    m = config.models[role]
    m.size, m.dtype, m.param_dtype, m.remat = size, "bfloat16", "bfloat16", "full"


def smoke(config):
    """The same job at CPU scale: tiny shapes and batch, fp32, the CPU cluster file, 2 steps."""
    config.steps = 2
    config.tokenizer = "byte"
    for role in SIZES:
        config.models[role].update(size="tiny", dtype="float32", param_dtype="float32")
    config.rollout.update(batch_size=16, max_prompt_len=16, max_new_tokens=8)
    config.ppo.mini_batches = 2
    config.checkpoint.every = 0
    config.placement.cluster = "meshes/cpu_8.py"
    config.data.task.update(num_train=64, num_eval=16, num_sft=16)


def get_config(arg=None):
    if arg not in _CLUSTERS:
        raise ValueError(f"unknown variant {arg!r}; known: {sorted(k for k in _CLUSTERS if k)}")
    config = base_config()
    config.algorithm = "ppo"
    config.steps = 100
    for role, size in SIZES.items():
        big_model(config, role, size)
    config.reward.kind = "model"
    config.require_model_paths = True  # models.<role>.path for every role
    config.tokenizer = ""  # the HF directory of the models' tokenizer (required)
    config.rollout.update(batch_size=512, max_prompt_len=1024, max_new_tokens=1024)
    config.ppo.mini_batches = 8
    for role in ("actor", "critic"):
        config.optimizer[role].update(lr=1e-6 if role == "actor" else 5e-6, warmup_steps=10,
                                      min_lr_ratio=0.1, weight_decay=0.0, fp32_master=True)
    config.placement.update(kind="auto", cluster=_CLUSTERS[arg], offload_frozen=True)
    if arg == "smoke":
        smoke(config)
    return config
