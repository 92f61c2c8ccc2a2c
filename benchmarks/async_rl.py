"""Asynchronous vs synchronous RL: trained tokens/s on a long-tailed response-length workload.

`python benchmarks/async_rl.py [--steps=14] [--warmup=4] [--etas=2,4] [--algorithm=ppo]
[--sync_placement=colocate]`

Runs, in one process and one after the other, the synchronous loop (colocated, the default
placement, or `--sync_placement=disaggregate`) and the asynchronous loop (`async_rl.max_staleness` = each η, placement
disaggregate: generation on devices 0-3, training on 4-7) of the same PPO job, and prints one
line per run and, last, one JSON line with each run's trained tokens/s and its ratio to the
synchronous run.

Workload: the tiny model from its random initialisation, whose next-token distribution is
close to uniform, with a stop set of `--stop_ids` tokens: each token ends the response with
probability ≈ stop_ids/272, so response lengths are geometric (mean ≈ 272/stop_ids) and capped
at `--max_new_tokens` (128): long-tailed, from a few tokens to the cap. A synchronous step
waits for its longest response. The learning rate is tiny so the length distribution stays
put while the runs are compared.

Trained tokens/s (steady state) = the mean prompt + response tokens of a step / the median wall
time between the ends of consecutive steps, over steps warmup..steps-1 (compiles are in the
warmup). The median, not the total: an asynchronous run starts the window with up to η batches
already generated, which would flatter it over a short window.

The CPU backend keeps XLA's default threading: with each virtual device single-threaded (as
benchmarks/overlap.py sets it) a synchronous run on a loaded 2-core machine once lost a device
thread for 40 s in an all-reduce rendezvous and XLA aborted the process.
"""

import argparse
import dataclasses
import json
import os
import sys
import tempfile
import time

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import numpy as np  # noqa: E402

from jaxrlhf import checkpoint  # noqa: E402
from jaxrlhf.data import datasets  # noqa: E402
from jaxrlhf.data.tokenizer import ByteTokenizer  # noqa: E402
from jaxrlhf.run import async_loop, build, rl  # noqa: E402
from jaxrlhf.run.check import check_config  # noqa: E402
from jaxrlhf.schema import base_config  # noqa: E402


@dataclasses.dataclass(frozen=True)
class LongTailTokenizer(ByteTokenizer):
    """The byte tokenizer whose responses also stop on `extra_stops` (rare letters)."""

    extra_stops: tuple[int, ...] = ()

    @property
    def stop_ids(self) -> tuple[int, ...]:
        return (self.eos_id, *self.extra_stops)


class Clocked:
    """The loops' metrics sink: each step's metrics and the wall time it was written."""

    def __init__(self):
        self.steps = {}

    def write(self, step, metrics):
        self.steps[step] = (time.perf_counter(), dict(metrics))


def config(args, eta: int):
    c = base_config()
    c.algorithm = args.algorithm
    c.steps = args.steps
    c.rollout.update(batch_size=args.batch_size, max_prompt_len=16,
                     max_new_tokens=args.max_new_tokens)
    if args.algorithm == "grpo":
        c.rollout.update(batch_size=args.batch_size // 4, group_size=4)
    c.optimizer.actor.lr = c.optimizer.critic.lr = 1e-6
    c.checkpoint.update(every=0, async_save=False)
    c.reward.workers = 1
    c.async_rl.update(max_staleness=eta, chunk_tokens=args.chunk_tokens)
    c.placement.kind = "disaggregate" if eta else args.sync_placement
    return c


def run(args, eta: int, workdir: str) -> dict:
    job = check_config(config(args, eta), workdir)
    stops = tuple(range(ord("a"), ord("a") + args.stop_ids - 1))
    job = dataclasses.replace(job, tokenizer=LongTailTokenizer(extra_stops=stops))
    spec = job.spec
    data = build.load_data(spec, job.workdir, job.tokenizer)
    prompts = datasets.EpochIterator(data.train, spec.rollout.batch_size, seed=spec.seed)
    sink = Clocked()
    checkpoints = checkpoint.Checkpointer(job.workdir / "ckpt", spec.checkpoint)
    loop = async_loop.rl_loop if eta else rl.rl_loop
    with build.host_pools(spec) as pools:
        runner = build.fresh_runner(job, pools)
        loop(job, runner, prompts, sink, checkpoints, 0.0)
        runner.close()
    checkpoints.close()
    times = [sink.steps[s][0] for s in range(args.steps)]
    measured = range(args.warmup, args.steps)
    lengths = [sink.steps[s][1]["actor/response_length"] for s in measured]
    tokens = (np.mean(lengths) + spec.rollout.max_prompt_len) * spec.rollout.rows
    period = float(np.median(np.diff(times[args.warmup - 1:])))
    out = {"eta": eta, "placement": spec.placement.kind.value,
           "tokens_per_second": tokens / period, "step_seconds": period,
           "mean_response_length": float(np.mean(lengths)),
           "staleness_max": max(sink.steps[s][1].get("async/staleness_max", 0.0)
                                for s in measured)}
    if eta:
        out["gen_busy"] = float(np.mean([sink.steps[s][1]["async/gen_busy"] for s in measured]))
        out["train_busy"] = float(np.mean([sink.steps[s][1]["async/train_busy"]
                                           for s in measured]))
    return out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=14)
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--etas", default="2,4")
    parser.add_argument("--algorithm", default="ppo", choices=("ppo", "grpo"))
    parser.add_argument("--batch_size", type=int, default=16)
    parser.add_argument("--max_new_tokens", type=int, default=128)
    parser.add_argument("--stop_ids", type=int, default=12)
    parser.add_argument("--chunk_tokens", type=int, default=16)
    parser.add_argument("--sync_placement", default="colocate",
                        choices=("colocate", "disaggregate"))
    args = parser.parse_args(argv)
    if not 1 <= args.warmup < args.steps:
        sys.exit("need 1 <= --warmup < --steps")
    results = []
    for eta in [0] + [int(e) for e in args.etas.split(",")]:
        with tempfile.TemporaryDirectory(prefix="async-bench-") as workdir:
            results.append(run(args, eta, workdir))
        print(results[-1], flush=True)
    sync = results[0]["tokens_per_second"]
    print(json.dumps({"device": jax.devices()[0].platform, "algorithm": args.algorithm,
                      "runs": results,
                      "ratio_vs_sync": {f"eta={r['eta']}": r["tokens_per_second"] / sync
                                        for r in results[1:]}}))


if __name__ == "__main__":
    main()
