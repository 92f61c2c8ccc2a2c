"""Multi-turn rollout time with a slow environment (50 ms a turn) against an instant one, on the
same trajectories, alternated in one process (issue 36: within 1.3x).

`python benchmarks/multiturn_latency.py [--trajectories=128] [--slots=32] [--repeats=6]
[--async_batches=4]`

The tiny model (random weights) writes turns that end on any of 9 stop ids (~30 tokens each,
geometric, so the rows drift out of step); the environment (`Instant` or `Delayed` below,
loaded by file path in the pool's workers) answers each of the first 3 turns with a short tool
message and ends the trajectory after the 4th. Both sides sample the same keys, so they produce
the same trajectories (checked); a slow environment may only cost time, which the streamed
rollout (`dataflow/trajectories.py`) hides by decoding other rows while a row waits. Prints each
side's median seconds per rollout over the runs that compiled nothing (the fills' shapes vary
with the timing, and a shape met first compiles once per run, not per rollout), tokens per
second and the ratio; load from other processes hits both alike, so compare the ratio. Not a
test: the figure of the issue.

With `--async_batches=B` the trajectories are generated as asynchronous RL generates them
(`run/rollout_worker.py`, issue 47): B batches admitted to one rollout worker as it accepts
them (a batch's rows queue only once every admitted row has a slot), its scheduler's rounds
stepped until the last batch finishes; with `--publish_every=K` > 0 the worker gets the same
weights as a new version every K rounds (each a reload of the busy rows' caches, which may
move a sampled token: the sides' trajectories are then not compared). On 2 loaded CPU cores
(0-1:d2, 64 trajectories in 16 slots, 4 repeats): synchronous 1.00x (1.80 s / 1.81 s); async,
4 batches, 1.05x (1.50 s / 1.43 s), and with new weights every 8 rounds 1.02x (3.21 s / 3.15 s:
the reloads cost the rest).

Measured on 2 loaded CPU cores (layout 0-1:d2, ~3.9 turns and ~220 tokens a trajectory):
128 trajectories in 32 slots 1.07x (6.89 s / 6.47 s), 32 in 32 slots 1.12x (1.30 s / 1.16 s).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

TURNS = 4


class Instant:
    """Replies "ok" as a tool message to each of the first TURNS - 1 turns, ends after the
    last (reward 1); `latency_s` per step."""

    latency_s = 0.0

    def reset(self, row):
        return [{"role": "user", "content": row["prompt"]}]

    def step(self, messages, row):
        time.sleep(self.latency_s)
        if sum(m["role"] == "assistant" for m in messages) < TURNS:
            return [{"role": "tool", "content": "ok"}], 0.0, False
        return None, 1.0, True


class Delayed(Instant):
    latency_s = 0.05


def _args():
    p = argparse.ArgumentParser()
    p.add_argument("--layout", default="0-1:d2")
    p.add_argument("--trajectories", type=int, default=128)
    p.add_argument("--slots", type=int, default=32)
    p.add_argument("--budget", type=int, default=256, help="tokens per trajectory")
    p.add_argument("--workers", type=int, default=32, help="environment processes")
    p.add_argument("--repeats", type=int, default=6)
    p.add_argument("--async_batches", type=int, default=0,
                   help="0: the synchronous rollout; B: B batches through a rollout worker")
    p.add_argument("--publish_every", type=int, default=0,
                   help="async: a new weights version every K rounds (0: never)")
    return p.parse_args()


def main():
    args = _args()
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxrlhf.data.environments import EnvPool
    from jaxrlhf.data.tokenizer import ByteTokenizer
    from jaxrlhf.data.transcript import Transcript
    from jaxrlhf.dataflow.trajectories import TrajectoryLimits, rollout
    from jaxrlhf.engine.generate import GenerateConfig, make_generate_fn
    from jaxrlhf.models.sizes import get_size
    from jaxrlhf.parallel.layout import init_params, make_layout

    class StopsOften(ByteTokenizer):
        @property
        def stop_ids(self):  # eos and 8 bytes: a random model's turn ends every ~30 tokens
            return (self.eos_id, *range(0, 256, 32))

    tok = StopsOften()
    model = get_size("tiny", dtype=jnp.float32)
    layout = make_layout(args.layout, model=model)
    params = init_params(model, layout, jax.random.key(1))
    cfg = GenerateConfig(args.budget, tok.stop_ids, tok.pad_id, temperature=1.0)
    generator = make_generate_fn(model, cfg, layout, prompt_buckets=(16,))
    limits = TrajectoryLimits(TURNS, 16, args.budget, max_error_rate=0.0)
    rows = [{"prompt": f"{i:04d} go", "answer": ""} for i in range(args.trajectories)]
    here = os.path.abspath(__file__)
    pools = {name: EnvPool(f"{here}:{name}", num_workers=args.workers, timeout_s=10.0)
             for name in ("Instant", "Delayed")}

    def run(name):
        start = time.perf_counter()
        if args.async_batches:
            out = _worker_rollout(args, generator, model, layout, params, pools[name], tok,
                                  rows, limits)
        else:
            out = rollout(generator, params, jax.random.key(7), pools[name], Transcript(tok),
                          tok, rows, limits, args.slots)
        return time.perf_counter() - start, out

    try:
        # Compile and warm up: the fills' shapes vary with the timing, so twice each.
        reference = {name: run(name)[1] for name in [*pools, *pools]}
        seconds = {name: [] for name in pools}
        for _ in range(args.repeats):
            for name in pools:
                compiles = generator.compiles
                s, out = run(name)
                if generator.compiles == compiles:
                    seconds[name].append(s)
                else:  # a fill's shapes first met: a one-time cost, not the rollout's
                    print(f"  ({name}: a run of {s:.2f} s with {generator.compiles - compiles} "
                          "compiles, left out)")
                if args.publish_every:
                    continue  # reloads may move a token: only the times compare
                for a, b in zip((out.tokens_bs, out.policy_bn), (reference["Instant"].tokens_bs,
                                                                  reference["Instant"].policy_bn)):
                    np.testing.assert_array_equal(a, b)  # the same trajectories
    finally:
        for pool in pools.values():
            pool.close()
    out = reference["Instant"]
    tokens = int(out.mask_bs.sum())
    if not all(seconds.values()):
        raise SystemExit("every timed run of a side compiled something: give more --repeats")
    med = {name: statistics.median(s) for name, s in seconds.items()}
    weights = (f"new weights every {args.publish_every} rounds" if args.publish_every
               else "no new weights")
    mode = (f"async: {args.async_batches} batches through a rollout worker, {weights}"
            if args.async_batches else "synchronous")
    print(f"{args.layout}, {mode}, {args.trajectories} trajectories in {args.slots} slots, "
          f"{out.turns_b.mean():.2f} turns and {tokens / len(rows):.0f} tokens each "
          f"({int(out.policy_bn.sum()) / len(rows):.0f} the policy's)")
    for name, s in med.items():
        print(f"  {name:8s} {s:6.2f} s per rollout ({tokens / s:7.0f} tokens/s), runs: "
              + ", ".join(f"{x:.2f}" for x in seconds[name]))
    print(f"  {Delayed.latency_s * 1e3:.0f} ms environment / instant: {med['Delayed'] / med['Instant']:.2f}x")


def _worker_rollout(args, generator, model, layout, params, pool, tok, rows, limits):
    """`rows` as `--async_batches` batches through one rollout worker (module docstring): the
    batches' Trajectories joined in row order (each batch's arrays cut to the widest)."""
    import numpy as np

    from jaxrlhf.algorithms import multiturn
    from jaxrlhf.data.transcript import Transcript
    from jaxrlhf.dataflow.trajectories import Environment, Trajectories
    from jaxrlhf.run.rollout_worker import RolloutWorker

    (gen,) = [m for m in multiturn.mfcs() if m.name == "actor_gen"]
    engine = generator.rollout_engine(limits.prompt_len + limits.budget, args.slots)
    results = []  # each finished batch's Trajectories, in the order they finish
    worker = RolloutWorker(gen, engine, layout, model, 7, chunk_tokens=8,
                           env=Environment(pool, Transcript(tok), tok, limits),
                           on_trajectories=results.append)
    worker.install(params, 0)
    size = -(-len(rows) // args.async_batches)
    batches = [rows[i:i + size] for i in range(0, len(rows), size)]
    finished, rounds, admitted = [], 0, 0
    while len(finished) < len(batches):
        if admitted < len(batches) and worker.accepts():
            worker.start(admitted, {"prompt_text": [r["prompt"] for r in batches[admitted]],
                                    "answer": [r["answer"] for r in batches[admitted]]},
                         None, 0.0)
            admitted += 1
            continue
        rounds += 1
        if args.publish_every and rounds % args.publish_every == 0:
            worker.install(params, rounds // args.publish_every)
        finished += [g.index for g in worker.step(lambda: 0.0)]
    got = [results[finished.index(k)] for k in range(len(batches))]  # in batch order
    width = max(t.policy_bn.shape[1] for t in got)
    join = lambda name, value=0: np.concatenate([np.pad(
        getattr(t, name), ((0, 0), (0, width - t.policy_bn.shape[1])), constant_values=value)
        for t in got])
    return Trajectories(join("tokens_bs"), join("mask_bs"), join("policy_bn"), join("logp_bn"),
                        join("versions_bn", -1), np.concatenate([t.rewards_b for t in got]),
                        join("turn_rewards_bn"), np.concatenate([t.turns_b for t in got]),
                        got[0].errors, 0.0)


if __name__ == "__main__":
    main()
