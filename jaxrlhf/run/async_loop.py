"""Asynchronous RL (AReaL): generation runs ahead of training, staleness bounded by η.

Two workers share the actor:

  generation (this thread)   decodes one batch of prompts at a time in chunks
                             (`engine.rollout`), always with the newest weights it has been
                             given; weights that arrive mid-sequence are swapped in (the KV
                             cache is recomputed) and every token records its policy version.
  training (a worker thread) runs the rest of the algorithm's graph (reward, ref/critic
                             inference, π_prox, train steps) on the oldest finished batch,
                             through the same `Runner` as the synchronous loop.

After each update the trainer's actor parameters go to the generation layout through
`parallel.reshard` (one copy per version) and generation continues with them.

Staleness: batch k is trained by update k (policy version k → k+1). Generation may start batch
k only with weights of version ≥ k − η (AReaL's ⌊(N_r − 1)/B⌋ ≤ i + η), so when it is trained
its oldest token is at most η versions old. This is asserted from the per-token versions
before every update. With η = 0 generation waits for every update and the loop computes
exactly what the synchronous loop computes (same batches, sampling keys and weights).

Checkpoints drain: generation never starts a batch past the next checkpoint step, so when a
checkpoint is written every generated batch is trained and the prompt iterator stands where
the trained batches end, as in the synchronous loop. A stop request (Ctrl-C, SIGTERM) drops the
generated-but-untrained batches and rewinds the iterator to the first of them, so a resumed
run generates them again: no prompt is lost and no sample is trained twice.

Overlap: on accelerators the two workers' programs run at the same time when their devices
are disjoint (`placement.kind=disaggregate`). XLA's CPU client runs one program at a time, so
on a CPU-only machine the workers interleave rather than overlap.
"""

from __future__ import annotations

import collections
import concurrent.futures
import copy
import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

from jaxrlhf import checkpoint
from jaxrlhf.data.encode import prompt_batch
from jaxrlhf.dataflow.graph import build_graph
from jaxrlhf.dataflow.scheduler import MFCTiming, Scheduler, StepTiming
from jaxrlhf.dataflow.timeline import draw_timeline
from jaxrlhf.engine.rollout import NO_VERSION, InFlight, Rollout
from jaxrlhf.mfc import MFC, Call, Role
from jaxrlhf.models.sizes import abstract_params
from jaxrlhf.parallel.layout import Layout
from jaxrlhf.parallel.reshard import fetch, reshard
from jaxrlhf.run.check import Job
from jaxrlhf.run.runner import Runner


@dataclasses.dataclass
class Generated:
    """A finished batch waiting for the trainer.

    Attributes:
      index: the RL step that trains it (batch k is drawn k-th from the prompt iterator).
      buffer: the trainer graph's dataset keys (prompts, generated sequences, log-probs).
      versions_bn: int32 [b, n] on the host: policy version of every token (NO_VERSION after
        the response).
      interruptions: weight swaps during its generation.
      iterator_before: the prompt iterator's state before the batch was drawn.
      seconds: (start, end) of its generation on the loop's clock.
    """

    index: int
    buffer: dict
    versions_bn: np.ndarray
    interruptions: int
    iterator_before: object
    seconds: tuple[float, float]

    def staleness_bn(self, version: int) -> np.ndarray:
        """Versions behind `version` of every token, -1 where there is none."""
        return np.where(self.versions_bn == NO_VERSION, -1, version - self.versions_bn)


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


class RolloutWorker:
    """The generation side: one batch in flight, the newest weights it was given.

    Args:
      mfc: the actor's generate MFC (its outputs name the generated keys).
      rollout: the interruptible generator on the generation layout.
      layout: the generation layout.
      model: the actor's ModelConfig.
      seed: batch k samples with fold_in(key(seed), k), as the synchronous runner's step k.
      chunk_tokens: tokens decoded between checks for new weights.
    """

    def __init__(self, mfc: MFC, rollout: Rollout, layout: Layout, model, seed: int,
                 chunk_tokens: int):
        self.mfc, self.rollout, self.layout = mfc, rollout, layout
        self.chunk_tokens = chunk_tokens
        self._shardings = layout.param_shardings(abstract_params(model))
        self._rng = jax.random.key(seed)
        self.params, self.version = None, -1
        self.inflight: InFlight | None = None
        self._current: tuple | None = None  # (index, batch dict, iterator state, start time)
        self.busy_seconds = 0.0
        self.published_bytes = 0

    def publish(self, params, version: int) -> None:
        """New weights for generation: a copy of the trainer's parameters on this layout in
        buffers of their own (the trainer's next update donates its own)."""
        moved, stats = reshard(params, self._shardings)
        self.params = jax.tree.map(lambda new, old: jnp.copy(new) if new is old else new, moved,
                                   params)
        self.version = version
        self.published_bytes += stats.bytes_moved

    def start(self, index: int, batch: dict, iterator_before, now: float) -> None:
        t0 = time.perf_counter()
        rng = jax.random.fold_in(self._rng, jax.device_put(np.uint32(index)))
        self.inflight = self.rollout.start(self.params, self.version, batch["prompt_tokens_bp"],
                                           batch["prompt_mask_bp"], rng)
        self._current = (index, batch, iterator_before, now)
        self.busy_seconds += time.perf_counter() - t0

    def step(self, now) -> Generated | None:
        """Decodes one chunk with the newest weights; the batch once it is finished."""
        t0 = time.perf_counter()
        try:
            if not self.rollout.poll(self.inflight):
                self.inflight = self.rollout.advance(self.inflight, self.params, self.version,
                                                     self.chunk_tokens)
                if not self.rollout.poll(self.inflight):
                    return None
            return self._finish(now)
        finally:
            self.busy_seconds += time.perf_counter() - t0

    def _finish(self, now) -> Generated:
        out, versions_bn = self.rollout.finish(self.inflight)
        index, batch, iterator_before, started = self._current
        arrays = (out.sequences_bs, out.sequence_mask_bs, out.response_mask_bn, out.logprobs_bn)
        buffer = {**batch, **dict(zip(self.mfc.outputs, arrays, strict=True))}
        done = Generated(index, buffer, fetch(versions_bn), self.inflight.interruptions,
                         iterator_before, (started, now()))
        self.inflight, self._current = None, None
        return done

    def drop(self):
        """Abandons the batch in flight (a stop: it is generated again after resuming);
        returns the prompt iterator's state before it was drawn, or None."""
        before = None if self._current is None else self._current[2]
        self.inflight, self._current = None, None
        return before


@dataclasses.dataclass
class AsyncLoopResult:
    """As the synchronous loop's result, plus `extra` for the job's summary line."""

    timings: list
    interrupted: bool
    skipped: int
    extra: dict


def _limit(trained: int, steps: int, every: int) -> int:
    """The first batch index generation may not start yet: the end of the run or the next
    checkpoint (checkpoints drain the pipeline)."""
    if every <= 0:
        return steps
    return min(steps, (trained // every + 1) * every)


def _batch_metrics(done: Generated, version: int, eta: int) -> dict[str, float]:
    """Staleness distribution and interruptions of the batch trained at `version`."""
    staleness_bn = done.staleness_bn(version)
    valid = staleness_bn >= 0
    tokens = max(int(valid.sum()), 1)
    versions_bn = np.where(valid, done.versions_bn, np.iinfo(np.int32).max)
    newest_bn = np.where(valid, done.versions_bn, -1)
    switched_b = valid.any(1) & (versions_bn.min(1) != newest_bn.max(1))
    out = {"async/staleness_mean": float(staleness_bn[valid].mean()) if valid.any() else 0.0,
           "async/staleness_max": float(staleness_bn[valid].max()) if valid.any() else 0.0,
           "async/interrupted_sequences": float(switched_b.sum()),
           "async/interruptions": float(done.interruptions)}
    for s in range(eta + 1):
        out[f"async/staleness_frac_{s}"] = float((staleness_bn == s).sum()) / tokens
    return out


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


def _draw(events: list, path: str, specs: dict[str, str]) -> None:
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


def rl_loop(job: Job, runner: Runner, prompts, writer, checkpoints: checkpoint.Checkpointer,
            acc_before: float | None, held_out=None,
            evaluation_before: dict[str, float] | None = None) -> AsyncLoopResult:
    """RL steps from the runner's step index to spec.steps, asynchronously (module docstring).

    Args, checkpoints and the periodic held-out evaluation (`held_out`, run between two
    updates) as the synchronous loop (`jaxrlhf.run.rl.rl_loop`).
    """
    spec, r = job.spec, job.spec.rollout
    eta = spec.async_rl.max_staleness
    (gen,) = [m for m in spec.graph.mfcs if m.role is Role.ACTOR and m.call is Call.GENERATE]
    gen_layout = job.plan.layouts[gen.name]
    trainer_run = trainer_runner(runner, gen.name)
    rollout = Rollout(spec.base.config, r.generate(job.tokenizer), gen_layout, r.max_prompt_len)
    worker = RolloutWorker(gen, rollout, gen_layout, spec.base.config, spec.seed,
                           spec.async_rl.chunk_tokens)
    actor = runner.runtimes[Role.ACTOR]
    trainer = _Trainer(trainer_run, checkpoint.NanGuard(spec.nan_policy, checkpoints))
    clock_zero = time.perf_counter()
    now = lambda: time.perf_counter() - clock_zero
    version = trained = next_index = trainer_run.step_index
    worker.publish(actor.params, version)
    ready: collections.deque[Generated] = collections.deque()
    pending, pending_batch = None, None
    timings, events, tokens_per_s, staleness_max = [], [], [], 0.0
    last_end, busy_marks = now(), (0.0, 0.0)
    bar = tqdm(range(trained, spec.steps), desc=f"{trainer_run.algorithm.name} (async η={eta})",
               initial=trained, total=spec.steps, mininterval=1)
    kept = {} if evaluation_before is None else {"evaluation_before": evaluation_before}
    save = lambda: checkpoint.save_run(checkpoints, trainer_run, prompts, acc_before,
                                       spec.config_json, job.fingerprint, **kept)
    interrupted = False
    with checkpoint.StopRequest() as stop:
        while trained < spec.steps:
            limit = _limit(trained, spec.steps, checkpoints.cfg.every)
            can_start = next_index < limit and next_index <= worker.version + eta
            gen_can_work = worker.inflight is not None or can_start
            if pending is not None and (pending.done() or not gen_can_work):
                result, skipped, (t_start, t_end) = pending.result()
                done, pending = pending_batch, None
                trained = version = version + 1
                worker.publish(actor.params, version)  # interrupts the batch in flight
                window = max(now() - last_end, 1e-9)
                last_end = now()
                m = result.metrics
                m.update(_batch_metrics(done, version - 1, eta))
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
            if pending is None and ready:
                done = ready.popleft()
                stale = done.staleness_bn(version).max()
                if stale > eta:  # the throttle's invariant (module docstring)
                    raise AssertionError(f"batch {done.index}: a token {stale} versions old "
                                         f"(async_rl.max_staleness={eta})")
                pending, pending_batch = trainer.submit(done), done
                continue
            if worker.inflight is not None:
                finished = worker.step(now)
                if finished is not None:
                    ready.append(finished)
            elif can_start:
                before = prompts.state()
                batch = prompt_batch(next(prompts), job.tokenizer, r.max_prompt_len,
                                     r.group_size)
                worker.start(next_index, batch, before, now())
                next_index += 1
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
        _draw(events, str(job.workdir / "timeline_async.png"), specs)
    seconds = sum(w for _, w in tokens_per_s)
    extra = {"staleness_max": staleness_max,
             "tokens_per_second": sum(t for t, _ in tokens_per_s) / seconds if seconds else None,
             "weights_published_bytes": worker.published_bytes}
    return AsyncLoopResult(timings, interrupted, trainer.guard.skipped, extra)


def _rewind(prompts, ready, inflight_before) -> None:
    """Stop: drop the generated-but-untrained batches (`ready`, and the one in flight, drawn
    from `inflight_before`, or None) and rewind the prompts to the first of them."""
    firsts = [g.iterator_before for g in ready] + [inflight_before]
    firsts = [f for f in firsts if f is not None]
    if firsts:
        prompts.restore(firsts[0])
    ready.clear()
