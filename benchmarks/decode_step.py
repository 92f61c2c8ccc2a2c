"""Cost of one decode step by cache length on XLA:CPU (issue 30): the attention of a step alone,
the library's against a reference layout, and the rollout engine's whole step.

`python benchmarks/decode_step.py [--caps=48,128,256,512,1024] [--repeats=5] [--parts=attention,step]`

W-cpu's shape (`models.sizes` "bench": 4 layers, 4 query / 2 kv heads of dim 64, fp32), 64
rows, 32-token prompts; a cache of 32 + C slots for each capacity C.

  * attention: the four layers' one-query attention of a step (`attention.cached_query_attention`
    on `models.decode_kv.DecodeKV`: the C++ kernel, `kernels/cpu_decode_attention.py`, and
    XLA's products), against `_before` below (keys as one [b, k, d, S] matrix, the layout
    before tiles), each in a jitted loop of 8 steps over its own four caches, the variants
    alternated `repeats` times so that other processes' load hits them alike.
  * step: the rollout engine's decode step (`Rollout.advance`, lockstep, 8 tokens a call) at
    64 busy slots just filled (40 live slots each), per cache capacity, with the kernel (auto)
    and with XLA's products, alternated.

Prints CPU ms (`time.process_time`: what this process ran, the fair A/B on a loaded machine)
and wall ms per step, and the keys' and values' bytes per CPU second. Not a test.

With the C++ kernel (quiet, load 1.3, `--caps=64,512,1024 --repeats=3`), wall ms per step:

  attention of a step       S = 96    544   1,056
    C++ kernel (2 cores)        0.75   5.18   9.17
    XLA on tiles                1.26   9.89  16.09
    XLA on [d, S]               1.93  11.84  21.92
  engine step, 40 live slots   C = 64    512   1,024
    auto (the kernel)           6.03   6.05   6.23
    xla                         6.48  13.56  22.28

The kernel reads each row only up to its query slot, so the engine's step costs the same at
every capacity for the same live rows; XLA's products read the whole cache array.

Before the kernel, measured on the 2-core development machine shared with five other processes
(load average 12-17, so wall times are not comparable; CPU ms are):

  attention of a step (`--parts=attention`, one process, alternated), CPU ms:
    S      80    544   1,056
    before 1.82  10.90  24.30
    tiled  1.16   7.25  16.92   (the softmax's division after the product; tiles alone:
                                 1.51, 8.13, 14.37 against 1.75, 10.94, 20.80 in a run at load 12)
  whole engine step (`--parts=step`, main's code and this one in alternated processes), CPU ms:
    capacity  48     128    256    512    1,024
    before    10.96  12.72  16.81  22.19  34.07   (23.7 us per cache slot)
    tiled     10.27  12.35  15.38  18.98  27.70   (17.9 us per cache slot)

What is left per cache slot is the two products reading the fp32 cache (262 KB per slot over
64 rows and 4 layers) at ~15-20 GB/s on one core: XLA:CPU runs them as YNNPACK fusions with
concurrency 1 (its runtime's own report, `TF_CPP_VMODULE=ynn_fusion_thunk=3`), so the
second core is idle during them; YNNPACK's bf16 products ran no faster than fp32 here.

Why XLA's products stay on one core, hence the kernel (issue 30's flatness target; load 5-12,
CPU ms of the attention loop above at S = 544 unless said):
  * YNNPACK reports concurrency 1 for every batched product tried: the tiles' [2176, 2, 64] x
    [2176, 64, 32], [128, 544, 64] x [128, 64, 2], [128, 2, 544] x [128, 544, 64], even
    [128, 544, 64] x [128, 64, 64]; an unbatched [64, 256] x [256, 768] runs on the pool.
  * Without YNNPACK's products (`--xla_cpu_experimental_ynn_fusion_type=`) XLA:CPU multiplies
    batch element by batch element through Eigen: 22.6 against 8.3 ms; XNNPACK
    (`--xla_cpu_experimental_xnn_fusion_type=dot`) does not take batched products (19.1 ms).
  * As multiply-and-reduce, YNNPACK's reductions run on the pool but cost more than they
    share: scores 9.6 against 3.5 ms for the tiled product, values 15.1 against 3.3.
  * Two independent halves (rows or kv heads) still run one after the other: the thunk
    executor offloads ready thunks to a second thread only when more than 8 are ready at once
    (`ExecuteSession::kSplitThreshold` in XLA:CPU's runtime), and buffer assignment lays one
    half's product where the other half's query broadcast lay, which orders them
    (`TF_CPP_VMODULE=thunk_executor=6` prints the dependency). 17 products over key tile
    groups stored apart, each with the query broadcast fused in, had no dependencies and did
    go to two threads, but overlapped for 3% of their time in a profiler trace (load 7).
  * Two executables dispatched together on the one device run one after the other (trace).
  * One core streams ~24 GB/s (numpy, CPU time); two processes streaming at once ~23 GB/s
    each, so a second core would double what the products read.
"""

from __future__ import annotations

import argparse
import math
import os
import time

ROWS, PROMPT, STEPS = 64, 32, 8


def _args():
    p = argparse.ArgumentParser()
    p.add_argument("--caps", default="48,128,256,512,1024")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--parts", default="attention,step")
    return p.parse_args()


def _before(q_b1hd, kT_bkds, v_bksd, mask_bs):
    """The reference: scores q [g, d] x K [d, S] per (row, kv head) on keys stored [b, k, d, S]."""
    import jax
    import jax.numpy as jnp
    batch, _, heads, head_dim = q_b1hd.shape
    kv_heads = kT_bkds.shape[1]
    q_bkgd = q_b1hd.reshape(batch, kv_heads, heads // kv_heads, head_dim)
    scores = jnp.einsum("bkgd,bkds->bkgs", q_bkgd, kT_bkds,
                        preferred_element_type=jnp.float32) / math.sqrt(head_dim)
    scores = jnp.where(mask_bs[:, None, None], scores, -1e30)
    probs = jax.nn.softmax(scores, axis=-1)
    return jnp.einsum("bkgs,bksd->bkgd", probs, v_bksd).reshape(batch, 1, heads, head_dim)


def _timed(fn, *args) -> tuple[float, float]:
    import jax
    cpu, wall = time.process_time(), time.perf_counter()
    jax.block_until_ready(fn(*args))
    return time.process_time() - cpu, time.perf_counter() - wall


def attention_part(cfg, caps, repeats):
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxrlhf.models.attention import AttentionImpl, cached_query_attention
    from jaxrlhf.models.decode_kv import DecodeKV

    heads, kv_heads, dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    print(f"attention of one decode step, {cfg.num_layers} layers, {ROWS} rows "
          f"(ms per step; GB/s: keys and values read per CPU second)")
    for cap in caps:
        length = PROMPT + cap
        rng = np.random.default_rng(0)
        k_lbskd, v_lbskd = (rng.standard_normal((cfg.num_layers, ROWS, length, kv_heads, dim),
                                                np.float32) for _ in range(2))
        q_b1hd = jnp.asarray(rng.standard_normal((ROWS, 1, heads, dim), np.float32))
        slot = jnp.int32(length - 3)
        seg_b1, seg_bs = jnp.ones((ROWS, 1), jnp.int32), jnp.ones((ROWS, length), jnp.int32)
        mask_bs = jnp.arange(length)[None, :] <= slot
        tiled = [DecodeKV.from_stacked(jnp.asarray(k), jnp.asarray(v))
                 for k, v in zip(k_lbskd, v_lbskd)]
        flat = [(jnp.asarray(np.transpose(k, (0, 2, 3, 1))), jnp.asarray(np.transpose(v, (0, 2, 1, 3))))
                for k, v in zip(k_lbskd, v_lbskd)]

        def loop(attend, caches):
            def run(q_b1hd, caches):
                def body(_, q_b1hd):
                    for cache in caches:
                        q_b1hd = q_b1hd + attend(q_b1hd, cache)
                    return q_b1hd
                return jax.lax.fori_loop(0, STEPS, body, q_b1hd)
            return jax.jit(run), (q_b1hd, caches)

        variants = {
            "C++ kernel": loop(lambda q, c: cached_query_attention(
                q, *c, seg_b1, seg_bs, slot, impl=AttentionImpl.AUTO), tiled),
            "XLA on tiles": loop(lambda q, c: cached_query_attention(
                q, *c, seg_b1, seg_bs, slot, impl=AttentionImpl.XLA), tiled),
            "XLA on [d, S]": loop(lambda q, c: _before(q, *c, mask_bs), flat),
        }
        outs = {name: np.asarray(fn(*args)) for name, (fn, args) in variants.items()}
        first = next(iter(outs.values()))
        for name, out in outs.items():
            np.testing.assert_allclose(out, first, rtol=1e-4, atol=1e-4, err_msg=name)
        totals = {name: [0.0, 0.0] for name in variants}
        for _ in range(repeats):
            for name, (fn, args) in variants.items():
                cpu, wall = _timed(fn, *args)
                totals[name][0] += cpu
                totals[name][1] += wall
        nbytes = 2 * ROWS * kv_heads * length * dim * 4 * cfg.num_layers
        for name, (cpu, wall) in totals.items():
            cpu, wall = cpu / repeats / STEPS, wall / repeats / STEPS
            print(f"  S={length:5d}  {name:16s} cpu {cpu * 1e3:6.2f} ms  wall {wall * 1e3:6.2f} ms"
                  f"  {nbytes / cpu / 1e9:5.1f} GB/s")


def step_part(cfg, caps, repeats):
    """The engine's step per capacity, with the C++ kernel (AUTO) and with XLA's products,
    alternated."""
    import dataclasses

    from jaxrlhf.models.attention import AttentionImpl

    runs = {impl: _engine_steps(dataclasses.replace(cfg, attention=impl), caps)
            for impl in (AttentionImpl.AUTO, AttentionImpl.XLA)}
    totals = {(impl, cap): [0.0, 0.0] for impl in runs for cap in caps}
    for _ in range(repeats):
        for impl, (fresh, advance) in runs.items():
            for cap in caps:
                cpu, wall = _timed(advance, fresh(cap), cap)
                totals[impl, cap][0] += cpu
                totals[impl, cap][1] += wall
    print(f"rollout engine decode step, {ROWS} busy slots (ms per step)")
    for (impl, cap), (cpu, wall) in totals.items():
        print(f"  {impl.value:4s} capacity {cap:5d} (S={PROMPT + cap:5d})"
              f"  cpu {cpu / repeats / STEPS * 1e3:6.2f} ms"
              f"  wall {wall / repeats / STEPS * 1e3:6.2f} ms")


def _engine_steps(cfg, caps):
    """(fresh(cap): a filled state, advance(state, cap): STEPS steps), compiled for `caps`."""
    import jax
    import numpy as np

    from jaxrlhf.engine.decoding import GenerateConfig
    from jaxrlhf.engine.rollout import Rollout
    from jaxrlhf.parallel.layout import init_params, make_layout

    layout = make_layout("0-0:d1", model=cfg)
    params = init_params(cfg, layout, jax.random.key(0))
    gen = GenerateConfig(max(caps), 0, 0, 0.9, force_max_length=True)
    engine = Rollout(cfg, gen, layout, prompt_len=PROMPT, slots=ROWS)
    rng = np.random.default_rng(0)
    tokens_bp = rng.integers(1, cfg.vocab_size, (ROWS, PROMPT)).astype(np.int32)
    mask_bp = np.ones_like(tokens_bp, bool)
    key = jax.device_put(jax.random.key(1), layout.replicated())

    def fresh(cap):
        state = engine.fill(engine.vacant(ROWS, cap), params, 0, np.arange(ROWS), tokens_bp,
                            mask_bp, [key] * ROWS, np.arange(ROWS))
        return jax.block_until_ready(state)

    def advance(state, cap):
        return engine.advance(state, params, 0, STEPS, longest=cap - STEPS, lockstep=True)

    for cap in caps:  # compile
        jax.block_until_ready(advance(fresh(cap), cap))
    return fresh, advance


def main():
    args = _args()
    from jaxrlhf.backend import use_cpu_devices
    use_cpu_devices(1)
    import jax.numpy as jnp

    from jaxrlhf.models.sizes import get_size

    cfg = get_size("bench", dtype=jnp.float32)
    caps = [int(c) for c in args.caps.split(",")]
    parts = args.parts.split(",")
    print(f"load average {os.getloadavg()}")
    if "attention" in parts:
        attention_part(cfg, caps, args.repeats)
    if "step" in parts:
        step_part(cfg, caps, args.repeats)
    print(f"load average {os.getloadavg()}")


if __name__ == "__main__":
    main()
