"""Per-token decode time of pipelined generation: ReaL's across-token schedule against one
pipeline pass per token, measured, beside the planner's figure for the same call.

`python benchmarks/pipelined_decode.py [--strategy=0-3:d2p2] [--micro=2] [--batch=8]
[--prompt=16] [--tokens=8,40] [--repeats=3] [--cluster=meshes/cpu_8.py]`

A decode token's time is the slope of generation time over generated tokens: generation is
forced to max length (`force_max_length`) at two lengths and the difference in (median) time
is divided by the difference in tokens, so the prefill and the call overhead cancel. The model
is the tiny one with 4 layers in fp32. On CPU the virtual devices share the host's cores, so
stages do not run at the same time: there a slot costs every stage's work, and the schedules
differ by their slot counts (max(M, S) against M + S - 1 per token).
"""

from __future__ import annotations

import argparse
import functools
import os
import pathlib
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from jaxrlhf.engine.generate import GenerateConfig, GenerateOutput, generate  # noqa: E402
from jaxrlhf.mfc import Call  # noqa: E402
from jaxrlhf.models.sizes import abstract_params, get_size  # noqa: E402
from jaxrlhf.models.transformer import Transformer  # noqa: E402
from jaxrlhf.parallel.layout import init_params, make_layout  # noqa: E402
from jaxrlhf.parallel.pipeline import DecodeSchedule, Pipeline  # noqa: E402
from jaxrlhf.parallel.strategy import parse_strategy  # noqa: E402
from jaxrlhf.plan import cost  # noqa: E402
from jaxrlhf.plan.choice import CallChoice  # noqa: E402
from jaxrlhf.plan.cluster import load_cluster  # noqa: E402
from jaxrlhf.plan.experiment import Workload  # noqa: E402
from jaxrlhf.plan.profile import profile_of  # noqa: E402

MODEL = get_size("tiny", num_layers=4, dtype=jnp.float32)


def _generator(layout, schedule: DecodeSchedule, micro: int, new_tokens: int):
    """The generate call on `layout` with the given decode schedule (as `Generator` jits it)."""
    cfg = GenerateConfig(max_new_tokens=new_tokens, eos_token_id=0, pad_token_id=0,
                         temperature=0.0, force_max_length=True)
    model = Transformer(MODEL, Pipeline(layout.pipeline, micro, decode=schedule))
    row, rows = layout.batch_sharding(1), layout.batch_sharding(2)
    return jax.jit(
        functools.partial(generate, model, cfg),
        in_shardings=(layout.param_shardings(abstract_params(MODEL)), rows, rows,
                      layout.replicated()),
        out_shardings=GenerateOutput(rows, rows, rows, rows, rows, row))


def measured_seconds(layout, params, schedule, micro, batch, prompt, new_tokens, repeats):
    """Median (wall, process CPU) seconds of one forced-length generation of `new_tokens`
    tokens, compiled first. On a shared machine the CPU time (every XLA thread of this
    process) is the steadier measure of the work; the wall time counts the others' load."""
    fn = _generator(layout, schedule, micro, new_tokens)
    tokens_bp = np.ones((batch, prompt), np.int32)
    mask_bp = np.ones((batch, prompt), bool)
    rng = jax.random.key(0)
    with layout.activation_context():
        compiled = fn.lower(params, tokens_bp, mask_bp, rng).compile()
    jax.block_until_ready(compiled(params, tokens_bp, mask_bp, rng))  # warm
    times = []
    for _ in range(repeats):
        start = time.perf_counter(), time.process_time()
        jax.block_until_ready(compiled(params, tokens_bp, mask_bp, rng))
        times.append((time.perf_counter() - start[0], time.process_time() - start[1]))
    return tuple(float(x) for x in np.median(np.asarray(times), axis=0))


def planned_token_seconds(strategy, schedule, micro, batch, prompt, new_tokens, cluster):
    """The planner's seconds per decode token of the same generate call."""
    choice = CallChoice(strategy.devices, data=strategy.data, fsdp=strategy.fsdp,
                        tensor=strategy.tensor, pipeline=strategy.pipeline, micro_batches=micro)
    work = Workload(batch_size=batch, prompt_len=prompt, new_tokens=new_tokens)
    p = profile_of(MODEL)
    rows = work.rows_per_device(Call.GENERATE, choice.dp_size, micro)
    match schedule:
        case DecodeSchedule.PER_TOKEN:
            slots = cost.schedule_slots(choice)
        case DecodeSchedule.ACROSS_TOKENS:
            slots = max(micro, choice.pipeline)
    token = cost.pipelined(cost.decode_step_cost(p, work, choice, cluster),
                           cost.stage_send(p, cluster, choice, rows), choice, slots)
    return token.seconds(cluster)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--strategy", default="0-3:d2p2")
    parser.add_argument("--micro", type=int, default=2)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=16)
    parser.add_argument("--tokens", default="8,40", help="two generation lengths")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--cluster", default="meshes/cpu_8.py")
    args = parser.parse_args()
    short, long = (int(n) for n in args.tokens.split(","))
    strategy = parse_strategy(args.strategy)
    layout = make_layout(args.strategy, model=MODEL, micro_batches=args.micro)
    params = init_params(MODEL, layout, jax.random.key(0))
    cluster = load_cluster(str(ROOT / args.cluster))
    print(f"{args.strategy}@{args.micro}, batch {args.batch}, prompt {args.prompt}, "
          f"tokens {short}->{long}, {jax.devices()[0].platform}; planner: {cluster.name}")
    print(f"{'schedule':<14} {'wall ms/token':>14} {'CPU ms/token':>13} "
          f"{'planned ms/token':>17} {'planned/wall - 1':>17}")
    for schedule in DecodeSchedule:
        (wall0, cpu0), (wall1, cpu1) = (
            measured_seconds(layout, params, schedule, args.micro, args.batch, args.prompt, n,
                             args.repeats) for n in (short, long))
        wall, cpu = (wall1 - wall0) / (long - short), (cpu1 - cpu0) / (long - short)
        planned = planned_token_seconds(strategy, schedule, args.micro, args.batch, args.prompt,
                                        long, cluster)
        print(f"{schedule.value:<14} {wall * 1e3:>14.3f} {cpu * 1e3:>13.3f} "
              f"{planned * 1e3:>17.3f} {planned / wall - 1:>+17.0%}")


if __name__ == "__main__":
    main()
