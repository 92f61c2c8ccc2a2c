"""What both asynchronous sources do around a training step (one process: async_loop.py;
trainer and replica processes: async_procs.py): the trainer's part of the graph, the
checkpoint drain, a batch's staleness metrics, the updates' pace (windows, busy shares, the
summary's figures), the generation/training timeline.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Container

import numpy as np

from jaxrlhf.dataflow.graph import build_graph
from jaxrlhf.dataflow.scheduler import MFCTiming, Scheduler, StepTiming
from jaxrlhf.dataflow.timeline import draw_timeline
from jaxrlhf.run import loop
from jaxrlhf.run.check import Job
from jaxrlhf.run.rollout_worker import Generated
from jaxrlhf.run.runner import Runner, StepResult


def trainer_runner(runner: Runner, gen_name: str) -> Runner:
    """`runner` without its generate call: the trainer's part of the graph, fed finished
    batches. Shares the runner's runtimes, engines and executors."""
    mfcs = [m for m in runner.graph.mfcs if m.name != gen_name]
    graph = build_graph(mfcs)
    trainer = copy.copy(runner)
    trainer.graph = graph
    sched = runner.scheduler
    trainer.scheduler = Scheduler(graph, {n: sched.executors[n] for n in graph.order},
                                  {n: sched.devices[n] for n in graph.order if n in sched.devices})
    return trainer

def drain_limit(trained: int, steps: int, every: int) -> int:
    """The first batch index generation may not start yet: the end of the run or the next
    checkpoint (checkpoints drain the pipeline)."""
    if every <= 0:
        return steps
    return min(steps, (trained // every + 1) * every)


def may_start(index: int, *, version: int, eta: int, next_needed: int,
              finished: Container[int]) -> bool:
    """Whether generation may start batch `index` with weights of `version`: within the
    staleness bound η, and past `next_needed` (the batch the trainer takes next) only while
    that batch is still decoding, to fill the slots its finished rows free. Once it is
    `finished` the trainer is the bottleneck: starting more adds staleness, not throughput."""
    return index <= version + eta and (index <= next_needed or next_needed not in finished)


def check_staleness(done: Generated, version: int, eta: int) -> None:
    """Before batch `done` is trained with weights of `version`: no token of it may be more
    than η versions old (the invariant both schedules keep; module docstrings of
    async_loop.py and async_procs.py)."""
    stale = done.staleness_bn(version).max()
    if stale > eta:
        raise AssertionError(f"batch {done.index}: a token {stale} versions old "
                             f"(async_rl.max_staleness={eta})")


def batch_metrics(done: Generated, version: int, eta: int) -> dict[str, float]:
    """Staleness distribution, interruptions and restarts of the batch trained at `version`
    (with the tokens restarts discarded meanwhile), with its
    generation seconds, its longest response and the decode padding: the share of the
    generation slots' decode steps without a row to decode (`async/decode_padding_frac`; with
    continuous batching a slot waits only when no admitted row is left)."""
    staleness_bn = done.staleness_bn(version)
    valid = staleness_bn >= 0
    tokens = max(int(valid.sum()), 1)
    versions_bn = np.where(valid, done.versions_bn, np.iinfo(np.int32).max)
    newest_bn = np.where(valid, done.versions_bn, -1)
    switched_b = valid.any(1) & (versions_bn.min(1) != newest_bn.max(1))
    out = {"async/staleness_mean": float(staleness_bn[valid].mean()) if valid.any() else 0.0,
           "async/staleness_max": float(staleness_bn[valid].max()) if valid.any() else 0.0,
           "async/interrupted_sequences": float(switched_b.sum()),
           "async/interruptions": float(done.interruptions),
           "async/restarted_rows": float(done.restarts),
           "async/discarded_tokens": float(done.discarded_tokens)}
    for s in range(eta + 1):
        out[f"async/staleness_frac_{s}"] = float((staleness_bn == s).sum()) / tokens
    longest = int(valid.sum(1).max(initial=0))
    out["async/gen_seconds"] = done.seconds[1] - done.seconds[0]
    out["async/response_length_longest"] = float(longest)
    out["async/decode_padding_frac"] = done.slots_idle
    return out


class Pace:
    """The updates of an asynchronous source, one after the other: each update's window (the
    wall time since the previous one ended: its throughput's seconds), the generation and
    training busy shares in it, its batch's staleness figures; and the summary's staleness
    maximum and tokens/s (over the updates after the first, which compiles).

    Args:
      job: the checked job.
      clock: the windows' clock (seconds; the events of the source's timeline use it too).
    """

    def __init__(self, job: Job, clock=time.perf_counter):
        self.job, self.clock = job, clock
        self.last_end, self.busy_marks = clock(), (0.0, 0.0)
        self.staleness_max, self.tokens_windows = 0.0, []

    def update(self, done: Generated, result: StepResult, skipped: bool, version: int,
               gen_busy: float, train_busy: float) -> loop.Update:
        """The update that trained batch `done` with weights of `version` (then version + 1),
        with generation busy `gen_busy` and training `train_busy` seconds so far."""
        window = max(self.clock() - self.last_end, 1e-9)
        self.last_end = self.clock()
        figures = batch_metrics(done, version, self.job.spec.async_rl.max_staleness)
        figures["async/gen_busy"] = (gen_busy - self.busy_marks[0]) / window
        figures["async/train_busy"] = (train_busy - self.busy_marks[1]) / window
        self.busy_marks = (gen_busy, train_busy)
        self.staleness_max = max(self.staleness_max, figures["async/staleness_max"])
        if version > 0:
            self.tokens_windows.append((loop.tokens(self.job, result), window))
        return loop.Update(result, skipped, window, figures)

    def summary(self) -> dict:
        seconds = sum(w for _, w in self.tokens_windows)
        return {"staleness_max": self.staleness_max,
                "tokens_per_second": (sum(t for t, _ in self.tokens_windows) / seconds
                                      if seconds else None)}


def draw_async_timeline(events: list, path: str, specs: dict[str, str]) -> None:
    """The generation and training timeline (one bar per batch and per update) as a PNG: a
    row for generation and one for training, also when they share devices.

    Args:
      events: (name "gen K" or "train K", start, end) on one clock; the first two updates
        (compiles) are left out when there are more.
      path: the PNG.
      specs: "gen" and "train" -> their allocation entries ("0-3:d4@1").
    """
    trained = sorted({int(name.split()[1]) for name, _, _ in events})
    shown = set(trained[2:8] if len(trained) > 4 else trained[:6])
    events = [e for e in events if int(e[0].split()[1]) in shown]
    timings = {name: MFCTiming(name, frozenset(), start=s, ready=e) for name, s, e in events}
    t0 = min(t.start for t in timings.values())
    for t in timings.values():
        t.start, t.ready = t.start - t0, t.ready - t0
    step = StepTiming(timings, {}, max(t.ready for t in timings.values()))
    # draw_timeline makes a row per device group (the entry before ':')
    layouts = {name: f"{kind} {specs[kind]}" for name, _, _ in events
               for kind in ["train" if name.startswith("train") else "gen"]}
    draw_timeline(step, layouts, path)
