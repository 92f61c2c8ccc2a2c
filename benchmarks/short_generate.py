"""A short synchronous generate call on the rollout engine against the static-batch `generate`,
alternated in one process: what the engine's host driving costs where there is little decoding
to amortise it (the main job's shape: 32 rows, 16-token prompts, 8 new tokens, the tiny model).

`python benchmarks/short_generate.py [--layout=0-7:d8] [--new=8] [--repeats=20]`

Prints each side's median milliseconds per call and their ratio. Both compute the same tokens
(tests/test_engine.py); load from other processes hits both alike, so compare the ratio.
Not a test: a tool to see the engine's per-call overhead.

Measured (2-core machine under other processes' load, 15-19; 30 alternated calls of each in
one process, main's engine copied in beside this one): the engine drove fill, advance and a
fetch of the rows from the host, 1.63x the static batch's wall time (1.40x its CPU time); it
now runs such a call as one executable (`Rollout.decode_at_once`), 0.85x (0.91x CPU).
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import time


def _args():
    p = argparse.ArgumentParser()
    p.add_argument("--layout", default="0-7:d8")
    p.add_argument("--new", type=int, default=8, help="new tokens per row")
    p.add_argument("--rows", type=int, default=32)
    p.add_argument("--prompt", type=int, default=16, help="prompt tokens per row")
    p.add_argument("--repeats", type=int, default=20)
    return p.parse_args()


def main():
    args = _args()
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxrlhf.engine.generate import GenerateConfig, decode_model, generate, make_generate_fn
    from jaxrlhf.models.sizes import get_size
    from jaxrlhf.parallel.layout import init_params, make_layout

    model = get_size("tiny", dtype=jnp.float32)
    layout = make_layout(args.layout, model=model)
    params = init_params(model, layout, jax.random.key(1))
    cfg = GenerateConfig(args.new, (2,), 0, temperature=1.0)
    rng = np.random.default_rng(0)
    tokens_bp = rng.integers(3, model.vocab_size, (args.rows, args.prompt)).astype(np.int32)
    mask_bp = np.ones_like(tokens_bp, bool)
    key = jax.random.key(3)
    engine = make_generate_fn(model, cfg, layout)
    rows = layout.batch_sharding(2)
    static = jax.jit(functools.partial(generate, decode_model(model, layout), cfg),
                     out_shardings=engine._out_shardings)
    calls = {
        "engine": lambda: engine(params, tokens_bp, mask_bp, key),
        "static": lambda: static(params, jax.device_put(tokens_bp, rows),
                                 jax.device_put(mask_bp, rows), key),
    }
    seconds = {name: [] for name in calls}
    for call in calls.values():  # compile and warm up
        jax.block_until_ready(call())
    for _ in range(args.repeats):
        for name, call in calls.items():
            start = time.perf_counter()
            jax.block_until_ready(call())
            seconds[name].append(time.perf_counter() - start)
    ms = {name: 1e3 * statistics.median(s) for name, s in seconds.items()}
    print(f"{args.layout} {args.rows} rows, {args.new} new tokens: engine {ms['engine']:.1f} ms, "
          f"static {ms['static']:.1f} ms, engine / static {ms['engine'] / ms['static']:.2f}x")


if __name__ == "__main__":
    main()
