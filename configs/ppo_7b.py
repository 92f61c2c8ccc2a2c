"""PPO with LLaMA-3 7B actor, critic, ref and reward on 2 × 8 A100-80GB (ReaL's 16-GPU case).

Placement is searched by the planner for `meshes/a100_2x8.py`; the job must have its 16
devices (`sbatch --nodes=2 launch/slurm.sbatch --config=configs/ppo_7b.py ...`). Every model
starts from its own Hugging Face directory and all share one tokenizer; set them:

  --config.models.actor.path=DIR --config.models.ref.path=DIR (usually the actor's)
  --config.models.critic.path=DIR --config.models.reward.path=DIR --config.tokenizer=DIR

(the check names the first one missing, before anything compiles).

`:smoke` runs the same graph, placement kind and code path with tiny models (four directories
of one tiny size) on the 8 CPU devices of `meshes/cpu_8.py`, in seconds.
"""

from jaxrlhf.schema import base_config
from jaxrlhf.configs.ppo_70b import big_model, smoke

ROLES = ("actor", "ref", "critic", "reward")


def get_config(arg=None):
    if arg not in (None, "smoke"):
        raise ValueError(f"unknown variant {arg!r}; known: smoke")
    config = base_config()
    config.algorithm = "ppo"
    config.steps = 100
    for role in ROLES:
        big_model(config, role, "llama3-7b")
    config.reward.kind = "model"
    config.require_model_paths = True  # models.<role>.path for every role
    config.tokenizer = ""  # the HF directory of the models' tokenizer (required)
    config.rollout.update(batch_size=512, max_prompt_len=1024, max_new_tokens=1024)
    config.ppo.mini_batches = 8
    for role in ("actor", "critic"):
        config.optimizer[role].update(lr=1e-6 if role == "actor" else 5e-6, warmup_steps=10,
                                      min_lr_ratio=0.1, fp32_master=True)
    config.placement.update(kind="auto", cluster="meshes/a100_2x8.py", offload_frozen=True)
    if arg == "smoke":
        smoke(config)
    return config
