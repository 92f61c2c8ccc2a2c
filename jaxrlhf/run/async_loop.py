"""Asynchronous RL (AReaL): generation runs ahead of training, staleness bounded by η.

Two workers share the actor:

  generation (this thread)   decodes the admitted batches' rows in slots that are refilled
                             as rows finish (`engine.rollout`, continuous batching), in
                             chunks, always with the newest weights it has been given;
                             weights that arrive mid-sequence are swapped in (the KV cache is
                             recomputed) and every token records its policy version.
  training (a worker thread) runs the rest of the algorithm's graph (reward, ref/critic
                             inference, π_prox, train steps) on the oldest finished batch,
                             through the same `Runner` as the synchronous loop.

After each update the trainer's actor parameters go to the generation layout through
`parallel.reshard` (one copy per version) and generation continues with them.

Staleness: batch k is trained by update k (policy version k → k+1). Generation may start batch
k only with weights of version ≥ k − η (AReaL's ⌊(N_r − 1)/B⌋ ≤ i + η), so when it is trained
its oldest token is at most η versions old. This is asserted from the per-token versions
before every update. η is a bound, not a target (`async_steps.may_start`): past the batch the
trainer takes next, generation starts another only while that one is still decoding (its freed
slots take the new rows). When generation is faster than training the trainer is the
bottleneck, and running further ahead would only train on older samples (GRPO on
configs/grpo_tiny.py, η = 2: held-out accuracy 0.77 with 90% of tokens 2 versions old; 0.92,
as synchronous, at staleness 1). With η = 0 generation waits for every update and the loop
computes exactly what the synchronous loop computes (same batches, sampling keys and weights).

Checkpoints drain: generation never starts a batch past the next checkpoint step, so when a
checkpoint is written every generated batch is trained and the prompt iterator stands where
the trained batches end, as in the synchronous loop. A stop request (Ctrl-C, SIGTERM) drops the
generated-but-untrained batches and rewinds the iterator to the first of them, so a resumed
run generates them again: no prompt is lost and no sample is trained twice.

Overlap: on accelerators the two workers' programs run at the same time when their devices
are disjoint (`placement.kind=disaggregate`). On a CPU-only machine they share the host's
cores, which either keeps busy alone, so they interleave rather than overlap: on 2 cores their
busy fractions add up to about 1, with generation on a device of its own too (a decode chunk
beside an update slows the update by about as long as the chunk takes). A multi-process launch
(`launch/local.sh 2 ...`) puts generation in a process of its own (jaxrlhf/run/async_procs.py,
also for `placement.gen_replicas` > 1).
"""

from __future__ import annotations

import concurrent.futures
import time

import jax
from tqdm import tqdm

from jaxrlhf import checkpoint
from jaxrlhf.data.encode import prompt_batch
from jaxrlhf.engine.rollout import Rollout
from jaxrlhf.mfc import Call, Role
from jaxrlhf.run import async_procs
from jaxrlhf.run.async_steps import (batch_metrics, drain_limit, draw_async_timeline, may_start,
                                      trainer_runner)
from jaxrlhf.run.check import Job
from jaxrlhf.run.rollout_worker import Generated, RolloutWorker
from jaxrlhf.run.runner import LoopResult, Runner


_DENSE = 0.5  # occupied share of the generation slots worth a decode step beside an update


class _Trainer:
    """The training side: one step at a time in a worker thread."""

    def __init__(self, runner: Runner, guard: checkpoint.NanGuard):
        self.runner, self.guard = runner, guard
        self.pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="async-train")
        self.busy_seconds = 0.0

    def submit(self, done: Generated) -> concurrent.futures.Future:
        def train():
            t0 = time.perf_counter()
            before = self.guard.before_step(self.runner)
            result = self.runner.step(done.buffer)
            skipped = self.guard.after_step(self.runner, result.metrics, done.index, before)
            self.busy_seconds += time.perf_counter() - t0
            return result, skipped, (t0, time.perf_counter())

        return self.pool.submit(train)

    def close(self) -> None:
        self.pool.shutdown(wait=True)

def rl_loop(job: Job, runner: Runner, prompts, writer, checkpoints: checkpoint.Checkpointer,
            evaluation_before: dict[str, float], held_out=None) -> LoopResult:
    """RL steps from the runner's step index to spec.steps, asynchronously (module docstring).

    Args, checkpoints and the periodic held-out evaluation (`held_out`, run between two
    updates) as the synchronous loop (`jaxrlhf.run.rl.rl_loop`). A multi-process job runs
    `async_procs.rl_loop` instead (a trainer process and generation replica processes).
    """
    if jax.process_count() > 1:
        return async_procs.rl_loop(job, runner, prompts, writer, checkpoints,
                                   evaluation_before, held_out)
    if job.spec.placement.gen_replicas > 1:
        raise async_procs.TopologyError(
            f"placement.gen_replicas={job.spec.placement.gen_replicas}: replicas run in "
            f"processes of their own (launch/local.sh {1 + job.spec.placement.gen_replicas} ...)")
    spec, r = job.spec, job.spec.rollout
    eta = spec.async_rl.max_staleness
    (gen,) = [m for m in spec.graph.mfcs if m.role is Role.ACTOR and m.call is Call.GENERATE]
    gen_layout = job.plan.layouts[gen.name]
    trainer_run = trainer_runner(runner, gen.name)
    micro = job.plan.micro_batches(gen.name)
    rollout = Rollout(spec.base.config, r.generate(job.tokenizer), gen_layout, r.max_prompt_len,
                      r.rows // micro)
    worker = RolloutWorker(gen, rollout, gen_layout, spec.base.config, spec.seed,
                           spec.async_rl.chunk_tokens, micro)
    shared_cores = gen_layout.mesh.devices.flat[0].platform == "cpu"  # with the trainer
    actor = runner.runtimes[Role.ACTOR]
    trainer = _Trainer(trainer_run, checkpoint.NanGuard(spec.nan_policy, checkpoints))
    clock_zero = time.perf_counter()
    now = lambda: time.perf_counter() - clock_zero
    version = trained = next_index = trainer_run.step_index
    worker.publish(actor.params, version)
    ready: dict[int, Generated] = {}  # finished batches by index (they finish in any order)
    pending, pending_batch = None, None
    timings, events, tokens_per_s, staleness_max = [], [], [], 0.0
    last_end, busy_marks = now(), (0.0, 0.0)
    bar = tqdm(range(trained, spec.steps), desc=f"{trainer_run.algorithm.name} (async η={eta})",
               initial=trained, total=spec.steps, mininterval=1)
    save = lambda: checkpoint.save_run(checkpoints, trainer_run, prompts, evaluation_before,
                                       spec.config_json, job.fingerprint)
    interrupted = False
    with checkpoint.StopRequest() as stop:
        while trained < spec.steps:
            limit = drain_limit(trained, spec.steps, checkpoints.cfg.every)
            can_start = next_index < limit and may_start(
                next_index, version=worker.version, eta=eta,
                next_needed=trained + (pending is not None), finished=ready)
            # The CPU's cores are the trainer's too: a decode step with most slots idle there
            # only delays the update beside it, so sparse slots decode only when the
            # trainer waits for them (on accelerators generation has devices of its own).
            needed = pending is None and trained not in ready
            sparse = shared_cores and worker.occupancy < _DENSE
            gen_can_work = (can_start and worker.accepts()) or (
                worker.busy and (needed or not sparse))
            if pending is not None and (pending.done() or not gen_can_work):
                result, skipped, (t_start, t_end) = pending.result()
                done, pending = pending_batch, None
                trained = version = version + 1
                worker.publish(actor.params, version)  # interrupts the batch in flight
                window = max(now() - last_end, 1e-9)
                last_end = now()
                m = result.metrics
                m.update(batch_metrics(done, version - 1, eta))
                tokens = (result.stats[Role.ACTOR]["response_length"] + r.max_prompt_len) * r.rows
                m["throughput/tokens_per_second"] = tokens / window
                gen_busy, train_busy = worker.busy_seconds, trainer.busy_seconds
                m["async/gen_busy"] = (gen_busy - busy_marks[0]) / window
                m["async/train_busy"] = (train_busy - busy_marks[1]) / window
                busy_marks = (gen_busy, train_busy)
                if skipped:
                    m["nan_skipped"] = 1.0
                if held_out is not None and held_out.due(trained):  # no update is running
                    m.update(held_out.periodic(actor.params_on(held_out.layout), trained,
                                               runner.runtimes.get(Role.REWARD)))
                staleness_max = max(staleness_max, m["async/staleness_max"])
                if trained > 1:
                    tokens_per_s.append((tokens, window))
                writer.write(done.index, m)
                timings.append(result.timing)
                events += [(f"gen {done.index}", *done.seconds),
                           (f"train {done.index}", t_start - clock_zero, t_end - clock_zero)]
                bar.update(1)
                bar.set_postfix(result.postfix(trainer_run.algorithm.shown))
                stopping = stop.agreed()
                if stopping:
                    _rewind(prompts, ready, worker.drop())
                if checkpoints.cfg.due(trained) or stopping:
                    save()
                if stopping:
                    checkpoints.wait()
                    print(f"interrupted after RL step {trained - 1}: checkpoint {trained} saved "
                          f"in {checkpoints.directory}; run the same command again to resume",
                          flush=True)
                    interrupted = True
                    break
                continue
            if pending is None and trained in ready:  # batch k is trained by update k
                done = ready.pop(trained)
                stale = done.staleness_bn(version).max()
                if stale > eta:  # the throttle's invariant (module docstring)
                    raise AssertionError(f"batch {done.index}: a token {stale} versions old "
                                         f"(async_rl.max_staleness={eta})")
                pending, pending_batch = trainer.submit(done), done
                continue
            if can_start and worker.accepts():
                before = prompts.state()
                batch = prompt_batch(next(prompts), job.tokenizer, r.max_prompt_len,
                                     r.group_size)
                worker.start(next_index, batch, before, now())
                next_index += 1
            elif gen_can_work:
                ready.update((g.index, g) for g in worker.step(now))
            elif pending is None:
                raise AssertionError(f"async loop stalled at step {trained}: nothing to "
                                     "generate or train")
    trainer.close()
    bar.close()
    if not interrupted:
        save()
    if events and jax.process_index() == 0:
        train = [m for m in spec.graph.calls_of(Role.ACTOR) if m.call is Call.TRAIN_STEP][0]
        specs = {"gen": job.plan.specs[gen.name], "train": job.plan.specs[train.name]}
        draw_async_timeline(events, str(job.workdir / "timeline_async.png"), specs)
    seconds = sum(w for _, w in tokens_per_s)
    extra = {"staleness_max": staleness_max,
             "tokens_per_second": sum(t for t, _ in tokens_per_s) / seconds if seconds else None,
             "weights_published_bytes": worker.published_bytes}
    return LoopResult(timings, interrupted, trainer.guard.skipped, extra)


def _rewind(prompts, ready: dict, inflight) -> None:
    """Stop: drop the generated-but-untrained batches (`ready`, and those in flight, the first
    of which `inflight` names: (index, iterator state before it), or None) and rewind the
    prompts to the first of them."""
    firsts = [(g.index, g.iterator_before) for g in ready.values()] + [inflight]
    firsts = [f for f in firsts if f is not None]
    if firsts:
        prompts.restore(min(firsts, key=lambda f: f[0])[1])
    ready.clear()
