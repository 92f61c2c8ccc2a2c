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

  weights     after each update every process takes part in `parallel.reshard` of the actor's
              parameters onto each replica's layout (a cross-process transfer, shard to
              shard; the trainer announces version v first, a replica joins between two
              chunks). A replica receives it on a thread of its own into a second copy while
              it keeps decoding with the old one, and hands it to its rollout scheduler when
              complete (`run/weight_receiver.py`; inline, pausing decoding, where the devices
              have no room for the second copy). A replica starts a batch only with the
              newest version: the publish is a rendezvous the trainer completes before it
              issues more work, and a replica finishes receiving before it starts a batch.
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
`channel.Deadline`; either ends the job with one line naming the step, the wait and the process.
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
from jaxrlhf.parallel import delta, watchdog
from jaxrlhf.parallel.delta import WeightSync
from jaxrlhf.parallel.layout import Layout
from jaxrlhf.parallel.reshard import process_local
from jaxrlhf.run import async_steps, loop
from jaxrlhf.run.async_steps import drain_limit, draw_async_timeline, trainer_runner
from jaxrlhf.run.guards import StopRequest
from jaxrlhf.run.rollout_worker import Generated, RolloutWorker
from jaxrlhf.run.weight_receiver import WeightReceiver, bytes_per_device, second_copy_fits
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


def _publish(params, shardings: list, version: int, mine: int, changed: list[int],
             previous=None):
    """Every process: the actor's parameters onto each replica's layout (collective): the
    leaves `changed` (every process the same), the others kept from `previous` (replica
    `mine`'s weights of the version before; `parallel/delta.py`). Returns replica `mine`'s
    copy (None on the trainer, mine = 0) and the bytes moved."""
    kept, moved_bytes = None, 0
    for r, target in enumerate(shardings, 1):
        with watchdog.label(step=version, transfer=f"weights v{version} -> replica {r}"):
            if r == mine:
                moved, stats = delta.apply(params, previous, target, changed)
            else:  # another replica's copy: this process only takes part
                moved, stats = delta.send(params, target, changed)
        moved_bytes += stats.bytes_moved
        if r == mine:
            kept = moved
    return kept, moved_bytes


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
    actor = runner.runtimes[Role.ACTOR]
    version = runner.step_index
    deadline = Deadline(watchdog.timeout_s() or 600.0, r)

    def receive(v: int):
        """Version v's weights: the tensors the trainer's announcement names, the others kept
        from the version installed (`async_rl.weight_sync`)."""
        while (announced := chan.get(f"pub/{v}")) is None:
            deadline.check(lambda: f"replica {r}: the announcement of weights v{v}")
            time.sleep(_POLL_S)
        return _publish(actor.params, shardings, v, r, announced["changed"], worker.params)[0]

    worker.install(receive(version), version)
    per_device = bytes_per_device(shardings[r - 1], abstract_params(spec.base.config))
    weights = WeightReceiver(receive, overlap=second_copy_fits(layout.devices, per_device))
    orders, queue = 0, collections.deque()
    deadline.progress()
    interrupted = False
    with StopRequest():  # a signal to every process: the trainer decides
        while True:
            if (received := weights.ready()) is not None:
                worker.install(*received)
            if not weights.busy and chan.peek(f"pub/{version + 1}"):
                version += 1
                weights.start(version)
                deadline.progress()
                continue
            order = chan.take(f"order/{r}/{orders}")
            if order is not None:
                orders += 1
                deadline.progress()
                if order["kind"] != "gen" and (received := weights.join()) is not None:
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
                continue
            if queue and worker.accepts():
                if (received := weights.join()) is not None:
                    worker.install(*received)  # a batch starts with the newest weights
                order = queue.popleft()
                prompts.restore(order["iterator"])
                batch = prompt_batch(next(prompts), job.tokenizer, spec.rollout.max_prompt_len,
                                     spec.rollout.group_size)
                worker.start(order["index"], batch, None, time.time())
            elif worker.busy:
                for done in worker.step(time.time):
                    _send(chan, gen, done, r, worker.busy_seconds)
                    deadline.progress()
            else:
                deadline.check(lambda: f"replica {r} (step {version}): weights or work from the "
                                       "trainer (process 0)")
                time.sleep(_POLL_S)
    return LoopResult([], interrupted, 0, {})


def _send(chan: Channel, gen, done: Generated, replica: int, busy: float) -> None:
    arrays = {k: np.asarray(jax.device_get(done.buffer[k])) for k in gen.outputs}
    arrays["versions_bn"] = done.versions_bn
    chan.put_arrays(f"batch/{done.index}", arrays,
                    {"interruptions": done.interruptions, "restarts": done.restarts,
                     "discarded_tokens": done.discarded_tokens, "seconds": list(done.seconds),
                     "slots_idle": done.slots_idle, "replica": replica, "busy": busy})


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
        self.published_bytes = 0
        self.tracker = (delta.Tracker() if job.spec.async_rl.weight_sync is WeightSync.DELTA
                        else None)
        self.deadline = Deadline(watchdog.timeout_s() or 600.0, 0)
        self.pace = async_steps.Pace(job, time.time)
        self.events = []  # (name, start, end) of every batch's generation and update
        self.stopping = False
        self.version = self.next_index = self.runner.step_index  # = updates done
        self._publish(self.version)

    def _order(self, replica: int, message: dict) -> None:
        self.chan.put(f"order/{replica}/{self.orders[replica - 1]}", message)
        self.orders[replica - 1] += 1

    def _publish(self, version: int) -> None:
        params = self.actor.params
        changed = (list(range(len(jax.tree.leaves(params)))) if self.tracker is None
                   else self.tracker.changed(params))
        self.chan.put(f"pub/{version}", {"changed": changed})
        self.published_bytes += _publish(params, self.shardings, version, 0, changed)[1]

    def _issue(self, index: int, version: int) -> None:
        """Batch `index` to the replica with the fewest orders."""
        replica = 1 + int(np.argmin(self.queued))
        before = self.rows.state()
        r = self.spec.rollout
        batch = prompt_batch(next(self.rows), self.job.tokenizer, r.max_prompt_len,
                             r.group_size)
        batch[loop.ROWS] = self.rows.indices(before)  # logged by the update that trains it
        self._order(replica, {"kind": "gen", "index": index, "iterator": before.to_dict()})
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
        self._publish(self.version)
        self.deadline.progress()
        self.events += [(f"gen {done.index}", *done.seconds), (f"train {done.index}", t0, t1)]
        update = self.pace.update(done, result, skipped, self.version - 1,
                                  sum(self.gen_busy) / self.replicas, self.train_busy)
        update.figures["async/replica"] = float(meta["replica"])
        update.figures["async/batch"] = float(done.index)  # batches arrive in any order
        return update

    def stop_now(self, stop: StopRequest) -> bool:
        """Stops once a stop was asked and every issued batch is trained (drained)."""
        self.stopping = self.stopping or stop.requested
        return self.stopping and not self.outstanding

    def save(self, write) -> None:
        """Collective: every replica saves with this runner's state and prompt position."""
        for replica in range(1, self.replicas + 1):
            self._order(replica, {"kind": "save", "runner": self.runner.state(),
                                  "iterator": self.rows.state().to_dict()})
        with process_local(False):  # every process, as one SPMD section (orbax is collective)
            write()

    def close(self, interrupted: bool) -> dict:
        for replica in range(1, self.replicas + 1):
            self._order(replica, {"kind": "stop", "interrupted": interrupted})
        self._draw(self.events)
        return {**self.pace.summary(), "weights_published_bytes": self.published_bytes,
                "gen_replicas": self.replicas}

    def _draw(self, events) -> None:
        if not events:
            return
        train = [m for m in self.spec.graph.calls_of(Role.ACTOR) if m.call is Call.TRAIN_STEP][0]
        plan = self.job.plan
        specs = {"gen": f"{plan.specs[self.gen.name]} x{self.replicas} replicas",
                 "train": plan.specs[train.name]}
        draw_async_timeline(events, str(self.job.workdir / "timeline_async.png"), specs)
