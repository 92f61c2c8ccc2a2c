"""W-cpu's ref_inf alone, with row-chunk budgets alternated in one process, against the floor.

`python benchmarks/inference_chunks.py [--devices=1] [--rounds=6] [--chunk_tokens=0,2048]`

The reference model's inference call as `jaxrlhf.bench` runs it on `configs/grpo_bench_cpu.py`
(the "bench" size scanned, fp32, 64 rows of 32 + 64 tokens, compiled for that length), built
once per budget of `engine.inference.row_chunks` (0: the whole batch in one pass), then timed
in rounds (`jaxrlhf.perf.rounds`: each round the matmul probe, then every budget once), so
load from other processes hits every budget alike. Prints each budget's fraction of the floor
on both clocks (median, lowest-highest round) and its largest difference from the first
budget's log-probs. Not a test: a tool to choose the budget.
"""

from __future__ import annotations

import argparse


def _args():
    p = argparse.ArgumentParser()
    p.add_argument("--devices", type=int, default=1)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--chunk_tokens", default="0,2048", help="budgets to compare (0: one pass)")
    p.add_argument("--rows", type=int, default=64)
    p.add_argument("--context", type=int, default=96)
    return p.parse_args()


def main():
    args = _args()
    from jaxrlhf.backend import use_cpu_devices
    use_cpu_devices(args.devices)
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxrlhf.engine import inference
    from jaxrlhf.models.sizes import get_size
    from jaxrlhf.parallel.layout import init_params, make_layout
    from jaxrlhf.perf import floor, rounds
    from jaxrlhf.perf.flops import call_flops

    cfg = get_size("bench", dtype=jnp.float32, scan_layers=True)
    layout = make_layout(f"0-{args.devices - 1}:d{args.devices}", model=cfg)
    params = init_params(cfg, layout, jax.random.key(0))
    tokens_bt = np.random.default_rng(0).integers(1, 250, (args.rows, args.context))
    batch = inference.InferenceBatch.padded(tokens_bt, np.ones_like(tokens_bt, bool))
    flops = call_flops(cfg, "inference", args.rows, args.context)
    calls, first = {}, None
    for budget in map(int, args.chunk_tokens.split(",")):
        inference.CPU_CHUNK_TOKENS = budget  # read when the call is built (`chunk_tokens`)
        fn = inference.make_inference_fn(
            cfg, inference.InferenceConfig(inference.InferenceKind.LOGPROBS, 0.9), layout,
            length_buckets=(args.context,))
        logprobs_bt = np.asarray(fn(params, batch).logprobs_bt)  # compiles
        first = logprobs_bt if first is None else first
        chunks = inference.row_chunks(args.rows // args.devices, args.context, budget)
        name = f"{budget} ({chunks} chunk{'s' if chunks > 1 else ''})"
        print(f"{name}: max |logp - first's| {np.max(np.abs(logprobs_bt - first)):.1e}")
        calls[name] = (lambda fn=fn: fn(params, batch), flops)
    probe, probe_flops = floor.machine_probe(jnp.float32)
    measured = rounds.measure(probe, probe_flops, calls, args.rounds)
    print(f"{'budget':<16}{'wall s':>8}  {'of floor (wall)':<20}{'cpu s':>7}  of floor (cpu)")
    for row in measured.rows:
        print(f"{row.name:<16}{row.seconds(rounds.Clock.WALL).median:>8.3f}  "
              f"{measured.fraction(row, rounds.Clock.WALL).percent():<20}"
              f"{row.seconds(rounds.Clock.CPU).median:>7.3f}  "
              f"{measured.fraction(row, rounds.Clock.CPU).percent()}")


if __name__ == "__main__":
    main()
