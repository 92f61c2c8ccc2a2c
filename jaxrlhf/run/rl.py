"""The training job, RL or offline: data, optional supervised warm start, held-out evaluation,
the training loop (`run/loop.py`, fed by the synchronous `StepSource` here or, with
`async_rl.max_staleness` > 0, by an asynchronous source), reports.

`run(job)` prints a progress bar, writes metrics.jsonl, TensorBoard events (and a W&B run when
`logging.wandb.project` is set) and (RL) per-step timelines to the workdir, and returns a summary (held-out figures before/after, seconds) that
the entry point prints as its last line. RL steps generate from prompts; offline steps (SFT,
reward modelling, DPO) train on a fixed dataset, preference pairs batched as chosen rows then
rejected rows (`algorithms.pairs`), and report what the algorithm's `Evaluation` says
(`run/evaluate.py`). `python -m jaxrlhf.export` writes the trained model as a Hugging Face
directory.

The warm start (`warm_start.sft_steps` > 0) fine-tunes the actor on the SFT rows first: a job of
its own (`Job.warm_start`) stepped by the same loop, with its own optimizer and checkpoints in
`workdir/checkpoints/warm_start/<steps done>/` (saved on the `checkpoint.every` cadence, when
asked to stop, and at its end).

A stop signal (SIGTERM, Ctrl-C) at any time from the job's start ends it with a checkpoint
(`guards.StopRequest`, held for the whole job): the loop stops at its next boundary and saves.

A workdir that holds checkpoints resumes from the newest intact one (no warm start, no
'before' evaluation: both are in the checkpoint) and repeats the uninterrupted run's steps
exactly; one that holds only warm-start checkpoints resumes the warm start (one at its end: it
is skipped) and then goes on as the uninterrupted run did.
"""

from __future__ import annotations

import contextlib
import json
import time

import jax
import numpy as np

from jaxrlhf import checkpoint
from jaxrlhf.algorithms.spec import BatchKind
from jaxrlhf.data.datasets import EpochIterator
from jaxrlhf.data.encode import preference_batch, prompt_batch, sft_batch
from jaxrlhf.dataflow.timeline import draw_timeline, time_table
from jaxrlhf.engine.rollout.scheduler import Abandoned
from jaxrlhf.metrics import METRICS_FILE, MetricsWriter
from jaxrlhf.mfc import Role
from jaxrlhf.run import async_loop, build, loop
from jaxrlhf.run.check import Job
from jaxrlhf.run.evaluate import HeldOut, evaluator
from jaxrlhf.run.guards import StopRequest
from jaxrlhf.run.runner import Runner


@contextlib.contextmanager
def begin(job: Job):
    """(the run's `build.JobStart`, its warm start's (`Job.warm_start`; None when the run resumes
    or has none)).

    Drops the records of metrics.jsonl that the run writes again (all of them when it starts
    afresh, but those of the warm-start steps its checkpoint keeps). Leaving the context closes
    the checkpoints (waits for background writes)."""
    metrics = job.workdir / METRICS_FILE
    with build.start(job, job.workdir / checkpoint.CHECKPOINT_DIR) as start:
        if start.resume is not None:
            print(f"resuming from checkpoint {start.step} in {start.checkpoints.directory}",
                  flush=True)
            loop.trim_metrics(metrics, start.step)
            yield start, None
            return
        if job.warm_start is None:
            loop.trim_metrics(metrics, 0, 0)
            yield start, None
            return
        directory = job.workdir / checkpoint.CHECKPOINT_DIR / checkpoint.WARM_START_DIR
        with build.start(job.warm_start, directory) as warm:
            loop.trim_metrics(metrics, 0, warm.step)
            yield start, warm


def _warm_started(start: build.JobStart, writer):
    """The actor's parameters after the warm start (from its `start`), or None when it was
    stopped (its checkpoint saved: the rerun goes on from it)."""
    where = start.checkpoints.directory
    if start.step >= start.job.spec.steps:
        print(f"the warm start is done: its checkpoint {start.step} in {where}", flush=True)
        return start.states.pop(Role.ACTOR).params  # not kept: its optimizer state goes
    if start.resume is not None:
        print(f"resuming the warm start from checkpoint {start.step} in {where}", flush=True)
    runner = start.runner({})
    with contextlib.closing(runner):
        result = rl_loop(start.job, runner, start.rows(), writer, start.checkpoints, {},
                         what="warm-start", prefix="sft/")
    start.checkpoints.wait()  # its saves on disk before the run goes on
    return None if result.interrupted else runner.runtimes[Role.ACTOR].state.params


def encode(job: Job, rows: list) -> dict[str, np.ndarray]:
    """One batch of training rows in the runner's keys, by what the algorithm's steps are fed."""
    r, tokenizer = job.spec.rollout, job.tokenizer
    match job.spec.algorithm.batches:
        case BatchKind.PROMPTS:
            return prompt_batch(rows, tokenizer, r.max_prompt_len, r.group_size)
        case BatchKind.SFT_ROWS:
            return sft_batch(rows, tokenizer, r.max_prompt_len, r.max_new_tokens)
        case BatchKind.PAIRS:
            return preference_batch(rows, tokenizer, r.max_prompt_len, r.max_new_tokens)


class StepSource:
    """The synchronous source (`loop.Source`): each update runs the runner's whole graph on the
    next rows (RL: generated in the step from prompts; offline: the training rows); RL draws
    the first and last steps' timelines."""

    def __init__(self, job: Job, runner: Runner, rows: EpochIterator):
        self.job, self.runner, self.rows = job, runner, rows
        self.desc = runner.algorithm.name

    def next_update(self, train: loop.Train, stop: StopRequest) -> loop.Update | None:
        """The next step; None when a stop came during its multi-turn rollout (one process):
        the step is abandoned, its environment calls cancelled, and its rows go back to the
        iterator, so the rerun repeats it exactly. (Across processes every step ends: they
        would have to agree on abandoning it mid-rollout.)"""
        step, spec = self.runner.step_index, self.job.spec
        if jax.process_count() == 1:
            self.runner.abandon = lambda: stop.requested
        before = self.rows.state()
        batch = {**encode(self.job, next(self.rows)), loop.ROWS: self.rows.indices(before)}
        try:
            result, skipped = train(batch)
        except Abandoned:
            self.rows.restore(before)
            print(f"{loop.name(self.job)} step {step} abandoned (its environment calls "
                  "cancelled); it runs again on resuming", flush=True)
            return None
        if (not spec.algorithm.offline and step in (0, spec.steps - 1)
                and jax.process_index() == 0):
            draw_timeline(result.timing, self.job.plan.specs,
                          str(self.job.workdir / f"timeline_{step}.png"))
        return loop.Update(result, skipped, result.timing.seconds)

    def stop_now(self, stop: StopRequest) -> bool:
        return stop.agreed()

    def save(self, write) -> None:
        write()

    def close(self, interrupted: bool) -> dict:
        return {}


def rl_loop(job: Job, runner: Runner, rows: EpochIterator, writer,
            checkpoints: checkpoint.Checkpointer, evaluation_before: dict[str, float],
            held_out: HeldOut | None = None, *, what: str = "",
            prefix: str = "") -> loop.LoopResult:
    """The synchronous loop (RL, offline, the warm start): `loop.train` on a `StepSource`;
    arguments as its."""
    return loop.train(job, StepSource(job, runner, rows), writer, checkpoints,
                      evaluation_before, held_out, what=what, prefix=prefix)


def summary(job: Job, t0: float, start: build.JobStart, runner: Runner | None,
            ended: loop.LoopResult | None, before: dict, after: dict | None) -> dict:
    """The job's last line: each held-out figure (accuracy and reward at least) before and
    after training (None where not measured) and how the run went; no runner or loop when the
    warm start was stopped."""
    figures = dict.fromkeys(("accuracy", "reward", *before))
    return {**{f"{k}_{when}": None if m is None else m.get(k)
               for k in figures for when, m in (("before", before), ("after", after))},
            "seconds": time.perf_counter() - t0, "steps": job.spec.steps,
            "workdir": str(job.workdir), "recompiles": runner and runner.compiles,
            "resumed_from": None if start.resume is None else start.resume.step,
            "interrupted": ended is None or ended.interrupted,
            "skipped_steps": ended and ended.skipped, **(ended and ended.extra or {})}


def _shown(metrics: dict[str, float]) -> str:
    """The held-out figures of a summary line, e.g. "reward 0.250, accuracy 0.250"."""
    return (", ".join(f"{k} {v:.3f}" for k, v in metrics.items())
            or "nothing to score (no held-out rows)")


def run(job: Job) -> dict:
    """The whole job; returns the summary dict printed as the last line."""
    t0 = time.perf_counter()
    spec, workdir, offline = job.spec, job.workdir, job.spec.algorithm.offline
    what = loop.name(job)
    # Stop signals are taken from here on: one that comes while restoring, compiling or
    # evaluating stops the loop at its first boundary, with a checkpoint.
    with (StopRequest(), begin(job) as (start, warm),
          MetricsWriter(workdir, spec.wandb, json.loads(spec.config_json)) as writer,
          HeldOut(job) as held_out,
          build.host_pools(spec) as pools):  # offline graphs have no host MFCs
        params = None if warm is None else _warm_started(warm, writer)
        if warm is not None and params is None:  # stopped, its checkpoint saved
            return summary(job, t0, start, None, None, {}, None)
        runner = start.runner(pools, params)
        evaluate = evaluator(job, runner, held_out)
        with contextlib.closing(runner):
            before = (evaluate() if start.resume is None
                      else dict(start.resume.evaluation_before))  # not recomputed
            print(f"held-out before {what}: {_shown(before)}", flush=True)
            # async_rl.max_staleness > 0: generation runs ahead (run/async_loop.py)
            loop_fn = async_loop.rl_loop if spec.async_rl.max_staleness else rl_loop
            ended = loop_fn(job, runner, start.rows(), writer, start.checkpoints, before,
                            held_out)
        after = None if ended.interrupted else evaluate()
        if after is not None and offline:
            writer.write(spec.steps, {f"eval/{k}_{when}": v for when, m in
                                      (("before", before), ("after", after))
                                      for k, v in m.items()})
    if after is not None:
        print(f"held-out after {what}:  {_shown(after)}")
    if not offline:
        print(time_table(ended.timings[1:] or ended.timings, job.plan.specs))
    return summary(job, t0, start, runner, ended, before, after)
