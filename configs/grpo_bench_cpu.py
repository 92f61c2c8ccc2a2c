"""W-cpu, the engine-speed workload of `python -m jaxrlhf.bench` (issue 10).

GRPO on a Llama-style decoder (hidden 256, 4 layers, 4 query / 2 KV heads of dim 64, SwiGLU MLP
1024, untied, 272-token vocabulary), fp32, random init; 16 prompts x 4 responses, prompts of
exactly 32 tokens, exactly 64 new tokens (forced), temperature 0.9, a reference model with KL,
one optimizer update per step: 64 x 96 = 6,144 tokens and about 258 GFLOP per step.

Variants (`configs/grpo_bench_cpu.py:ARG`, comma-separated):
  * `prompts64`: 64 prompts x 4 responses (batch scaling row);
  * `new512`: 512 new tokens (length scaling row);
  * `dN`: colocate on the first N CPU devices (e.g. `d1`, `d2`), every MFC data parallel;
  * `scan`: the actor's layer stack scanned in its train step too (the default before);
  * `smoke`: the same graph, model and code path for 2 steps with 4 prompts x 2 responses and
    8 + 8 tokens, in seconds (the default test suite runs it).

Default placement: every MFC on all 8 CPU devices, data parallel (d8), colocated (the same
as `:d8`). Generation was d4t2 while it decoded a static batch (a decode step reads the
weights: at d4t2 each virtual device reads half of them for 16 rows). The rollout engine
decodes on each device's own rows without collectives only where the layout has no tensor or
fsdp split (`engine.rollout.Rollout.per_device`), and there a device's decode-step attention
runs in the C++ kernel (`kernels/cpu_decode_attention.py`): 512 new tokens for 64 rows took
7.4 s at d8 against 15.1-16.3 s at d4t2, 64 tokens 0.91 against 0.91-0.96 s
(`jaxrlhf.bench --rollout=64,512 --steps=3`, one process each); the whole step was unchanged
(2.51 and 2.59 s against 2.80 and 2.60, two alternated pairs of `--steps=3` runs).

The actor's layer stack is unrolled (`scan_layers=False`): its d8 train step then skips the
scan's zero-filled [L, ...] stacks of saved activations and their per-layer writes and reads
(~18% of its op time in a profile) and needs less memory (164 vs 199 MiB peak). Train step
7.68 vs 8.78 s wall, 5.10 vs 5.85 s CPU (engine_calls --devices=8 --calls=train
--variants=scan,unroll, 4 interleaved repeats, load 8-11); whole step 14.8 vs 19.1 s, CPU 9.4
vs 10.6 s (`jaxrlhf.bench` default vs `:scan`, load 13). The generate call decodes with a
stack of its own on CPU either way (layer by layer, `engine.decode_layers`).
"""

from jaxrlhf.schema import base_config

# The default placement (see above): all three MFCs on all 8 devices, data parallel.
ALL_D8 = "actor_gen=0-7:d8,ref_inf=0-7:d8,actor_train=0-7:d8"


def get_config(arg=None):
    config = base_config()
    config.algorithm = "grpo"
    config.steps = 4
    for role in ("actor", "ref"):
        config.models[role].size = "bench"
        config.models[role].dtype = "float32"
        config.models[role].param_dtype = "float32"
    # The actor trains with its layers unrolled (see above); generation decodes layer by layer
    # on CPU whatever this says (`engine.generate.decode_model`). ref_inf stays scanned (unrolled
    # gained nothing there).
    config.models["actor"].scan_layers = False
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
    config.placement.kind = "manual"
    config.placement.allocation = ALL_D8
    for part in filter(None, (arg or "").split(",")):
        if part == "prompts64":
            config.rollout.batch_size = 64
        elif part == "new512":
            config.rollout.max_new_tokens = 512
        elif part == "smoke":
            config.steps = 2
            config.rollout.update(batch_size=4, group_size=2, max_prompt_len=8,
                                  max_new_tokens=8)
        elif part == "scan":
            config.models["actor"].scan_layers = True
        elif part.startswith("d") and part[1:].isdigit():
            config.cpu_devices = int(part[1:])
            config.placement.kind, config.placement.allocation = "colocate", ""
        else:
            raise ValueError(f"configs/grpo_bench_cpu.py: unknown variant {part!r} "
                             "(prompts64, new512, dN, scan, smoke)")
    return config
