"""The RL job: data, optional supervised warm start, evaluation, the RL loop, reports; and the
beginning and the step loop it shares with the offline job (`run/offline.py`).

`run(job)` prints a progress bar, writes metrics.jsonl, TensorBoard events and per-step
timelines to the workdir, and returns a summary (accuracy before/after, seconds) that the entry
point prints as its last line. A workdir that holds checkpoints resumes from the latest (no warm
start, no 'before' evaluation: both are in the checkpoint) and repeats the uninterrupted run's
steps exactly; one that holds only warm-start checkpoints resumes the warm start
(`run/warm_start.py`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable

import jax
from tqdm import tqdm

from jaxrlhf import checkpoint
from jaxrlhf.data import datasets
from jaxrlhf.data.encode import prompt_batch
from jaxrlhf.dataflow.timeline import draw_timeline, time_table
from jaxrlhf.metrics import METRICS_FILE, MetricsWriter
from jaxrlhf.mfc import Role
from jaxrlhf.run import async_loop, build
from jaxrlhf.run.check import Job
from jaxrlhf.run.evaluate import HeldOut
from jaxrlhf.run.runner import Runner, StepResult
from jaxrlhf.run.warm_start import WarmStart


@dataclasses.dataclass
class Start:
    """Where a run begins (`begin`): its checkpoints, and the newest intact checkpoint (`resume`
    its host state, `states` its model states on this run's layouts) or else the warm start."""

    checkpoints: checkpoint.Checkpointer
    resume: checkpoint.HostState | None
    states: dict | None
    warm: WarmStart | None

    def runner(self, job: Job, writer, pools) -> Runner | None:
        """The run's runner: continuing the checkpoint, else fresh from the (warm-started)
        actor; None when the warm start was stopped (its own checkpoint saved)."""
        if self.resume is not None:
            return build.runner(job, self.states, pools, self.resume.runner)
        params = self.warm.run(writer)
        return None if params is None else build.fresh_runner(job, pools, params)

    def before(self) -> dict[str, float]:
        """The checkpoint's held-out figures from before training."""
        accuracy = self.resume.accuracy_before  # checkpoints that hold only the accuracy
        return dict(self.resume.evaluation_before) or ({} if accuracy is None
                                                       else {"accuracy": accuracy})

    def rows(self, rows: list, job: Job) -> datasets.EpochIterator:
        """Endless batches of `rows` from where the checkpoint left them."""
        out = datasets.EpochIterator(rows, job.spec.rollout.batch_size, seed=job.spec.seed)
        if self.resume is not None:
            out.restore(self.resume.iterator)
        return out


@contextlib.contextmanager
def begin(job: Job):
    """The run's `Start`: opens its checkpoints and restores the newest intact one (damaged
    newer ones are skipped; its layouts may differ from this run's), else prepares the warm
    start; drops the records of metrics.jsonl that the run writes again (all of them when it
    starts afresh). Leaving the context closes the checkpoints (waits for background writes)."""
    spec = job.spec
    checkpoints = checkpoint.Checkpointer(job.workdir / checkpoint.CHECKPOINT_DIR,
                                          spec.checkpoint)
    with contextlib.closing(checkpoints):
        restored = checkpoints.restore_intact({
            role: checkpoint.abstract_state(model, job.plan.home(spec.graph, role),
                                            spec.optimizers.get(role))
            for role, model in spec.model_configs().items()})
        if restored is None:
            # The warm start trains the actor on the trained model's layout (reward modelling
            # then starts its reward model from the actor's trunk).
            warm = WarmStart(job, job.plan.home(spec.graph, spec.algorithm.trained_role))
            checkpoint.trim_metrics(job.workdir / METRICS_FILE, 0, warm.start_step)
            yield Start(checkpoints, None, None, warm)
        else:
            print(f"resuming from checkpoint {restored[0].step} in {checkpoints.directory}",
                  flush=True)
            checkpoint.trim_metrics(job.workdir / METRICS_FILE, restored[0].step)
            yield Start(checkpoints, *restored, None)


@dataclasses.dataclass
class LoopResult:
    timings: list
    interrupted: bool  # stopped by Ctrl-C/SIGTERM (after saving a checkpoint)
    skipped: int  # steps discarded by nan_policy=skip
    extra: dict = dataclasses.field(default_factory=dict)  # more figures for the summary line


def train_loop(job: Job, runner: Runner, rows: datasets.EpochIterator, encode: Callable,
               writer, checkpoints: checkpoint.Checkpointer, accuracy_before: float | None,
               evaluation_before: dict[str, float] | None, what: str,
               on_step: Callable[[int, StepResult, dict], None] | None = None) -> LoopResult:
    """Steps from the runner's step index to spec.steps on `encode(next(rows))`, with the NaN
    policy and checkpoints (on the cadence, on Ctrl-C/SIGTERM: the loop `what` stops, and at
    the end); `on_step(step, result, record)` adds figures to a step's record before it is
    written."""
    spec = job.spec
    guard = checkpoint.NanGuard(spec.nan_policy, checkpoints)
    save = lambda: checkpoint.save_run(checkpoints, runner, rows, accuracy_before,
                                       spec.config_json, job.fingerprint, evaluation_before)
    timings = []
    bar = tqdm(range(runner.step_index, spec.steps), desc=runner.algorithm.name,
               initial=runner.step_index, total=spec.steps, mininterval=1)
    with checkpoint.StopRequest() as stop:
        for step in bar:
            batch = encode(next(rows))
            saved = guard.before_step(runner)
            result = runner.step(batch)
            record = result.metrics
            if guard.after_step(runner, record, step, saved):
                record["nan_skipped"] = 1.0
            if on_step is not None:
                on_step(step, result, record)
            writer.write(step, record)
            timings.append(result.timing)
            bar.set_postfix(result.postfix(runner.algorithm.shown))
            if checkpoint.save_if_due(checkpoints, stop, step + 1, save, what):
                return LoopResult(timings, True, guard.skipped)
    save()
    return LoopResult(timings, False, guard.skipped)


def rl_loop(job: Job, runner: Runner, prompts, writer, checkpoints: checkpoint.Checkpointer,
            acc_before: float | None, held_out: HeldOut | None = None,
            evaluation_before: dict[str, float] | None = None) -> LoopResult:
    """RL steps from the runner's step index to spec.steps, with checkpoints and guards, and
    the held-out evaluation every `eval.every` steps (its eval/* metrics join the step's)."""
    spec, r = job.spec, job.spec.rollout

    def on_step(step: int, result: StepResult, record: dict) -> None:
        tokens = result.stats[Role.ACTOR]["response_length"] + r.max_prompt_len
        record["throughput/tokens_per_second"] = tokens * r.rows / result.timing.seconds
        if held_out is not None and held_out.due(step + 1):
            actor = runner.runtimes[Role.ACTOR]
            record.update(held_out.periodic(actor.params_on(held_out.layout), step + 1,
                                            runner.runtimes.get(Role.REWARD)))
        if step in (0, spec.steps - 1) and jax.process_index() == 0:
            draw_timeline(result.timing, job.plan.specs, str(job.workdir / f"timeline_{step}.png"))

    encode = lambda rows: prompt_batch(rows, job.tokenizer, r.max_prompt_len, r.group_size)
    return train_loop(job, runner, prompts, encode, writer, checkpoints, acc_before,
                      evaluation_before, "RL", on_step)


def summary(job: Job, t0: float, start: Start, runner: Runner | None,
            loop: LoopResult | None, before: dict, after: dict | None) -> dict:
    """The job's last line: each held-out figure (accuracy and reward at least) before and
    after training (None where not measured) and how the run went; no runner or loop when the
    warm start was stopped."""
    figures = dict.fromkeys(("accuracy", "reward", *before))
    return {**{f"{k}_{when}": None if m is None else m.get(k)
               for k in figures for when, m in (("before", before), ("after", after))},
            "seconds": time.perf_counter() - t0, "steps": job.spec.steps,
            "workdir": str(job.workdir), "recompiles": runner and runner.compiles,
            "resumed_from": None if start.resume is None else start.resume.step,
            "interrupted": loop is None or loop.interrupted,
            "skipped_steps": loop and loop.skipped, **(loop and loop.extra or {})}


def _shown(metrics: dict[str, float]) -> str:
    """The held-out figures of a summary line, e.g. "accuracy 0.250, reward 0.250"."""
    shown = [f"{k} {metrics[k]:.3f}" for k in ("accuracy", "reward") if k in metrics]
    return ", ".join(shown) or "nothing to score (no held-out rows)"


def run(job: Job) -> dict:
    """The whole RL job; returns the summary dict printed as the last line."""
    t0 = time.perf_counter()
    spec, workdir, gen_layout = job.spec, job.workdir, job.plan.layouts["actor_gen"]
    with (begin(job) as start, MetricsWriter(workdir) as writer,
          HeldOut(job, gen_layout, job.data.eval) as held_out,
          build.host_pools(spec) as pools):
        runner = start.runner(job, writer, pools)
        if runner is None:  # stopped in the warm start, its checkpoint saved
            return summary(job, t0, start, None, None, {}, None)
        # The runner holds the reward model, if there is one.
        evaluate = lambda: held_out.greedy(build.actor_copy(
            runner.runtimes[Role.ACTOR].params, spec.base.config, gen_layout),
            runner.runtimes.get(Role.REWARD))
        with contextlib.closing(runner):
            before = evaluate() if start.resume is None else start.before()
            print(f"held-out before RL: {_shown(before)}", flush=True)
            # async_rl.max_staleness > 0: generation runs ahead (run/async_loop.py)
            loop_fn = async_loop.rl_loop if spec.async_rl.enabled else rl_loop
            loop = loop_fn(job, runner, start.rows(job.data.train, job), writer,
                           start.checkpoints, before.get("accuracy"), held_out, before)
        after = None if loop.interrupted else evaluate()
    if after is not None:
        print(f"held-out after RL:  {_shown(after)}")
    print(time_table(loop.timings[1:] or loop.timings, job.plan.specs))
    return summary(job, t0, start, runner, loop, before, after)
