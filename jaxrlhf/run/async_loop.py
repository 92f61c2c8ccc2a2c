"""Asynchronous RL (AReaL): generation runs ahead of training, staleness bounded by η.

Two workers share the actor:

  generation (this thread)   decodes the admitted batches' rows in slots that are refilled
                             as rows finish (`engine.rollout`, continuous batching), in
                             chunks, always with the newest weights it has been given;
                             weights that arrive mid-sequence are swapped in (the KV cache is
                             recomputed; or the row restarts, or finishes under its old
                             weights: `async_rl.on_new_version`) and every token records its
                             policy version. With an
                             environment (`env.name`) the rows are multi-turn trajectories:
                             a row that ends its turn leaves its slot while the environment
                             replies, so a trajectory's turns may come from several versions.
  training (a worker thread) runs the rest of the algorithm's graph (reward, ref/critic
                             inference, π_prox, train steps) on the oldest finished batch,
                             through the same `Runner` as the synchronous loop.

After each update the trainer's actor parameters go to the generation layout through
`parallel.reshard` (one copy per version) and generation continues with them. The copy runs
off the trainer's path (`run/publisher.py`: the trainer's next update starts while it travels;
a version not yet sent when a newer one comes is superseded), and generation installs each
version between two decode chunks once it is complete.

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
from collections.abc import Callable

import jax

from jaxrlhf import checkpoint
from jaxrlhf.data.encode import prompt_batch
from jaxrlhf.engine.rollout import Rollout
from jaxrlhf.mfc import Call, Role
from jaxrlhf.data.datasets import EpochIterator
from jaxrlhf.parallel import watchdog
from jaxrlhf.run import async_procs, async_steps, loop
from jaxrlhf.parallel.layout import Platform
from jaxrlhf.run.async_steps import drain_limit, draw_async_timeline, trainer_runner
from jaxrlhf.run.guards import StopRequest
from jaxrlhf.run.publisher import Publisher
from jaxrlhf.run.check import Job
from jaxrlhf.run.rollout_worker import Generated, RolloutWorker
from jaxrlhf.run.runner import Runner


_DENSE = 0.5  # occupied share of the generation slots worth a decode step beside an update


class _Trainer:
    """The training side: one update at a time in a worker thread."""

    def __init__(self):
        self.pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="async-train")
        self.busy_seconds = 0.0

    def submit(self, train: loop.Train, done: Generated) -> concurrent.futures.Future:
        """(step figures, discarded, (start, end) seconds) of training `done`, in the future."""
        def timed():
            t0 = time.perf_counter()
            result, skipped = train(done.buffer)
            self.busy_seconds += time.perf_counter() - t0
            return result, skipped, (t0, time.perf_counter())

        return self.pool.submit(timed)

    def close(self) -> None:
        self.pool.shutdown(wait=True)


def rl_loop(job: Job, runner: Runner, prompts, writer, checkpoints: checkpoint.Checkpointer,
            evaluation_before: dict[str, float], held_out=None) -> loop.LoopResult:
    """RL steps from the runner's step index to spec.steps, asynchronously (module docstring):
    `loop.train` on a `LocalSource`; arguments as its. A multi-process job runs
    `async_procs.rl_loop` instead (a trainer process and generation replica processes)."""
    if jax.process_count() > 1:
        return async_procs.rl_loop(job, runner, prompts, writer, checkpoints,
                                   evaluation_before, held_out)
    if job.spec.placement.gen_replicas > 1:
        raise async_procs.TopologyError(
            f"placement.gen_replicas={job.spec.placement.gen_replicas}: replicas run in "
            f"processes of their own (launch/local.sh {1 + job.spec.placement.gen_replicas} ...)")
    return loop.train(job, LocalSource(job, runner, prompts), writer, checkpoints,
                      evaluation_before, held_out)


class LocalSource:
    """Generation in this thread runs ahead of training in a worker thread (`loop.Source`; the
    module docstring has the schedule)."""

    def __init__(self, job: Job, runner: Runner, prompts: EpochIterator):
        spec, r = job.spec, job.spec.rollout
        self.job, self.rows, self.eta = job, prompts, spec.async_rl.max_staleness
        (self.gen,) = [m for m in spec.graph.mfcs
                       if m.role is Role.ACTOR and m.call is Call.GENERATE]
        gen_layout = job.plan.layouts[self.gen.name]
        self.runner = trainer_runner(runner, self.gen.name)
        self.desc = f"{runner.algorithm.name} (async η={self.eta})"
        micro = job.plan.micro_batches(self.gen.name)
        env = self.runner.environment()  # multi-turn: prompts of P + N ids, turn by turn
        prompt_len = r.max_prompt_len + (0 if env is None else r.max_new_tokens)
        rollout = Rollout(spec.base.config, r.generate(job.tokenizer), gen_layout,
                          prompt_len, r.rows // micro)
        self.worker = RolloutWorker(self.gen, rollout, gen_layout, spec.base.config, spec.seed,
                                    spec.async_rl.chunk_tokens, micro, env,
                                    self.runner.count_trajectories,
                                    spec.async_rl.on_new_version, spec.async_rl.weight_sync)
        self.shared_cores = gen_layout.platform is Platform.CPU  # with training
        self.actor = runner.runtimes[Role.ACTOR]
        self.trainer = _Trainer()
        self.clock_zero = time.perf_counter()
        self.pace = async_steps.Pace(job, self.now)
        self.version = self.next_index = self.runner.step_index  # = updates done
        self.worker.publish(self.actor.params, self.version)  # generation starts with it
        self.publisher = Publisher(lambda snapshot, _: self.worker.transfer(snapshot, owned=True),
                                   watchdog.timeout_s() or 600.0)
        self.ready: dict[int, Generated] = {}  # finished batches by index (in any order)
        self.pending: tuple[concurrent.futures.Future, Generated] | None = None
        self.events = []  # (name, start, end) of every batch's generation and update

    def now(self) -> float:
        return time.perf_counter() - self.clock_zero

    def next_update(self, train: loop.Train, stop: StopRequest) -> loop.Update | None:
        """The next update; None when a stop came while no update was training: generation
        stops at once (a multi-turn batch waiting for a slow environment included), its
        batches dropped (`stop_now`)."""
        while True:
            if stop.requested and self.pending is None:
                self.stop_now(stop)
                return None
            update = self._advance(train, lambda: stop.requested)
            if update is not None:
                return update

    def _advance(self, train: loop.Train, stop: Callable[[], bool]) -> loop.Update | None:
        """One scheduling decision: collect the update, start one, admit a batch or decode
        (a wait for the environment ends when `stop()` says so)."""
        trained, worker = self.version, self.worker
        self._install(self.publisher.ready())
        limit = drain_limit(trained, self.job.spec.steps, self.job.spec.checkpoint.every)
        can_start = self.next_index < limit and async_steps.may_start(
            self.next_index, version=worker.version, eta=self.eta,
            next_needed=trained + (self.pending is not None), finished=self.ready)
        # The CPU's cores are the trainer's too: a decode step with most slots idle there only
        # delays the update beside it, so sparse slots decode only when the trainer waits for
        # them (on accelerators generation has devices of its own).
        needed = self.pending is None and trained not in self.ready
        sparse = self.shared_cores and worker.occupancy < _DENSE
        gen_can_work = (can_start and worker.accepts()) or (
            worker.busy and (needed or not sparse))
        if self.pending is not None and (self.pending[0].done() or not gen_can_work):
            return self._collect()
        if self.pending is None and trained in self.ready:  # batch k is trained by update k
            done = self.ready.pop(trained)
            async_steps.check_staleness(done, self.version, self.eta)  # the throttle's
            self.pending = self.trainer.submit(train, done), done
        elif can_start and worker.accepts():
            r = self.job.spec.rollout
            before = self.rows.state()
            batch = prompt_batch(next(self.rows), self.job.tokenizer, r.max_prompt_len,
                                 r.group_size)
            batch[loop.ROWS] = self.rows.indices(before)  # logged by the update that trains it
            worker.start(self.next_index, batch, before, self.now())
            self.next_index += 1
        elif gen_can_work:
            self.ready.update((g.index, g) for g in worker.step(self.now, stop))
        elif self.pending is None:  # generation needs the version on its way, if any
            published = self.publisher.wait()
            if published is None:
                raise AssertionError(f"async loop stalled at step {trained}: nothing to "
                                     "generate or train")
            self._install(published)
        return None

    def _collect(self) -> loop.Update:
        """The pending update's result; the new weights go to generation."""
        future, done = self.pending
        result, skipped, (t_start, t_end) = future.result()
        self.pending = None
        self.version += 1
        # Off the trainer's path: the next update may start at once; generation installs the
        # version when it has arrived (and then interrupts the batch in flight).
        self.publisher.offer(self.actor.params, self.version)
        self.events += [(f"gen {done.index}", *done.seconds),
                        (f"train {done.index}", t_start - self.clock_zero,
                         t_end - self.clock_zero)]
        return self.pace.update(done, result, skipped, self.version - 1,
                                self.worker.busy_seconds, self.trainer.busy_seconds)

    def _install(self, published) -> None:
        if published is not None:
            self.worker.install(*published)

    def stop_now(self, stop: StopRequest) -> bool:
        """Stops at once: the generated-but-untrained batches are dropped and the prompts
        rewound to the first of them (`_rewind`)."""
        stopping = stop.agreed()
        if stopping:
            _rewind(self.rows, self.ready, self.worker.drop())
        return stopping

    def save(self, write) -> None:
        write()

    def close(self, interrupted: bool) -> dict:
        self.trainer.close()
        self.publisher.close()
        if self.events and jax.process_index() == 0:
            spec = self.job.spec
            train = [m for m in spec.graph.calls_of(Role.ACTOR)
                     if m.call is Call.TRAIN_STEP][0]
            specs = {"gen": self.job.plan.specs[self.gen.name],
                     "train": self.job.plan.specs[train.name]}
            draw_async_timeline(self.events, str(self.job.workdir / "timeline_async.png"),
                                specs)
        return {**self.pace.summary(), "weights_published_bytes": self.worker.published_bytes,
                "weights_superseded": self.publisher.superseded}


def _rewind(prompts, ready: dict, inflight) -> None:
    """Stop: drop the generated-but-untrained batches (`ready`, and those in flight, the first
    of which `inflight` names: (index, iterator state before it), or None) and rewind the
    prompts to the first of them."""
    firsts = [(g.index, g.iterator_before) for g in ready.values()] + [inflight]
    firsts = [f for f in firsts if f is not None]
    if firsts:
        prompts.restore(min(firsts, key=lambda f: f[0])[1])
    ready.clear()
