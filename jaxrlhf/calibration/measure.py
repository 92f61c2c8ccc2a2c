"""Measuring an RL config on the present devices: the runtime side of `--calibrate`/`--validate`.

`LiveRun` builds what the training job builds (`run.check_config`, `run.build.fresh_runner`)
from freshly initialised parameters (`parallel.layout.init_params`; no warm start: neither time nor
memory depends on the weights), with the config's data and host reward pools. Then:
  * `steps(n)` runs n scheduler steps and returns their `StepTiming`s (the first one compiles);
  * `time_rounds(n)` times, n times over, each model MFC on its own (its executor on the last
    step's buffer, waited for with `block_until_ready`, nothing else in flight: the MFC's cost
    free of the scheduler's overlap, less what its model's runtime spent moving parameters,
    which its `MoveCounters` report) and each frozen model's trip to host memory and back;
  * `compiled(name)` returns the MFC's compiled executables, whose `memory_analysis()` is XLA's
    own account of its memory.

`LiveRun.plan` is the runtime's plan object, the planner's `ExecutionPlan`, so predictions and
measurements refer to the same plan.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import statistics
import tempfile
import time
from collections.abc import Iterator, Sequence

import jax
import numpy as np
from ml_collections import ConfigDict

from jaxrlhf.data import datasets
from jaxrlhf.data.encode import prompt_batch
from jaxrlhf.dataflow.scheduler import StepTiming
from jaxrlhf.engine.buckets import CompileCache
from jaxrlhf.mfc import Role
from jaxrlhf.parallel.layout import init_params
from jaxrlhf.parallel.reshard import offload_to_host, onload
from jaxrlhf.plan.choice import ExecutionPlan
from jaxrlhf.run import build
from jaxrlhf.run.check import Job, check_config


def compile_cache_of(engine) -> CompileCache:
    """The CompileCache of an engine call object (Generator, InferenceFn, TrainStep)."""
    return engine.compile_cache


def _spread(samples: Sequence[float]) -> float:
    """Interquartile range relative to the median: how noisy a figure is."""
    q1, q2, q3 = np.percentile(samples, [25, 50, 75])
    return float((q3 - q1) / q2) if q2 > 0 else 0.0


@dataclasses.dataclass(frozen=True)
class Timing:
    """Seconds of one MFC (or one parameter movement) run on its own, over repeated runs.

    Attributes:
      name: the MFC, or "offload:ROLE" for a frozen model's trip to host memory and back.
      samples: seconds of each run.
      moved: seconds of each run spent moving the model's parameters (part of `samples`).
    """

    name: str
    samples: tuple[float, ...]
    moved: tuple[float, ...]

    @property
    def own(self) -> tuple[float, ...]:
        """Seconds of each run without the parameter movements: the call itself."""
        return tuple(t - m for t, m in zip(self.samples, self.moved))

    @property
    def median(self) -> float:
        return statistics.median(self.own)

    @property
    def spread(self) -> float:
        return _spread(self.own)

    @property
    def moved_median(self) -> float:
        return statistics.median(self.moved)

    @property
    def moved_spread(self) -> float:
        return _spread(self.moved)

    def __add__(self, other: "Timing") -> "Timing":
        return Timing(self.name, self.samples + other.samples, self.moved + other.moved)


def merge(a: dict, b: dict) -> dict:
    """Two rounds' timings, key by key, as one."""
    return {key: a[key] + b[key] for key in a}


def _block(outputs) -> None:
    for value in outputs.values():
        if not isinstance(value, concurrent.futures.Future):  # host futures are no device work
            jax.block_until_ready(value)


class LiveRun:
    """A config's RL runner on the present devices (use `live_run`, which closes the pools)."""

    def __init__(self, job: Job, pools, seed: int = 0):
        self.job, self.spec = job, job.spec
        self.tokenizer = job.tokenizer
        data = build.load_data(self.spec, job.workdir, job.tokenizer)
        home = job.plan.home(self.spec.graph, Role.ACTOR)
        params = init_params(self.spec.models[Role.ACTOR].config, home, jax.random.key(seed))
        self.runner = build.fresh_runner(job, pools, params)
        self._prompts = datasets.EpochIterator(data.train, self.spec.rollout.batch_size,
                                               seed=seed)
        self._buffer = None

    @property
    def plan(self) -> ExecutionPlan:
        """The plan the runtime runs (layouts and micro-batches of every model MFC)."""
        return self.job.plan.plan

    def _batch(self) -> dict:
        r = self.spec.rollout
        return prompt_batch(next(self._prompts), self.tokenizer, r.max_prompt_len, r.group_size)

    def steps(self, n: int) -> list[StepTiming]:
        """Runs n full steps through the scheduler; returns their timings."""
        timings = []
        for _ in range(n):
            result = self.runner.step(self._batch())
            self._buffer = result.buffer
            timings.append(result.timing)
        return timings

    def model_mfcs(self) -> list[str]:
        """Model MFC names in dispatch order."""
        graph = self.spec.graph
        order = self.runner.scheduler.dispatch_order(set(graph.dataset_keys))
        return [n for n in order if not graph.mfc(n).host]

    def time_round(self) -> dict[str, Timing]:
        """Each model MFC once, alone, on the last step's buffer (run `steps` first)."""
        if self._buffer is None:
            raise ValueError("run at least one step (it compiles) before timing MFCs")
        executors = self.runner.scheduler.executors
        times = {}
        for name in self.model_mfcs():
            counters = self.runner.runtimes[self.spec.graph.mfc(name).role].counters
            moved = counters.realloc_seconds + counters.offload_seconds
            start = time.perf_counter()
            _block(executors[name](self._buffer))
            seconds = time.perf_counter() - start
            moved = counters.realloc_seconds + counters.offload_seconds - moved
            times[name] = Timing(name, (seconds,), (moved,))
        return times

    def time_offloads(self) -> dict[Role, Timing]:
        """Each frozen model's parameters to host memory and back, once (whether or not the
        config offloads them), as `Timing`s named "offload:ROLE"."""
        times = {}
        for role, runtime in self.runner.runtimes.items():
            if runtime.trainable:
                continue
            params = runtime.params
            host, out = offload_to_host(params, free_source=False)
            back, into = onload(host)
            jax.block_until_ready(back)
            seconds = out.seconds + into.seconds
            times[role] = Timing(f"offload:{role.value}", (seconds,), (0.0,))
        return times

    def time_rounds(self, rounds: int) -> tuple[dict[str, Timing], dict[Role, Timing]]:
        """(MFC name -> Timing, frozen role -> offload Timing) over `rounds` rounds.

        Each round goes over all MFCs in dispatch order, so slow drifts of a shared machine
        spread over every MFC instead of biasing one.
        """
        if rounds < 1:
            raise ValueError(f"rounds must be >= 1, got {rounds}")
        times, offloads = self.time_round(), self.time_offloads()
        for _ in range(rounds - 1):
            times, offloads = merge(times, self.time_round()), merge(offloads,
                                                                     self.time_offloads())
        return times, offloads

    def compiled(self, name: str) -> list[jax.stages.Compiled]:
        """The executables MFC `name` compiled so far (one per shape bucket)."""
        return compile_cache_of(self.runner.engines[name]).executables()

    def close(self) -> None:
        self.runner.close()


@contextlib.contextmanager
def live_run(config: ConfigDict, seed: int = 0) -> Iterator[LiveRun]:
    """A `LiveRun` with its reward pools and a scratch directory for the built-in task's data."""
    with tempfile.TemporaryDirectory(prefix="jaxrlhf-measure-") as workdir:
        job = check_config(config, workdir)
        with build.host_pools(job.spec) as pools:
            run = LiveRun(job, pools, seed)
            try:
                yield run
            finally:
                run.close()
