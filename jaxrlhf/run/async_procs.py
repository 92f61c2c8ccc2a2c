"""Asynchronous RL across processes: a trainer process and R generation replica processes.

Generation replicas with weights of their own, each in a process of its own (the one-process
loop, async_loop.py, runs one, in its main thread). With `placement.kind=disaggregate` and a
multi-process launch (`launch/local.sh 1+R ...`, `placement.gen_replicas=R`), process 0
is the trainer (every MFC but generation, on its own devices; it writes metrics and the summary)
and process r = 1..R is generation replica r (FlexRLHF's shadow actors): the actor's generate
layout on its own devices, its own copy of the weights, decoding batches with
`RolloutWorker` (chunks, interruptions, per-token versions, `actor_gen@k`
micro-batches). Up to the loop the job is the usual SPMD program (build, warm start,
evaluation); inside it the processes run different programs and meet only here (the periodic
held-out evaluation, `eval.every`, runs on the trainer alone, on its own devices):

  weights     after each update the trainer snapshots the actor's parameters and goes on; a
              thread of its own announces the version and takes part, with every process, in
              `parallel.reshard` of it onto each replica's layout (a cross-process transfer,
              shard to shard). A replica joins between two chunks, on a thread of its own,
              into a second copy, while it keeps decoding with the old one, and hands it to
              its rollout scheduler when complete (`run/remote_weights.py`). One version in
              flight, at most one waiting (a newer one supersedes it); without room for the
              copies a side publishes inline, pausing. A batch issued at version v starts
              with weights of version ≥ v (its work order says v; the replica decodes its
              other rows meanwhile), so the staleness bound below holds as before.
  work        the trainer draws the prompts (its iterator is the checkpointed one) and sends
              a replica the batch index and the iterator state to draw the same rows from.
  batches     a replica sends the generated arrays and per-token versions back through the
              coordination service (`run/channel.py`); the trainer trains batches in the order
              they arrive, within the staleness bound.
  checkpoints every process takes part in the save (orbax is collective); replicas receive
              the trainer's runner and iterator state for it.

Staleness with several replicas: batch k issued at trainer version v must be trained by update
v + η (its deadline). Work is issued only while the outstanding deadlines stay schedulable
(earliest deadline first: the i-th smallest ≥ next update + i), and an arrived batch is trained
before an older one only if the rest stay schedulable afterwards; so staleness ≤ η always
(asserted from the per-token versions before every update), whatever order batches arrive in.

Checkpoints and stops drain: no work is issued past the next checkpoint step, and a stop
(Ctrl-C / SIGTERM to the processes) stops issuing and trains every batch already issued before
saving; so at every save all issued batches are trained and the prompt iterator stands after
them: no prompt is lost, none is trained twice.

Every cross-process wait is deadline-bound (`distributed`'s wait timeout): transfers by
`parallel.watchdog` (labelled with the step and the transfer), message waits by
`channel.Deadline`; either ends the job with one line naming the step, the wait and the process,
as does a failed publish (naming the version). Saves and the end wait for the publish in
flight first: every process takes part in every cross-process transfer, in the same order.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import time

import jax
import numpy as np

from jaxrlhf import checkpoint
from jaxrlhf.data.encode import prompt_batch
from jaxrlhf.mfc import Call, Role
from jaxrlhf.models.sizes import abstract_params
from jaxrlhf.parallel import watchdog
from jaxrlhf.parallel.layout import Layout
from jaxrlhf.parallel.reshard import process_local
from jaxrlhf.run import async_steps, loop
from jaxrlhf.run.async_steps import drain_limit, draw_async_timeline, trainer_runner
from jaxrlhf.run.guards import StopRequest
from jaxrlhf.run.rollout_worker import Generated, RolloutWorker
from jaxrlhf.run.remote_weights import ReplicaWeights, TrainerWeights
from jaxrlhf.run.weight_receiver import bytes_per_device, second_copy_fits
from jaxrlhf.run.channel import Channel, Deadline
from jaxrlhf.run.check import Job
from jaxrlhf.run.evaluate import HeldOut
from jaxrlhf.run.loop import LoopResult
from jaxrlhf.run.runner import Runner
from jaxrlhf.engine.rollout import Rollout

_POLL_S = 0.002
_QUEUE = 2  # work orders a replica holds beyond the batch it decodes


class TopologyError(ValueError):
    """A multi-process asynchronous run whose processes and placement do not fit."""


def schedulable(deadlines: list[int], next_update: int) -> bool:
    """Whether every batch can still be trained by its deadline (the last update number it
    may be trained at), one per update from `next_update` on: earliest deadline first."""
    return all(d >= next_update + i for i, d in enumerate(sorted(deadlines)))


def replica_layouts(job: Job, gen_name: str) -> list[Layout]:
    """Replica r's generation layout (r = 1..R): the plan's generate layout, which must cover
    process 1's devices, moved onto process r's; every other MFC must sit on process 0's."""
    replicas, processes = job.spec.placement.gen_replicas, jax.process_count()
    if processes != 1 + replicas:
        raise TopologyError(f"placement.gen_replicas={replicas}: a multi-process asynchronous "
                            f"run needs 1 + {replicas} processes (the trainer's and one per "
                            f"replica), have {processes}")
    gen = job.plan.layouts[gen_name]
    if set(gen.devices) != {d for d in jax.devices() if d.process_index == 1}:
        raise TopologyError(f"{gen_name} must use exactly process 1's devices in a multi-process "
                            "asynchronous run (placement.kind=disaggregate does)")
    for name, layout in job.plan.layouts.items():
        if name != gen_name and any(d.process_index != 0 for d in layout.devices):
            raise TopologyError(f"{name} must run on process 0's devices (the trainer's) in a "
                                "multi-process asynchronous run")
    return [on_process(gen, r) for r in range(1, processes)]


def on_process(layout: Layout, process: int) -> Layout:
    """`layout`, which sits on process 1's devices, moved device for device (in id order) onto
    `process`'s: a replica's generation layout, or the trainer's for held-out evaluation."""
    local = {p: sorted((d for d in jax.devices() if d.process_index == p), key=lambda d: d.id)
             for p in (1, process)}
    position = {d: i for i, d in enumerate(local[1])}
    devices_ = np.vectorize(lambda d: local[process][position[d]], otypes=[object])(
        layout.mesh.devices)
    return dataclasses.replace(layout, mesh=jax.sharding.Mesh(devices_, layout.mesh.axis_names))


def rl_loop(job: Job, runner: Runner, prompts, writer, checkpoints: checkpoint.Checkpointer,
            evaluation_before: dict[str, float], held_out=None) -> LoopResult:
    """The asynchronous loop of a multi-process job (module docstring): `loop.train` on a
    `RemoteSource` in process 0, a replica's part (`_serve`) in the others. Arguments as
    `async_loop.rl_loop`'s. The periodic held-out evaluation (`held_out`, every `eval.every`
    updates) runs on the trainer alone, on the generation layout moved onto its own devices:
    between updates only the trainer holds the newest weights and runs, so a job-wide
    evaluation would wait for busy replicas."""
    if job.spec.env is not None:
        raise TopologyError(f"env.name={job.spec.env.spec!r}: multi-turn asynchronous RL runs "
                            "in one process (generation beside training, or disaggregated)")
    (gen,) = [m for m in job.spec.graph.mfcs if m.role is Role.ACTOR and m.call is Call.GENERATE]
    layouts = replica_layouts(job, gen.name)
    shardings = [lay.param_shardings(abstract_params(job.spec.base.config)) for lay in layouts]
    chan = Channel(f"jaxrlhf/async/{runner.step_index}")
    for runtime in runner.runtimes.values():
        runtime.drop_copies()  # from here the processes hold different parameter versions
    with process_local():
        if jax.process_index() == 0:
            periodic = held_out is not None and job.spec.evaluation.every > 0
            # the same evaluation on the trainer's own devices, with a reward pool of its own
            with (HeldOut(job, on_process(held_out.layout, 0)) if periodic
                  else contextlib.nullcontext()) as evaluation:
                result = loop.train(job, RemoteSource(job, runner, gen, shardings, chan, prompts),
                                    writer, checkpoints, evaluation_before, evaluation)
        else:
            result = _serve(job, runner, gen, layouts, shardings, chan, prompts,
                            lambda: loop.save(job, checkpoints, runner, prompts,
                                              evaluation_before))
    for runtime in runner.runtimes.values():
        runtime.drop_copies()  # the SPMD program resumes: nobody keeps a stale copy
    return result


def _serve(job: Job, runner: Runner, gen, layouts: list[Layout], shardings: list, chan: Channel,
           prompts, save) -> LoopResult:
    """Generation replica r = this process: publishes, work orders, batches until "stop"."""
    spec, r = job.spec, jax.process_index()
    layout = layouts[r - 1]
    micro = job.plan.micro_batches(gen.name)
    rollout = Rollout(spec.base.config, spec.rollout.generate(job.tokenizer), layout,
                      spec.rollout.max_prompt_len, spec.rollout.rows // micro)
    worker = RolloutWorker(gen, rollout, layout, spec.base.config, spec.seed,
                           spec.async_rl.chunk_tokens, micro,
                           on_new_version=spec.async_rl.on_new_version)
    deadline = Deadline(watchdog.timeout_s() or 600.0, r)
    per_device = bytes_per_device(shardings[r - 1], abstract_params(spec.base.config))
    overlap = room(layout.devices, per_device, f"generation replica {r}",
                   "a second copy of its weights", "decoding while it receives")
    weights = ReplicaWeights(chan, runner.runtimes[Role.ACTOR].params, shardings, r, deadline,
                             overlap)
    worker.install(*weights.first())
    pause = _Pause()
    orders, queue = 0, collections.deque()
    deadline.progress()
    interrupted = False
    with StopRequest():  # a signal to every process: the trainer decides
        while True:
            pause.begin(weights, worker.busy or bool(queue))
            if (received := weights.ready()) is not None:
                worker.install(*received)
                deadline.progress()
            elif (order := chan.take(f"order/{r}/{orders}")) is not None:
                orders += 1
                deadline.progress()
                if order["kind"] != "gen" and (received := weights.drain()) is not None:
                    worker.install(*received)  # a save or a stop: every process in step
                match order["kind"]:
                    case "gen":
                        queue.append(order)
                    case "save":
                        runner.restore(order["runner"])
                        prompts.restore(order["iterator"])
                        with process_local(False):  # every process: orbax is collective
                            save()
                    case "stop":
                        interrupted = order["interrupted"]
                        break
            elif queue and worker.accepts() and worker.version >= queue[0]["version"]:
                order = queue.popleft()  # issued at its version: its staleness bound holds
                prompts.restore(order["iterator"])
                batch = prompt_batch(next(prompts), job.tokenizer, spec.rollout.max_prompt_len,
                                     spec.rollout.group_size)
                worker.start(order["index"], batch, None, time.time())
            elif worker.busy:
                pause.decoding()
                for done in worker.step(time.time):
                    _send(chan, gen, done, r, worker.busy_seconds, pause, weights.received)
                    deadline.progress()
            else:
                if not weights.busy:  # a transfer in flight is the watchdog's
                    deadline.check(lambda: f"replica {r} (version {worker.version}): weights "
                                           "or work from the trainer (process 0)")
                time.sleep(_POLL_S)
            pause.end(weights)
    return LoopResult([], interrupted, 0, {})


def room(devices, per_device: int, who: str, copy: str, what: str) -> bool:
    """Whether `devices` hold `per_device` more bytes each (`second_copy_fits`); if not, says
    so in one line: that side publishes inline, a pause."""
    fits = second_copy_fits(devices, per_device)
    if not fits:
        print(f"jaxrlhf: {who}: no room for {copy} ({per_device / 2**20:.1f} MiB per device): "
              f"weights are published inline, pausing {what}", flush=True)
    return fits


class _Pause:
    """A replica's seconds without a decode step while a version was in flight and it had
    rows to decode or a batch to start (the pause a publish costs generation)."""

    def __init__(self):
        self.seconds = 0.0

    def begin(self, weights: ReplicaWeights, has_work: bool) -> None:
        self.t0, self.work, self.decoded = time.perf_counter(), has_work, False
        self.in_flight, self.received = weights.busy, weights.received

    def decoding(self) -> None:
        self.decoded = True

    def end(self, weights: ReplicaWeights) -> None:
        in_flight = self.in_flight or weights.busy or weights.received != self.received
        if in_flight and self.work and not self.decoded:
            self.seconds += time.perf_counter() - self.t0


def _send(chan: Channel, gen, done: Generated, replica: int, busy: float, pause: _Pause,
          receipts: int) -> None:
    arrays = {k: np.asarray(jax.device_get(done.buffer[k])) for k in gen.outputs}
    arrays["versions_bn"] = done.versions_bn
    chan.put_arrays(f"batch/{done.index}", arrays,
                    {"interruptions": done.interruptions, "restarts": done.restarts,
                     "discarded_tokens": done.discarded_tokens, "seconds": list(done.seconds),
                     "slots_idle": done.slots_idle, "replica": replica, "busy": busy,
                     "paused": pause.seconds, "receipts": receipts})


def waiting_for(step: int, replica_of: dict[int, int]) -> str:
    """What the trainer waits for at `step`: batch index -> the replica (= process) making it."""
    replicas = sorted(set(replica_of.values()))
    return (f"step {step}: finished batch(es) {sorted(replica_of)} from generation replica(s) "
            f"{replicas} (processes {replicas})")


@dataclasses.dataclass
class _Order:
    index: int
    replica: int
    deadline: int  # the last update number that may train it (issue version + η)
    batch: dict
    arrived: tuple | None = None  # (Generated, meta) once back


class RemoteSource:
    """Process 0 (`loop.Source`): issues work to the replicas, trains the batches they send
    back, publishes weights; a stop drains (every issued batch is trained first)."""

    def __init__(self, job: Job, runner: Runner, gen, shardings: list, chan: Channel, prompts):
        self.job, self.spec, self.gen, self.rows = job, job.spec, gen, prompts
        self.runner = trainer_runner(runner, gen.name)
        self.actor = runner.runtimes[Role.ACTOR]
        self.shardings, self.chan = shardings, chan
        self.eta = job.spec.async_rl.max_staleness
        self.replicas = len(shardings)
        self.desc = f"{runner.algorithm.name} (async η={self.eta}, {self.replicas} replicas)"
        self.outstanding: dict[int, _Order] = {}
        self.arrivals: list[int] = []  # indices, in order of arrival
        self.orders = [0] * self.replicas
        self.queued = [0] * self.replicas
        self.gen_busy = [0.0] * self.replicas
        self.train_busy = 0.0
        self.paused = [(0.0, 0)] * self.replicas  # each replica's (pause seconds, receipts)
        params = self.actor.params
        shardings_ = jax.tree.map(lambda x: x.sharding, params)
        snapshots = 2 * bytes_per_device(shardings_, params)  # one in flight, one waiting
        devices = {d for s in jax.tree.leaves(shardings_) for d in s.device_set}
        overlap = room(devices, snapshots, "the trainer", "two snapshots of the actor",
                       "the trainer until each has arrived")
        self.weights = TrainerWeights(chan, shardings, job.spec.async_rl.weight_sync,
                                      watchdog.timeout_s() or 600.0, overlap)
        self.deadline = Deadline(watchdog.timeout_s() or 600.0, 0)
        self.pace = async_steps.Pace(job, time.time)
        self.events = []  # (name, start, end) of every batch's generation and update
        self.stopping = False
        self.version = self.next_index = self.runner.step_index  # = updates done
        self.weights.offer(self.actor.params, self.version)

    def _order(self, replica: int, message: dict) -> None:
        self.chan.put(f"order/{replica}/{self.orders[replica - 1]}", message)
        self.orders[replica - 1] += 1

    def _issue(self, index: int, version: int) -> None:
        """Batch `index` to the replica with the fewest orders."""
        replica = 1 + int(np.argmin(self.queued))
        before = self.rows.state()
        r = self.spec.rollout
        batch = prompt_batch(next(self.rows), self.job.tokenizer, r.max_prompt_len,
                             r.group_size)
        batch[loop.ROWS] = self.rows.indices(before)  # logged by the update that trains it
        self._order(replica, {"kind": "gen", "index": index, "iterator": before.to_dict(),
                              "version": version})  # the oldest weights it may start with
        self.queued[replica - 1] += 1
        self.outstanding[index] = _Order(index, replica, version + self.eta, batch)

    def _receive(self) -> None:
        for index, order in self.outstanding.items():
            if order.arrived is None:
                got = self.chan.take_arrays(f"batch/{index}")
                if got is not None:
                    arrays, meta = got
                    versions_bn = arrays.pop("versions_bn")
                    done = Generated(index, {**order.batch, **arrays}, versions_bn,
                                                meta["interruptions"], None,
                                                tuple(meta["seconds"]), meta["slots_idle"],
                                                meta["restarts"], meta["discarded_tokens"])
                    order.arrived = (done, meta)
                    self.arrivals.append(index)
                    self.queued[order.replica - 1] -= 1
                    self.gen_busy[order.replica - 1] = meta["busy"]
                    self.paused[order.replica - 1] = (meta["paused"], meta["receipts"])
                    self.deadline.progress()

    def _choose(self, version: int) -> _Order | None:
        """The first arrived batch whose training leaves the rest schedulable."""
        for index in self.arrivals:
            rest = [o.deadline for k, o in self.outstanding.items() if k != index]
            if schedulable(rest, version + 1):
                return self.outstanding[index]
        return None

    def next_update(self, train: loop.Train, stop: StopRequest) -> loop.Update | None:
        self.deadline.progress()  # the loop's own work (evaluation, saves) is not waiting
        while True:
            self.stopping = self.stopping or stop.requested
            limit = (self.next_index if self.stopping else
                     drain_limit(self.version, self.spec.steps, self.spec.checkpoint.every))
            while (self.next_index < limit and min(self.queued) <= _QUEUE and schedulable(
                    [o.deadline for o in self.outstanding.values()] + [self.version + self.eta],
                    self.version)):
                self._issue(self.next_index, self.version)
                self.next_index += 1
            self._receive()
            order = self._choose(self.version)
            if order is not None:
                return self._train(train, order)
            if not self.outstanding and self.stopping:
                return None
            self.weights.check()
            self.deadline.check(lambda: waiting_for(self.version, {
                k: o.replica for k, o in self.outstanding.items()}))
            time.sleep(_POLL_S)

    def _train(self, train: loop.Train, order: _Order) -> loop.Update:
        """The update on an arrived batch; the new weights go to every replica."""
        done, meta = order.arrived
        async_steps.check_staleness(done, self.version, self.eta)  # the schedule's invariant
        del self.outstanding[order.index]
        self.arrivals.remove(order.index)
        t0 = time.time()
        result, skipped = train(done.buffer)
        t1 = time.time()
        self.train_busy += t1 - t0
        self.version += 1
        self.weights.offer(self.actor.params, self.version)  # off the path: the next update
        self.deadline.progress()  # may start before this version has arrived
        self.events += [(f"gen {done.index}", *done.seconds), (f"train {done.index}", t0, t1)]
        update = self.pace.update(done, result, skipped, self.version - 1,
                                  sum(self.gen_busy) / self.replicas, self.train_busy)
        update.figures["async/replica"] = float(meta["replica"])
        update.figures["async/batch"] = float(done.index)  # batches arrive in any order
        update.figures["async/gen_paused_seconds"] = sum(s for s, _ in self.paused)
        update.figures["async/gen_receipts"] = float(sum(n for _, n in self.paused))
        return update

    def stop_now(self, stop: StopRequest) -> bool:
        """Stops once a stop was asked and every issued batch is trained (drained)."""
        self.stopping = self.stopping or stop.requested
        return self.stopping and not self.outstanding

    def save(self, write) -> None:
        """Collective: every replica saves with this runner's state and prompt position."""
        self.weights.wait()  # every process's transfers in the same order: publishes first
        for replica in range(1, self.replicas + 1):
            self._order(replica, {"kind": "save", "runner": self.runner.state(),
                                  "iterator": self.rows.state().to_dict()})
        with process_local(False):  # every process, as one SPMD section (orbax is collective)
            write()

    def close(self, interrupted: bool) -> dict:
        self.weights.close()
        for replica in range(1, self.replicas + 1):
            self._order(replica, {"kind": "stop", "interrupted": interrupted})
        self._draw(self.events)
        return {**self.pace.summary(), "weights_published_bytes": self.weights.published_bytes,
                "weights_superseded": self.weights.superseded, "gen_replicas": self.replicas}

    def _draw(self, events) -> None:
        if not events:
            return
        train = [m for m in self.spec.graph.calls_of(Role.ACTOR) if m.call is Call.TRAIN_STEP][0]
        plan = self.job.plan
        specs = {"gen": f"{plan.specs[self.gen.name]} x{self.replicas} replicas",
                 "train": plan.specs[train.name]}
        draw_async_timeline(events, str(self.job.workdir / "timeline_async.png"), specs)
