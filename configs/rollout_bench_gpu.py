"""W-gpu-rollout: the rollout rows of `python -m jaxrlhf.bench --rollout=...` on one GPU (issue 30).

Generation alone of a Llama-3.2-1B-shaped decoder (16 layers, hidden 2048, 32 query / 8 KV
heads of dim 64, tied embeddings), random weights, bf16 compute with the weights stored in bf16
(the copy a rollout engine keeps: half the bytes each decode step must read); a reference model
of the same size, as GRPO has one. 64 rows = 16 prompts x 4 responses (GRPO groups of 4, so
prefix sharing has a group to share), prompts of exactly 128 tokens, temperature 0.9, every
row's length forced (the `--rollout` flag picks the rows' lengths: 64, 512, 2048 and the
long-tailed row); `max_new_tokens` = 2048 is the longest row's. One device, everything
colocated. The weights are bf16 for the measurement only: nothing here is meant to train.

Run by `benchmarks/gpu_suite.sh`:
`python -m jaxrlhf.bench --config=configs/rollout_bench_gpu.py --rollout=64,512,tail,2048`.

Variants (`configs/rollout_bench_gpu.py:ARG`, comma-separated):
  * `cpu`: the same rows on the CPU at W-cpu's model shape (`size=bench`: hidden 256, 4
    layers, 4 query / 2 KV heads of dim 64), fp32, prompts of 32 tokens, one device: what the
    issue's CPU figures use; the suite's dry run (`gpu_suite.sh --dry-run`) runs it;
  * `smoke`: 2 steps of 4 prompts x 2 responses, 8 + 8 tokens (with `cpu`: seconds on a CPU).
"""

from jaxrlhf.schema import base_config


def get_config(arg=None):
    config = base_config()
    config.algorithm = "grpo"
    config.steps = 4
    config.cpu_devices = 1  # the CPU backend only; on a GPU the one device it has
    for role in ("actor", "ref"):
        config.models[role].size = "llama-3.2-1b"
        config.models[role].dtype = "bfloat16"
        config.models[role].param_dtype = "bfloat16"
    config.rollout.batch_size = 16
    config.rollout.group_size = 4
    config.rollout.max_prompt_len = 128
    config.rollout.max_new_tokens = 2048
    config.rollout.temperature = 0.9
    config.rollout.force_max_length = True
    config.grpo.kl_coef = 0.04
    config.ppo.mini_batches = 1
    config.ppo.epochs = 1
    config.reward.function = "zero"
    config.placement.kind = "colocate"
    for part in filter(None, (arg or "").split(",")):
        if part == "cpu":
            for role in ("actor", "ref"):
                config.models[role].size = "bench"
                config.models[role].dtype = "float32"
                config.models[role].param_dtype = "float32"
            config.rollout.max_prompt_len = 32
        elif part == "smoke":
            config.steps = 2
            config.rollout.update(batch_size=4, group_size=2, max_prompt_len=8,
                                  max_new_tokens=8)
        else:
            raise ValueError(f"configs/rollout_bench_gpu.py: unknown variant {part!r} "
                             "(cpu, smoke)")
    return config
