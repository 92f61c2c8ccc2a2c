"""Times the three engine calls of W-cpu in isolation, A/B interleaved, against the matmul floor.

`python benchmarks/engine_calls.py [--devices=1] [--repeats=5] [--calls=generate,inference,train]
[--variants=scan,unroll] [--layouts=0-7:d8,0-7:d4t2]`

Each call kind is compiled once per variant (scanned / unrolled layer stack), then the variants
(and per layout, when `--layouts` names several strategies on the `--devices` CPU devices)
are timed round-robin `repeats` times (so that load from other processes on the shared cores
hits every variant alike) and the medians printed with the fraction of the floor
(`jaxrlhf.perf`). Not a test: a tool to find where engine time goes.
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import time


def _args():
    p = argparse.ArgumentParser()
    p.add_argument("--devices", type=int, default=1)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--calls", default="generate,inference,train")
    p.add_argument("--variants", default="scan,unroll")
    p.add_argument("--layouts", default="", help="strategies to compare, e.g. 0-7:d8,0-7:d4t2 "
                   "(default: all --devices data parallel)")
    p.add_argument("--rows", type=int, default=64)
    p.add_argument("--prompt", type=int, default=32)
    p.add_argument("--new", type=int, default=64)
    return p.parse_args()


def main():
    args = _args()
    from jaxrlhf.backend import use_cpu_devices
    use_cpu_devices(args.devices)
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxrlhf.algorithms import losses  # noqa: F401
    from jaxrlhf.engine.generate import GenerateConfig, make_generate_fn
    from jaxrlhf.engine.inference import (InferenceBatch, InferenceConfig, InferenceKind,
                                          make_inference_fn)
    from jaxrlhf.engine.optimizer import OptimizerConfig
    from jaxrlhf.engine.train_step import init_train_state, make_train_step
    from jaxrlhf.models.sizes import get_size
    from jaxrlhf.parallel.layout import init_params, make_layout
    from jaxrlhf.perf import floor
    from jaxrlhf.perf.flops import call_flops

    peak = floor.machine_peak(jnp.float32)
    rows, context = args.rows, args.prompt + args.new
    rng = np.random.default_rng(0)
    tokens_bp = rng.integers(1, 250, (rows, args.prompt)).astype(np.int32)
    mask_bp = np.ones_like(tokens_bp, bool)
    seq_bs = rng.integers(1, 250, (rows, context)).astype(np.int32)
    batch = InferenceBatch.padded(seq_bs, np.ones_like(seq_bs))
    calls = {}
    specs = args.layouts.split(",") if args.layouts else [f"0-{args.devices - 1}:d{args.devices}"]
    for variant, spec in itertools.product(args.variants.split(","), specs):
        cfg = get_size("bench", dtype=jnp.float32, scan_layers=variant == "scan")
        layout = make_layout(spec, model=cfg)
        if len(specs) > 1:
            variant = f"{variant}/{spec}"
        params = init_params(cfg, layout, jax.random.key(0))
        if "generate" in args.calls:
            gen = make_generate_fn(cfg, GenerateConfig(args.new, 0, 0, 0.9,
                                                       force_max_length=True), layout)
            calls[f"generate/{variant}"] = (
                lambda gen=gen, params=params: gen(params, tokens_bp, mask_bp,
                                                   jax.random.key(1)),
                call_flops(cfg, "generate", rows, context))
        if "inference" in args.calls:
            inf = make_inference_fn(cfg, InferenceConfig(InferenceKind.LOGPROBS, 0.9), layout)
            calls[f"inference/{variant}"] = (lambda inf=inf, params=params: inf(params, batch),
                                             call_flops(cfg, "inference", rows, context))
        if "train" in args.calls:
            def loss_fn(out, b):  # next-token cross-entropy of the train step's log-probs
                return (-jnp.sum(out.logprobs_bt),
                        jnp.sum(b["segment_ids_bt"][:, 1:] != 0, dtype=jnp.float32), {})
            step = make_train_step(cfg, layout, loss_fn, OptimizerConfig(lr=1e-4))
            holder = {"state": init_train_state(cfg, layout, OptimizerConfig(lr=1e-4),
                                                jax.random.key(0))}
            tb = {"tokens_bt": batch.tokens_bt, "positions_bt": batch.positions_bt,
                  "segment_ids_bt": batch.segment_ids_bt}

            def run_train(step=step, holder=holder, tb=tb):
                holder["state"], m = step(holder["state"], tb)
                return m
            calls[f"train/{variant}"] = (run_train, call_flops(cfg, "train_step", rows, context))
    for fn, _ in calls.values():
        jax.block_until_ready(fn())  # compile
    times = {name: [] for name in calls}
    cpu = {name: [] for name in calls}
    for _ in range(args.repeats):
        for name, (fn, _) in calls.items():
            start, start_cpu = time.perf_counter(), time.process_time()
            jax.block_until_ready(fn())
            times[name].append(time.perf_counter() - start)
            cpu[name].append(time.process_time() - start_cpu)
    # The better probe of before and after the calls, raised to any call's rate (a call faster
    # than the probe proves the probe was slowed), so no fraction exceeds 1.
    peak = max(peak, floor.machine_peak(jnp.float32, again=True),
               *(flops / statistics.median(times[name]) for name, (_, flops) in calls.items()))
    print(f"peak {peak / 1e9:.1f} GFLOP/s, devices {args.devices}, "
          f"XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}")
    for name, (_, flops) in calls.items():
        med = statistics.median(times[name])
        print(f"{name:<32} {med:8.3f} s  floor {flops / peak:7.3f} s  "
              f"{flops / peak / med:6.1%} of floor  (min {min(times[name]):.3f}, "
              f"cpu {statistics.median(cpu[name]):.3f} s)")


if __name__ == "__main__":
    main()
