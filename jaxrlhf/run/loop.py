"""The one training loop: the policy every run shares, fed by a batch source.

The loop owns, once for every run:

  guards       the NaN guard around every update (`guards.NanGuard`, by `nan_policy`), Ctrl-C
               and SIGTERM (`guards.StopRequest`, held from the job's start): the loop stops
               at the first update boundary where its source can stop (before the first
               update, for a signal that came while the job started), saves and says so;
  stops        a reason to stop (a reward function failing too often, the reward pool broken,
               a checkpoint that cannot be written) becomes `Stopped`: the reason and the
               checkpoint a rerun resumes from, which the entry point prints without a
               traceback (`STOPS`);
  checkpoints  on the `checkpoint.every` cadence, when stopped, and at the end;
  evaluation   the periodic held-out evaluation of RL runs (`eval.every`), between updates;
  metrics      an update's record (its figures, the source's, throughput, `nan_skipped`,
               the data rows it trained on) written under the update's number, the progress bar, and the result the
               job's summary line reports (`LoopResult`).

A source (`Source`) only schedules: it makes the next update from batches of its own, through
the loop's `train` (the runner's step inside the NaN guard), and says when it can stop:

  `rl.StepSource`               the synchronous step: the next rows (prompts, or an offline
                                run's training rows) through the runner's whole graph
  `async_loop.LocalSource`      generation in this process runs ahead of training (η)
  `async_procs.RemoteSource`    generation replica processes; this process (0) trains
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import pathlib
from collections.abc import Callable
from typing import Protocol

import jax
from tqdm import tqdm

from jaxrlhf import checkpoint
from jaxrlhf.data.datasets import EpochIterator
from jaxrlhf.data.rewards import RewardPoolError
from jaxrlhf.dataflow.executors import HostFunctionError
from jaxrlhf.mfc import Role
from jaxrlhf.run.check import Job
from jaxrlhf.run.evaluate import HeldOut
from jaxrlhf.run.guards import NanGuard, StopRequest
from jaxrlhf.run.runner import Runner, StepResult

Train = Callable[[dict], tuple[StepResult, bool]]  # batch -> (its step's figures, discarded)

# A batch's key: its rows' indices in the training data (`EpochIterator.indices`), which every
# source adds where it draws the batch; the update that trains the batch logs them (`rows`).
ROWS = "data_rows_b"


@dataclasses.dataclass
class LoopResult:
    """How the loop ended (`train`'s result).

    Attributes:
      timings: the steps' schedules (StepTiming), in order.
      interrupted: stopped by Ctrl-C/SIGTERM (after saving a checkpoint).
      skipped: steps discarded by nan_policy=skip.
      extra: more figures for the job's summary line.
    """

    timings: list
    interrupted: bool
    skipped: int
    extra: dict = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class Update:
    """One update a source made through the loop's `train`.

    Attributes:
      result: its step's figures.
      skipped: discarded by the NaN guard (nan_policy=skip).
      seconds: the time the update stands for (throughput's denominator): a synchronous step's
        own; an asynchronous update's window since the previous update ended.
      figures: the source's own metrics for the update's record (async/*).
    """

    result: StepResult
    skipped: bool
    seconds: float
    figures: dict[str, float] = dataclasses.field(default_factory=dict)


class Source(Protocol):
    """Where a loop's updates come from: its own scheduling, nothing of the loop's policy.

    Attributes:
      runner: the runner whose updates are trained and checkpointed (its step index is the
        number of updates done).
      rows: the iterator checkpointed with it (where the next batch's rows come from).
      desc: the progress bar's label.
    """

    runner: Runner
    rows: EpochIterator
    desc: str

    def next_update(self, train: Train, stop: StopRequest) -> Update | None:
        """The next update, trained by `train`; None when a stop was asked and the source has
        nothing more it must train first (the loop then saves and stops)."""

    def stop_now(self, stop: StopRequest) -> bool:
        """After an update: whether the loop stops here (a stop was asked and the source can
        stop at this boundary; it may drop work it has not trained, and rewind `rows`)."""

    def save(self, write: Callable[[], object]) -> None:
        """Writes the checkpoint through `write` (after telling other processes, if any)."""

    def close(self, interrupted: bool) -> dict:
        """After the loop: the summary's figures of the source (async: staleness, tokens/s)."""


def name(job: Job) -> str:
    """What the job's messages call its training ("RL", or the offline algorithm's name)."""
    return job.spec.algorithm.name if job.spec.algorithm.offline else "RL"


def tokens(job: Job, result: StepResult) -> float:
    """Prompt and response tokens of an RL step's batch (responses of their mean length)."""
    r = job.spec.rollout
    return (result.stats[Role.ACTOR]["response_length"] + r.max_prompt_len) * r.rows


def save(job: Job, checkpoints: checkpoint.Checkpointer, runner: Runner, rows: EpochIterator,
         evaluation_before: dict[str, float]) -> bool:
    """Checkpoints `runner` after its last update with `rows`' position (every process of a
    multi-process run calls it: the save is collective)."""
    return checkpoint.save_run(checkpoints, runner, rows, evaluation_before,
                               job.spec.config_json, job.fingerprint)


def train(job: Job, source: Source, writer, checkpoints: checkpoint.Checkpointer,
          evaluation_before: dict[str, float], held_out: HeldOut | None = None, *,
          what: str = "", prefix: str = "") -> LoopResult:
    """Updates from the source's runner's step index to spec.steps, with the loop's policy
    (module docstring).

    Args:
      job: the checked job.
      source: where the updates come from.
      writer: the metrics sink (`write(step, record)`).
      checkpoints: the run's checkpoints (cadence, directory).
      evaluation_before: the held-out figures before training (kept in every checkpoint).
      held_out: the periodic held-out evaluation of RL runs (`eval.every`), or None.
      what: the loop's name in messages (default `name(job)`: "RL", "sft", ...).
      prefix: goes before every metric name (the warm start's "sft/").
    """
    spec, runner, what = job.spec, source.runner, what or name(job)
    guard = NanGuard(spec.nan_policy, checkpoints, what)

    def train_step(batch: dict) -> tuple[StepResult, bool]:
        step, saved = runner.step_index, guard.before_step(runner)
        result = runner.step(batch)
        return result, guard.after_step(runner, result.metrics, step, saved)

    write = lambda: save(job, checkpoints, runner, source.rows, evaluation_before)
    timings = []
    bar = tqdm(desc=source.desc, initial=runner.step_index, total=spec.steps, mininterval=1)
    # The bar ends its line first, however the loop ends: a reason to stop goes on lines of
    # its own.
    with StopRequest() as stop, _stops_named(what, runner, checkpoints), bar:
        # A stop asked before the first update (while restoring, compiling, evaluating) saves
        # what there is (a resumed run's checkpoint exists already) and stops at once.
        interrupted = source.stop_now(stop)
        while not interrupted and runner.step_index < spec.steps:
            update = source.next_update(train_step, stop)
            if update is not None:
                writer.write(runner.step_index - 1,
                             {prefix + k: v for k, v in _record(job, runner, update,
                                                                held_out).items()})
                timings.append(update.result.timing)
                bar.update(1)
                bar.set_postfix(update.result.postfix(runner.algorithm.shown))
            interrupted = update is None or source.stop_now(stop)
            if checkpoints.cfg.due(runner.step_index) and not interrupted:
                source.save(write)
        bar.close()  # (a second close does nothing)
        source.save(write)  # (one that exists already is not written again)
        checkpoints.wait()
    if interrupted:
        done = runner.step_index
        where = f"after {what} step {done - 1}" if done else f"before {what} step 0"
        print(f"interrupted {where}: checkpoint {done} saved in {checkpoints.directory}; run "
              "the same command again to resume", flush=True)
    return LoopResult(timings, interrupted, guard.skipped, source.close(interrupted))


class Stopped(RuntimeError):
    """The run stopped for a reason (a reward function failing, a checkpoint that cannot be
    written): the message names the reason and what stays saved; the entry point prints it
    as it is, without a traceback."""


# What ends a run for a reason, not a bug: the entry point prints the message, no traceback.
# (`Stopped` inside the loop; the others where they come outside it, e.g. a held-out
# evaluation's reward pool.)
STOPS = (Stopped, checkpoint.NonFiniteError, checkpoint.CheckpointWriteError, HostFunctionError,
         RewardPoolError)


@contextlib.contextmanager
def _stops_named(what: str, runner: Runner, checkpoints: checkpoint.Checkpointer):
    """Turns a failure that stops the run for a reason (the step's reward function failing too
    often, the reward pool broken, a checkpoint that cannot be written) into `Stopped`, naming
    the step and the checkpoint a rerun resumes from. (The NaN guard's NonFiniteError says
    both already.)"""
    try:
        yield
    except (HostFunctionError, RewardPoolError, checkpoint.CheckpointWriteError) as error:
        latest = checkpoints.latest_saved()
        kept = (f"no {what} checkpoint was saved (a rerun starts {what} afresh)"
                if latest is None else
                f"a rerun resumes from checkpoint {latest} in {checkpoints.directory}")
        reason = " ".join(str(error).split())
        raise Stopped(f"{what} step {runner.step_index}: {reason}\n{kept}") from None


def _record(job: Job, runner: Runner, update: Update, held_out: HeldOut | None) -> dict:
    """An update's metrics: the step's figures, the source's, `nan_skipped`, the rows it trained
    on (`rows`, where its batch says: `ROWS`); an RL update's throughput and, every
    `eval.every` updates, the held-out evaluation (eval/*)."""
    record = {**update.result.metrics, **update.figures}
    if ROWS in update.result.buffer:
        record["rows"] = [int(i) for i in update.result.buffer[ROWS]]
    if update.skipped:
        record["nan_skipped"] = 1.0
    if job.spec.algorithm.offline:
        return record
    record["throughput/tokens_per_second"] = tokens(job, update.result) / update.seconds
    done = runner.step_index
    if held_out is not None and held_out.due(done):
        actor = runner.runtimes[Role.ACTOR]
        record.update(held_out.periodic(actor.params_on(held_out.layout), done,
                                        runner.runtimes.get(Role.REWARD)))
    return record


def trim_metrics(path: pathlib.Path, step: int, warm_start_step: int | None = None) -> None:
    """Drops the records a resumed run writes again from a metrics.jsonl, before it runs.

    A killed run may have logged steps past its latest checkpoint; the resumed run repeats
    them. Kept: training records of steps before `step`, warm-start records (every key
    `sft/...`) of warm-start steps before `warm_start_step` (None: all of them, the warm start
    is over), and nothing half-written. A run starting afresh passes (0, 0): the file is
    emptied. Process 0 rewrites the file (a shared workdir has one).
    """
    if not path.exists() or jax.process_index() != 0:
        return
    kept = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue  # the last line of a run killed mid-write
        if all(k == "step" or k.startswith("sft/") for k in record):  # the warm start's
            keep = warm_start_step is None or record["step"] < warm_start_step
        else:
            keep = record["step"] < step
        if keep:
            kept.append(line)
    tmp = path.with_suffix(".jsonl.tmp")
    tmp.write_text("".join(f"{line}\n" for line in kept), encoding="utf-8")
    os.replace(tmp, path)
