"""The RL job: data, optional supervised warm start, evaluation, the RL loop, reports.

`run(job)` prints a progress bar, writes metrics.jsonl, TensorBoard events and per-step
timelines to the workdir, and returns a summary (accuracy before/after, seconds) that the entry
point prints as its last line. A workdir that holds checkpoints resumes from the latest (no warm
start, no 'before' evaluation: both are in the checkpoint) and repeats the uninterrupted run's
steps exactly; one that holds only warm-start checkpoints resumes the warm start
(`run/warm_start.py`).
"""

from __future__ import annotations

import dataclasses
import time

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
from jaxrlhf.run.evaluate import greedy_accuracy as greedy_accuracy  # offline.py's import
from jaxrlhf.run.runner import Runner
from jaxrlhf.run.warm_start import WarmStart


def restore(job: Job, checkpoints: checkpoint.Checkpointer):
    """The newest intact checkpoint (host state, model states on this run's layouts, which may
    differ from the layouts it was saved from), or None; damaged newer ones are skipped."""
    spec = job.spec
    targets = {role: checkpoint.abstract_state(model, job.plan.home(spec.graph, role),
                                               spec.optimizers.get(role))
               for role, model in spec.model_configs().items()}
    return checkpoints.restore_intact(targets)


def resumed_runner(job: Job, host: checkpoint.HostState, states: dict, pools) -> Runner:
    """The runner continuing checkpoint `host.step` from its restored model `states`."""
    runner = build.runner(job, states, pools)
    runner.restore(host.runner)
    return runner


@dataclasses.dataclass
class LoopResult:
    timings: list
    interrupted: bool  # stopped by Ctrl-C (after saving a checkpoint)
    skipped: int  # steps discarded by nan_policy=skip
    extra: dict = dataclasses.field(default_factory=dict)  # more figures for the summary line


def postfix(algorithm, metrics: dict) -> dict[str, str]:
    """The progress bar's figures: the algorithm's shown metrics, by their last name part."""
    return {key.rsplit("/", 1)[-1]: f"{metrics[key]:.3f}" for key in algorithm.shown}


def rl_loop(job: Job, runner: Runner, prompts, writer, checkpoints: checkpoint.Checkpointer,
            acc_before: float | None, held_out: HeldOut | None = None,
            evaluation_before: dict[str, float] | None = None) -> LoopResult:
    """RL steps from the runner's step index to spec.steps, with checkpoints and guards, and
    the held-out evaluation every `eval.every` steps (its eval/* metrics join the step's)."""
    spec, r = job.spec, job.spec.rollout
    guard = checkpoint.NanGuard(spec.nan_policy, checkpoints)
    save = lambda: checkpoint.save_run(checkpoints, runner, prompts, acc_before, spec.config_json,
                                       job.fingerprint, evaluation_before)
    timings = []
    bar = tqdm(range(runner.step_index, spec.steps), desc=f"{runner.algorithm.name}",
               initial=runner.step_index, total=spec.steps, mininterval=1)
    with checkpoint.StopRequest() as stop:
        for step in bar:
            batch = prompt_batch(next(prompts), job.tokenizer, r.max_prompt_len, r.group_size)
            before = guard.before_step(runner)
            result = runner.step(batch)
            if guard.after_step(runner, result.metrics, step, before):
                result.metrics["nan_skipped"] = 1.0
            tokens = result.metrics["actor/response_length"] + r.max_prompt_len
            result.metrics["throughput/tokens_per_second"] = (
                tokens * r.rows / result.timing.seconds)
            if held_out is not None and held_out.due(step + 1):
                actor = runner.runtimes[Role.ACTOR]
                result.metrics.update(held_out.periodic(
                    actor.params_on(held_out.layout), step + 1, runner.runtimes.get(Role.REWARD)))
            writer.write(step, result.metrics)
            timings.append(result.timing)
            bar.set_postfix(postfix(runner.algorithm, result.metrics))
            if step in (0, spec.steps - 1) and jax.process_index() == 0:
                draw_timeline(result.timing, job.plan.specs,
                              str(job.workdir / f"timeline_{step}.png"))
            if checkpoint.save_if_due(checkpoints, stop, step + 1, save, "RL"):
                return LoopResult(timings, True, guard.skipped)
    save()
    return LoopResult(timings, False, guard.skipped)


def _shown(metrics: dict[str, float]) -> str:
    """The held-out figures of a summary line, e.g. "accuracy 0.250, reward 0.250"."""
    shown = [f"{k} {metrics[k]:.3f}" for k in ("accuracy", "reward") if k in metrics]
    return ", ".join(shown) or "nothing to score (no held-out rows)"


def run(job: Job) -> dict:
    """The whole RL job; returns the summary dict printed as the last line."""
    start = time.perf_counter()
    spec, plan, workdir = job.spec, job.plan, job.workdir
    data = build.load_data(spec, workdir, job.tokenizer)
    checkpoints = checkpoint.Checkpointer(workdir / checkpoint.CHECKPOINT_DIR, spec.checkpoint)
    restored = restore(job, checkpoints)
    resume = None if restored is None else restored[0]
    home, gen_layout = plan.home(spec.graph, Role.ACTOR), plan.layouts["actor_gen"]
    warm = WarmStart(job, home, data) if resume is None else None
    # Records a killed run logged past the checkpoint this run resumes go (all of a fresh one).
    checkpoint.trim_metrics(workdir / METRICS_FILE, 0 if resume is None else resume.step,
                            warm.start_step if warm is not None else None)
    if resume is not None:
        print(f"resuming from checkpoint {resume.step} in {checkpoints.directory}", flush=True)
    with MetricsWriter(workdir) as writer:
        held_out = HeldOut(job, gen_layout, data.eval)
        evaluate = lambda runner: held_out.greedy(
            build.frozen_copy(runner.runtimes[Role.ACTOR].params, spec.base.config, gen_layout),
            runner.runtimes.get(Role.REWARD))
        if resume is None:
            try:
                params = warm.run(lambda: build.initial_actor_params(spec, home), writer)
            finally:
                warm.close()
            if params is None:  # stopped in the warm start, its checkpoint saved
                checkpoints.close()
                held_out.close()
                return {"accuracy_before": None, "accuracy_after": None,
                        "seconds": time.perf_counter() - start, "steps": spec.steps,
                        "workdir": str(workdir), "resumed_from": None, "interrupted": True}
        prompts = datasets.EpochIterator(data.train, spec.rollout.batch_size, seed=spec.seed)
        with build.host_pools(spec) as pools:
            if resume is None:
                runner = build.fresh_runner(job, pools, params)
                before = evaluate(runner)  # the runner holds the reward model, if there is one
            else:
                runner = resumed_runner(job, resume, restored[1], pools)
                prompts.restore(resume.iterator)
                before = dict(resume.evaluation_before) or (
                    {} if resume.accuracy_before is None
                    else {"accuracy": resume.accuracy_before})
            print(f"held-out before RL: {_shown(before)}", flush=True)
            try:
                # async_rl.max_staleness > 0: generation runs ahead (run/async_loop.py)
                loop_fn = async_loop.rl_loop if spec.async_rl.enabled else rl_loop
                loop = loop_fn(job, runner, prompts, writer, checkpoints, before.get("accuracy"),
                               held_out, before)
            finally:
                runner.close()
                checkpoints.close()  # waits for background writes
            after = None if loop.interrupted else evaluate(runner)
        held_out.close()
    if after is not None:
        print(f"held-out after RL:  {_shown(after)}")
    print(time_table(loop.timings[1:] or loop.timings, plan.specs))
    return {"accuracy_before": before.get("accuracy"),
            "accuracy_after": None if after is None else after.get("accuracy"),
            "reward_before": before.get("reward"),
            "reward_after": None if after is None else after.get("reward"),
            "seconds": time.perf_counter() - start, "steps": spec.steps,
            "workdir": str(workdir), "recompiles": runner.compiles,
            "resumed_from": None if resume is None else resume.step,
            "interrupted": loop.interrupted, "skipped_steps": loop.skipped, **loop.extra}
