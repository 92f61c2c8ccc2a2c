"""The RL job: data, optional supervised warm start, evaluation, the RL loop, reports.

`run(job)` prints a progress bar, writes metrics.jsonl, TensorBoard events and per-step
timelines to the workdir, and returns a summary (accuracy before/after, seconds) that the entry
point prints as its last line. A workdir that holds checkpoints resumes from the latest (no warm
start, no 'before' evaluation: both are in the checkpoint) and repeats the uninterrupted run's
steps exactly.
"""

from __future__ import annotations

import dataclasses
import time

import jax
import numpy as np
from tqdm import tqdm

from jaxrlhf import checkpoint
from jaxrlhf.algorithms import sft
from jaxrlhf.data import datasets
from jaxrlhf.data.encode import prompt_batch, sft_batch
from jaxrlhf.data.rewards import exact_match
from jaxrlhf.data.tokenizer import decode_response
from jaxrlhf.dataflow.graph import build_graph
from jaxrlhf.dataflow.runtime import ModelRuntime
from jaxrlhf.dataflow.timeline import draw_timeline, time_table
from jaxrlhf.engine.generate import make_generate_fn
from jaxrlhf.engine.microbatch import num_microbatches
from jaxrlhf.engine.train_step import create_train_state
from jaxrlhf.metrics import MetricsWriter
from jaxrlhf.mfc import Role
from jaxrlhf.parallel.layout import Layout
from jaxrlhf.parallel.reshard import fetch
from jaxrlhf.run import build
from jaxrlhf.run.check import Job
from jaxrlhf.run.layouts import single
from jaxrlhf.run.runner import Runner


def accuracy(generator, params, rows, tokenizer, max_prompt_len: int, dp: int) -> float:
    """Greedy exact-match accuracy on `rows` (padded to a multiple of the dp size)."""
    padded = list(rows) + list(rows[: (-len(rows)) % dp])
    batch = prompt_batch(padded, tokenizer, max_prompt_len)
    out = generator(params, batch["prompt_tokens_bp"], batch["prompt_mask_bp"],
                    jax.random.key(0))
    response_bn = fetch(out.response_bn)[: len(rows)]  # every process scores all rows
    hits = [exact_match(r.prompt, decode_response(tokenizer, ids.tolist()), r.answer)
            for r, ids in zip(rows, response_bn)]
    return float(np.mean(hits))


def greedy_accuracy(job: Job, layout: Layout, rows):
    """params -> greedy exact-match accuracy of the actor on `rows`, generating on `layout`."""
    spec = job.spec
    r = spec.rollout
    greedy = make_generate_fn(spec.base.config, r.generate(job.tokenizer, greedy=True), layout,
                              prompt_buckets=(r.max_prompt_len,))
    return lambda params: accuracy(greedy, params, rows, job.tokenizer, r.max_prompt_len,
                                   layout.dp_size)


def warm_start(job: Job, layout: Layout, params, data: build.Data, writer):
    """Supervised fine-tuning of the actor through the same runner, before training."""
    spec, w = job.spec, job.spec.warm_start
    if w.steps == 0 or not data.sft:
        return params
    algorithm = sft.make()
    r = spec.rollout
    micro = num_microbatches(spec.micro, w.batch_size, r.seq_len, layout.dp_size)
    plan = single("actor_train", layout, micro)
    runtime = ModelRuntime(Role.ACTOR, spec.base.config, layout,
                           state=create_train_state(params, spec.base.config, layout,
                                                    w.optimizer))
    engines = {"actor_train": build.engine_call(
        algorithm.mfcs[0], spec.base.config, layout, micro, r, job.tokenizer, algorithm,
        w.optimizer)}
    runner = Runner(algorithm, build_graph(algorithm.mfcs), plan, {Role.ACTOR: runtime},
                    engines, job.tokenizer, {}, spec.seed)
    rows = datasets.EpochIterator(data.sft, w.batch_size, seed=spec.seed)
    for step in tqdm(range(w.steps), desc="warm start (SFT)", mininterval=2):
        batch = sft_batch(next(rows), job.tokenizer, r.max_prompt_len, r.max_new_tokens)
        result = runner.step(batch)
        writer.write(step, {f"sft/{k}": v for k, v in result.metrics.items()
                            if k.startswith("actor/")})
    runner.close()
    return runtime.state.params


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


def postfix(algorithm, metrics: dict) -> dict[str, str]:
    """The progress bar's figures: the algorithm's shown metrics, by their last name part."""
    return {key.rsplit("/", 1)[-1]: f"{metrics[key]:.3f}" for key in algorithm.shown}


def rl_loop(job: Job, runner: Runner, prompts, writer, checkpoints: checkpoint.Checkpointer,
            acc_before: float) -> LoopResult:
    """RL steps from the runner's step index to spec.steps, with checkpoints and guards."""
    spec, r = job.spec, job.spec.rollout
    guard = checkpoint.NanGuard(spec.nan_policy, checkpoints)
    save = lambda: checkpoint.save_run(checkpoints, runner, prompts, acc_before, spec.config_json,
                                       job.fingerprint)
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
            writer.write(step, result.metrics)
            timings.append(result.timing)
            bar.set_postfix(postfix(runner.algorithm, result.metrics))
            if step in (0, spec.steps - 1) and jax.process_index() == 0:
                draw_timeline(result.timing, job.plan.specs,
                              str(job.workdir / f"timeline_{step}.png"))
            stopping = stop.agreed()
            if checkpoints.cfg.due(step + 1) or stopping:
                save()
            if stopping:
                checkpoints.wait()
                print(f"interrupted after RL step {step}: checkpoint {step + 1} saved in "
                      f"{checkpoints.directory}; run the same command again to resume",
                      flush=True)
                return LoopResult(timings, True, guard.skipped)
    save()
    return LoopResult(timings, False, guard.skipped)


def run(job: Job) -> dict:
    """The whole RL job; returns the summary dict printed as the last line."""
    start = time.perf_counter()
    spec, plan, workdir = job.spec, job.plan, job.workdir
    data = build.load_data(spec, workdir, job.tokenizer)
    checkpoints = checkpoint.Checkpointer(workdir / checkpoint.CHECKPOINT_DIR, spec.checkpoint)
    restored = restore(job, checkpoints)
    resume = None if restored is None else restored[0]
    if resume is not None and jax.process_index() == 0:  # the process that writes metrics
        checkpoint.trim_metrics(workdir / "metrics.jsonl", resume.step)
    if resume is not None:
        print(f"resuming from checkpoint {resume.step} in {checkpoints.directory}", flush=True)
    home, gen_layout = plan.home(spec.graph, Role.ACTOR), plan.layouts["actor_gen"]
    with MetricsWriter(workdir) as writer:
        on_gen = greedy_accuracy(job, gen_layout, data.eval)
        evaluate = lambda p: on_gen(build.frozen_copy(p, spec.base.config, gen_layout))
        if resume is None:
            params = warm_start(job, home, build.initial_actor_params(spec, home), data, writer)
            acc_before = evaluate(params)
        else:
            acc_before = resume.accuracy_before
        print(f"held-out accuracy before RL: {acc_before:.3f}", flush=True)
        prompts = datasets.EpochIterator(data.train, spec.rollout.batch_size, seed=spec.seed)
        with build.host_pools(spec) as pools:
            if resume is None:
                runner = build.fresh_runner(job, pools, params)
            else:
                runner = resumed_runner(job, resume, restored[1], pools)
                prompts.restore(resume.iterator)
            try:
                loop = rl_loop(job, runner, prompts, writer, checkpoints, acc_before)
            finally:
                runner.close()
                checkpoints.close()  # waits for background writes
        acc_after = None if loop.interrupted else evaluate(runner.runtimes[Role.ACTOR].params)
    if acc_after is not None:
        print(f"held-out accuracy after RL:  {acc_after:.3f}")
    print(time_table(loop.timings[1:] or loop.timings, plan.specs))
    return {"accuracy_before": acc_before, "accuracy_after": acc_after,
            "seconds": time.perf_counter() - start, "steps": spec.steps,
            "workdir": str(workdir), "recompiles": runner.compiles,
            "resumed_from": None if resume is None else resume.step,
            "interrupted": loop.interrupted, "skipped_steps": loop.skipped}
