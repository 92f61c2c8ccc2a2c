"""W-cpu, the engine-speed workload of `python -m jaxrlhf.bench` (issue 10).

GRPO on a Llama-style decoder (hidden 256, 4 layers, 4 query / 2 KV heads of dim 64, SwiGLU MLP
1024, untied, 272-token vocabulary), fp32, random init; 16 prompts x 4 responses, prompts of
exactly 32 tokens, exactly 64 new tokens (forced), temperature 0.9, a reference model with KL,
one optimizer update per step: 64 x 96 = 6,144 tokens and about 258 GFLOP per step.

Variants (`configs/grpo_bench_cpu.py:ARG`, comma-separated):
  * `prompts64`: 64 prompts x 4 responses (batch scaling row);
  * `new512`: 512 new tokens (length scaling row);
  * `dN`: colocate on the first N CPU devices (e.g. `d1`, `d2`); default all 8;
  * `smoke`: the same graph, model and code path for 2 steps with 4 prompts x 2 responses and
    8 + 8 tokens, in seconds (the default test suite runs it).
"""

from jaxrlhf.schema import base_config


def get_config(arg=None):
    config = base_config()
    config.algorithm = "grpo"
    config.steps = 4
    for role in ("actor", "ref"):
        config.models[role].size = "bench"
        config.models[role].dtype = "float32"
        config.models[role].param_dtype = "float32"
    config.rollout.batch_size = 16
    config.rollout.group_size = 4
    config.rollout.max_prompt_len = 32
    config.rollout.max_new_tokens = 64
    config.rollout.temperature = 0.9
    config.rollout.force_max_length = True
    config.grpo.kl_coef = 0.04
    config.ppo.mini_batches = 1
    config.ppo.epochs = 1
    config.reward.function = "zero"
    for part in filter(None, (arg or "").split(",")):
        if part == "prompts64":
            config.rollout.batch_size = 64
        elif part == "new512":
            config.rollout.max_new_tokens = 512
        elif part == "smoke":
            config.steps = 2
            config.rollout.update(batch_size=4, group_size=2, max_prompt_len=8,
                                  max_new_tokens=8)
        elif part.startswith("d") and part[1:].isdigit():
            config.cpu_devices = int(part[1:])
        else:
            raise ValueError(f"configs/grpo_bench_cpu.py: unknown variant {part!r} "
                             "(prompts64, new512, dN, smoke)")
    return config
