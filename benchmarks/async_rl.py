"""Asynchronous vs synchronous RL: trained tokens/s on a long-tailed response-length workload.

`python benchmarks/async_rl.py [--steps=14] [--warmup=4] [--rounds=1] [--etas=2,4] [--mp_etas=2]
[--modes=continue] [--sync=1] [--gen_replicas=1] [--stop_ids=12] [--algorithm=ppo]
[--sync_placement=colocate] [--async_placement=disaggregate] [--devices=8]`
(from the repository root or anywhere else; no PYTHONPATH needed)

Runs, one after the other, in one process each, the synchronous loop (colocated, the default
placement, or `--sync_placement=disaggregate`) and the asynchronous loop (`async_rl.max_staleness` = each η, placement
disaggregate: training on the first half of the devices, generation on the second) of the same PPO job, and prints one
line per run, then the multi-process asynchronous runs (`--mp_etas`: a trainer process and
`--gen_replicas` generation processes, the devices split evenly), and, last, one JSON line with each run's trained tokens/s and its ratio to the
synchronous run.

Workload: the tiny model from its random initialisation, whose next-token distribution is
close to uniform, with a stop set of `--stop_ids` tokens: each token ends the response with
probability ≈ stop_ids/272, so response lengths are geometric (mean ≈ 272/stop_ids) and capped
at `--max_new_tokens` (128): long-tailed, from a few tokens to the cap. A synchronous step
waits for its longest response. The learning rate is tiny so the length distribution stays
put while the runs are compared.

Partial rollouts: `--modes=continue,restart,finish` runs each single-process η once per
`async_rl.on_new_version` (what a row still decoding does when new weights come: its cache
recomputed, aborted and decoded anew, or finished under the old weights while new rows wait)
and reports each run's useful tokens/s (the trained tokens/s: a restarted row's discarded
tokens count for nothing), the rows restarted and tokens discarded over the whole run, and the
useful share of the tokens sampled (`useful_share`: trained response tokens over those plus the
discarded ones); the summary's `useful_tokens_per_second` and `useful_vs_continue` put the modes
side by side. `continue` and `finish` discard no row. `--sync=0` leaves the synchronous run out
(and the ratios to it).

Measured on this 2-core CPU machine while other jobs loaded it (so from runs in one
invocation, and two invocations with the modes in opposite orders):
`--etas=2 --mp_etas= --sync=0 --rounds=2 --steps=24 --modes=continue,restart,finish` and
`... --modes=finish,restart,continue`. Useful tokens/s, median of the four rounds: continue
1,261, restart 1,324 (1.05x), finish 2,078 (1.65x); per invocation finish/continue 2.36x and
1.45x, restart/continue 1.74x and 0.74x (the load moves more than restart's difference).
continue and finish discarded no row; restart discarded 62-69 rows a run, ~1,900 tokens, 18%
of those sampled. Every run trained the same tokens (mean response 22.2; the learning rate
keeps the policy put) at staleness at most 2. The trainer is the bottleneck (busy 0.65-0.89
of the time) and generation takes its cores, so the mode that computes least beside it wins:
finish re-prefills and re-decodes nothing (continue re-prefills the busy rows at every new
version, and a fresh process compiles a reload per cache bucket on first use).

Trained tokens/s (steady state) = the mean prompt + response tokens of a step / the median wall
time between the ends of consecutive steps, over steps warmup..steps-1 (compiles are in the
warmup). The median, not the total: an asynchronous run starts the window with up to η batches
already generated, which would flatter it over a short window. `tokens_per_second_steady` (and
`ratio_vs_sync_steady`) take the median over the windows whose update compiled nothing
(`windows_compiling` counts the others): a response width first seen after the warmup
compiles the trainer's calls for seconds, in either loop, sometimes in half the windows.

Per run it also prints where a step's time goes: `gen_seconds` and `train_seconds` (sync: the
generate call and the rest of the step; async: a batch's generation, wall time from its
admission to its last row, and one update of the trainer) and, async,
`decode_padding_frac` (the share of the generation slots' decode steps without a row:
continuous batching refills a slot as soon as its row stops, within the staleness bound) and
`gen_busy`/`train_busy` (total busy seconds / total window); multi-process,
`gen_pause_per_publish_s`: a replica's seconds without a decode step while a weight version
was in flight and it had rows to decode or a batch to start, per version received. Both loops
cut a generated
batch after its longest response (`buckets.response_widths`), so the calls after generation
compute P + that many columns, not P + max_new_tokens.

Why asynchrony wins here although every synchronous call already keeps both cores busy: a
synchronous step decodes until its longest response stops (about 70 of 128 tokens for 16 rows
with mean 22), with the finished rows' slots idle; the asynchronous generator refills them
with the next admitted batch's prompts, so it decodes about as many steps as tokens per slot.
On a CPU the two workers share the cores that either keeps busy alone (their busy fractions add
up to about 1, in one process or two), so the gain is the decode steps saved; on accelerators
generation also overlaps training. The most that saving can give is the synchronous step over
its time without generation (2 devices, quiet: 0.168 s against 0.126 s, 1.33x). Fewer
devices per program is itself faster on 2 cores (8 virtual devices share them), so also
compare against the synchronous loop on the asynchronous run's own device split,
`--sync_placement=disaggregate`.

The CPU backend keeps XLA's default threading: with each virtual device single-threaded (as
benchmarks/overlap.py sets it) a synchronous run on a loaded 2-core machine once lost a device
thread for 40 s in an all-reduce rendezvous and XLA aborted the process.
"""

import argparse
import dataclasses
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # run from anywhere
# CPU devices in all (read before JAX starts): 8 by default, as the test suite; on 2 cores
# fewer devices per program run faster, so `--devices=2` is the fairer synchronous baseline.
DEVICES = next((int(a.split("=", 1)[1]) for a in sys.argv if a.startswith("--devices=")), 8)
WORKER = "--mp_worker"  # this script as one process of the multi-process run
if WORKER not in sys.argv:
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + f" --xla_force_host_platform_device_count={DEVICES}")

import jax  # noqa: E402
import numpy as np  # noqa: E402

from jaxrlhf import checkpoint  # noqa: E402
from jaxrlhf.algorithms import registry  # noqa: E402
from jaxrlhf.algorithms.registry import Capability  # noqa: E402
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


def config(args, eta: int, gen_replicas: int = 1, mode: str = "continue"):
    c = base_config()
    c.algorithm = args.algorithm
    c.steps = args.steps
    c.rollout.update(batch_size=args.batch_size, max_prompt_len=16,
                     max_new_tokens=args.max_new_tokens)
    if args.algorithm == "grpo":
        c.rollout.update(batch_size=args.batch_size // 4, group_size=4)
    c.optimizer.actor.lr = 1e-6
    if Capability.CRITIC in registry.lookup(args.algorithm).capabilities:
        c.optimizer.critic.lr = 1e-6  # (a key set but not read is refused)
    c.checkpoint.update(every=0, async_save=False)
    c.reward.workers = 1
    c.async_rl.max_staleness = eta
    if eta:  # the rollout workers' keys: a synchronous run reads neither
        c.async_rl.update(chunk_tokens=args.chunk_tokens, on_new_version=mode)
    c.placement.kind = args.async_placement if eta else args.sync_placement
    c.placement.gen_replicas = gen_replicas
    return c


def run(args, eta: int, workdir: str, gen_replicas: int = 1, mode: str = "continue") -> dict:
    job = check_config(config(args, eta, gen_replicas, mode), workdir)
    stops = tuple(range(ord("a"), ord("a") + args.stop_ids - 1))
    job = dataclasses.replace(job, tokenizer=LongTailTokenizer(extra_stops=stops))
    spec = job.spec
    data = build.load_data(spec, job.workdir, job.tokenizer)
    prompts = datasets.EpochIterator(data.train, spec.rollout.batch_size, seed=spec.seed)
    sink = Clocked()
    checkpoints = checkpoint.Checkpointer(job.workdir / "ckpt", spec.checkpoint)
    loop = async_loop.rl_loop if eta else rl.rl_loop  # multi-process: async_procs inside
    with build.host_pools(spec) as pools:
        runner = build.fresh_runner(job, pools)
        loop(job, runner, prompts, sink, checkpoints, {})
        runner.close()
    checkpoints.close()
    if jax.process_index():  # a generation replica: the trainer (process 0) measures
        return {}
    times = [sink.steps[s][0] for s in range(args.steps)]
    measured = range(args.warmup, args.steps)
    lengths = [sink.steps[s][1]["actor/response_length"] for s in measured]
    tokens = (np.mean(lengths) + spec.rollout.max_prompt_len) * spec.rollout.rows
    windows = np.diff(times[args.warmup - 1:])
    period = float(np.median(windows))
    metric = lambda key: np.array([sink.steps[s][1][key] for s in measured])
    # Windows whose update compiled nothing (a new response-width bucket compiles the trainer's
    # calls for seconds, in either loop, and can land in half the windows of a short run).
    compiles = np.array([sink.steps[s][1].get("recompiles", 0.0)
                         for s in range(args.warmup - 1, args.steps)])
    steady = windows[np.diff(compiles) == 0]
    steady_period = float(np.median(steady)) if len(steady) else float("nan")
    out = {"eta": eta, "placement": spec.placement.kind.value, "processes": jax.process_count(),
           "tokens_per_second": tokens / period, "step_seconds": period,
           "tokens_per_second_steady": tokens / steady_period,
           "windows_compiling": int(len(windows) - len(steady)),
           "mean_response_length": float(np.mean(lengths)),
           "staleness_max": max(sink.steps[s][1].get("async/staleness_max", 0.0)
                                for s in measured)}
    if eta:
        out["on_new_version"] = mode
        out["useful_tokens_per_second"] = out["tokens_per_second"]  # trained tokens only
        every = lambda key: sum(sink.steps[s][1].get(key, 0.0) for s in range(args.steps))
        out["restarted_rows"] = int(every("async/restarted_rows"))
        out["discarded_tokens"] = int(every("async/discarded_tokens"))
        trained = sum(sink.steps[s][1]["actor/response_length"] for s in range(args.steps))
        trained *= spec.rollout.rows
        out["useful_share"] = trained / (trained + out["discarded_tokens"])
        # Busy fractions over the whole window (total busy / total time): a replica reports its
        # busy seconds when it sends a batch, so one step's window can read above 1.
        for side in ("gen", "train"):
            busy = metric(f"async/{side}_busy") * windows
            out[f"{side}_busy"] = float(busy.sum() / windows.sum())
        out["gen_seconds"] = float(np.median(metric("async/gen_seconds")))  # a batch, wall
        out["train_seconds"] = float(np.median(metric("time/step_seconds")))  # an update
        out["decode_padding_frac"] = float(np.mean(metric("async/decode_padding_frac")))
        out["longest_response"] = float(np.mean(metric("async/response_length_longest")))
        if "async/gen_receipts" in sink.steps[args.steps - 1][1]:  # multi-process
            out["gen_pause_per_publish_s"] = pause_per_publish(
                [sink.steps[s][1] for s in range(args.warmup - 1, args.steps)])
    else:
        gen = metric("time/actor_gen")
        out["gen_seconds"] = float(np.median(gen))
        out["train_seconds"] = float(np.median(metric("time/step_seconds") - gen))  # the rest
    return out


def pause_per_publish(figures: list[dict]) -> float:
    """The replicas' seconds without a decode step while a version was in flight and they had
    rows to decode or a batch to start, per version received, over the window (the figures
    are cumulative: as last sent by each replica)."""
    paused = figures[-1]["async/gen_paused_seconds"] - figures[0]["async/gen_paused_seconds"]
    receipts = figures[-1]["async/gen_receipts"] - figures[0]["async/gen_receipts"]
    return paused / receipts if receipts else float("nan")


def multi_process(args, eta: int, argv: list[str]) -> dict:
    """The asynchronous run as 1 + R processes (trainer + generation replicas), each with an
    equal share of the devices; process 0's figures."""
    from jaxrlhf.distributed import reserve_port

    processes = 1 + args.gen_replicas
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env.update(JAX_PLATFORMS="cpu", PYTHONPATH=str(pathlib.Path(__file__).resolve().parents[1]))
    with reserve_port() as sock, tempfile.TemporaryDirectory(prefix="async-bench-mp-") as work:
        address = f"127.0.0.1:{sock.getsockname()[1]}"
        # Process 0 writes here; the replicas to files (read back if one fails).
        logs = [None] + [open(pathlib.Path(work, f"process_{i}.log"), "w")
                         for i in range(1, processes)]
        procs = [subprocess.Popen(
            [sys.executable, __file__, WORKER, address, str(i), str(eta), work, *argv],
            env=env, stdout=logs[i], stderr=subprocess.STDOUT if i else None, text=True)
            for i in range(processes)]
        tail = lambda i: (pathlib.Path(work, f"process_{i}.log").read_text()[-3000:] if i
                          else "(its output is above)")
        try:
            deadline = time.monotonic() + args.timeout
            while any(p.poll() is None for p in procs):  # the first failure ends them all
                failed = [i for i, p in enumerate(procs) if p.poll()]
                if failed or time.monotonic() > deadline:
                    i = failed[0] if failed else 0
                    for p in procs:
                        if p.poll() is None:
                            p.kill()
                    sys.exit(f"process {i} of the multi-process run failed "
                             f"({procs[i].returncode}): {tail(i)}")
                time.sleep(1.0)
            for i, p in enumerate(procs):
                if p.returncode:
                    sys.exit(f"process {i} of the multi-process run failed ({p.returncode}): "
                             f"{tail(i)}")
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
            for log in logs[1:]:
                log.close()
        return json.loads(pathlib.Path(work, "result.json").read_text())


def worker(argv: list[str]) -> None:
    """One process of `multi_process`: ADDRESS PROCESS_ID ETA WORKDIR ARGS..."""
    import faulthandler
    import signal

    faulthandler.register(signal.SIGUSR1, all_threads=True)  # `kill -USR1`: where it waits
    from jaxrlhf import distributed
    from jaxrlhf.backend import use_cpu_devices

    address, index, eta, work = argv[0], int(argv[1]), int(argv[2]), argv[3]
    args = parse(argv[4:])
    processes = 1 + args.gen_replicas
    cfg = distributed.from_flags(address, processes, index, wait_timeout_s=args.timeout)
    use_cpu_devices(distributed.cpu_devices_per_process(DEVICES - DEVICES % processes, cfg))
    distributed.initialize(cfg)
    out = run(args, eta, str(pathlib.Path(work) / "run"), args.gen_replicas)  # one job
    if index == 0:
        pathlib.Path(work, "result.json").write_text(json.dumps(out))


def parse(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--devices", type=int, default=8,
                        help="CPU devices: the synchronous run's; the asynchronous runs split them")
    parser.add_argument("--steps", type=int, default=14)
    parser.add_argument("--rounds", type=int, default=1,
                        help="times to run the synchronous and single-process asynchronous runs, "
                             "alternating; each ratio is against its own round's synchronous run "
                             "(median over rounds; multi-process runs: against the median)")
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--etas", default="2,4")
    parser.add_argument("--algorithm", default="ppo", choices=("ppo", "grpo"))
    parser.add_argument("--batch_size", type=int, default=16)
    parser.add_argument("--max_new_tokens", type=int, default=128)
    parser.add_argument("--stop_ids", type=int, default=12)
    parser.add_argument("--chunk_tokens", type=int, default=16)
    parser.add_argument("--sync_placement", default="colocate",
                        choices=("colocate", "disaggregate"))
    parser.add_argument("--async_placement", default="disaggregate",
                        choices=("colocate", "disaggregate"),
                        help="colocate: one device (a single GPU) serves both workers")
    parser.add_argument("--mp_etas", default="2",
                        help="η of the multi-process runs (trainer + replicas); empty: none")
    parser.add_argument("--modes", default="continue",
                        help="async_rl.on_new_version of the single-process asynchronous runs, "
                             "each η run once per mode: continue, restart, finish")
    parser.add_argument("--sync", type=int, default=1,
                        help="0: skip the synchronous run (no ratios to it)")
    parser.add_argument("--gen_replicas", type=int, default=1)
    parser.add_argument("--single_process", type=int, default=1,
                        help="0: skip the single-process asynchronous runs")
    parser.add_argument("--timeout", type=float, default=1800.0,
                        help="seconds a multi-process run (and any wait in it) may take")
    return parser.parse_args(argv)


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] == WORKER:
        worker(argv[1:])
        return
    args = parse(argv)
    if not 1 <= args.warmup < args.steps:
        sys.exit("need 1 <= --warmup < --steps")
    etas = [int(e) for e in args.etas.split(",") if e] if args.single_process else []
    modes = [m for m in args.modes.split(",") if m]
    results, ratios, steady = [], {}, {}
    name = lambda r: f"eta={r['eta']}" + (f",processes={r['processes']}"
                                          if r["processes"] > 1 else "") + (
        f",{r['on_new_version']}" if len(modes) > 1 and r["eta"] else "")
    # Rounds alternate the synchronous and asynchronous runs: a machine whose load changes
    # (other jobs on the same cores) shows as spread between rounds, not as a false ratio.
    for _ in range(args.rounds):
        first = len(results)
        runs = [(0, "continue")] * bool(args.sync) + [(e, m) for e in etas for m in modes]
        for eta, mode in runs:
            with tempfile.TemporaryDirectory(prefix="async-bench-") as workdir:
                results.append(run(args, eta, workdir, mode=mode))
            print(results[-1], flush=True)
        for r in results[first + 1:] if args.sync else ():
            ratios.setdefault(name(r), []).append(
                r["tokens_per_second"] / results[first]["tokens_per_second"])
            steady.setdefault(name(r), []).append(
                r["tokens_per_second_steady"] / results[first]["tokens_per_second_steady"])
    sync = float(np.median([r["tokens_per_second"] for r in results if not r["eta"]]
                           or [np.nan]))
    for eta in [int(e) for e in args.mp_etas.split(",") if e]:
        results.append(multi_process(args, eta, argv))
        print(results[-1], flush=True)
        ratios[name(results[-1])] = [results[-1]["tokens_per_second"] / sync]
    summary = {"device": jax.devices()[0].platform, "algorithm": args.algorithm,
               "runs": results,
               "ratio_vs_sync": {k: float(np.median(v)) for k, v in ratios.items()},
               "ratio_vs_sync_steady": {k: float(np.median(v)) for k, v in steady.items()}}
    if len(modes) > 1:  # partial rollouts: the modes side by side
        useful = {}
        for r in results:
            if r["eta"] and r["processes"] == 1:
                useful.setdefault(name(r), []).append(r["useful_tokens_per_second"])
        summary["useful_tokens_per_second"] = {k: float(np.median(v)) for k, v in useful.items()}
        summary["useful_vs_continue"] = {
            k: float(np.median(v)) / summary["useful_tokens_per_second"][
                k.rsplit(",", 1)[0] + ",continue"]
            for k, v in useful.items() if "continue" in modes}
        summary["discarded_rows"] = {}  # over each whole run, round by round
        for r in results:
            if r["eta"] and r["processes"] == 1:
                summary["discarded_rows"].setdefault(name(r), []).append(r["restarted_rows"])
    if args.rounds > 1:
        summary["ratio_rounds"] = ratios
        summary["ratio_rounds_steady"] = steady
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
