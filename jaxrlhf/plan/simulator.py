"""ReaL's Algorithm 1: the time of a plan, by simulating its augmented dataflow graph.

The augmented graph (`augmented_tasks`) has, per step, one task per MFC plus the parameter
movements the runtime makes (`dataflow.runtime.ModelRuntime`): a reallocation before a trained
model's call on a layout other than its home (once per parameter version and layout), and, for
offloaded frozen models, an onload before and an offload after each call. Edges are the data
edges of the graph, the movement edges, and the parameter-version edges across steps (the first
call to X in step i waits for the last call to X in step i-1).

`simulate` walks the tasks of `num_steps` steps in dispatch order. A task starts when its
parents have ended and every device it occupies is free; it then holds those devices until it
ends. This is Algorithm 1 with the ready queue ordered by dispatch order instead of ready time,
because JAX runs the programs enqueued on a device in the order they were enqueued (a later
MFC cannot overtake an earlier one on shared devices), so the simulation follows the runtime.
Tasks on disjoint devices overlap; tasks on overlapping devices queue. Host tasks occupy no
device. Without `overlap_steps` each step starts after the previous one has ended, as the
synchronous scheduler does (`Scheduler.run_step` waits for every output).
"""

from __future__ import annotations

import bisect
import dataclasses
import enum
from collections.abc import Callable, Mapping, Sequence

from jaxrlhf.dataflow.scheduler import Scheduler
from jaxrlhf.mfc import Call, Role
from jaxrlhf.parallel.strategy import DeviceRange
from jaxrlhf.plan.choice import CallChoice, ExecutionPlan
from jaxrlhf.plan.experiment import Experiment


class TaskKind(enum.Enum):
    MFC = "mfc"
    REALLOC = "realloc"
    ONLOAD = "onload"
    OFFLOAD = "offload"


@dataclasses.dataclass(frozen=True)
class Task:
    """One node of the augmented graph, repeated every step.

    Attributes:
      name: unique within a step.
      kind: what it is.
      seconds: its duration.
      devices: the device ranges it occupies (empty: a host task).
      after: tasks of the same step it waits for (each listed earlier in dispatch order).
      after_previous: tasks of the previous step it waits for (parameter versions).
      mfc: the MFC it belongs to or serves.
    """

    name: str
    kind: TaskKind
    seconds: float
    devices: tuple[DeviceRange, ...] = ()
    after: tuple[str, ...] = ()
    after_previous: tuple[str, ...] = ()
    mfc: str = ""


@dataclasses.dataclass(frozen=True)
class Interval:
    """When one task ran in one step."""

    task: str
    kind: TaskKind
    mfc: str
    step: int
    start: float
    end: float
    devices: tuple[DeviceRange, ...]


@dataclasses.dataclass(frozen=True)
class SimResult:
    """Every task's interval, and the per-step time.

    `step_seconds` is the steady-state time between the ends of consecutive steps (the makespan
    when one step is simulated).
    """

    intervals: tuple[Interval, ...]
    num_steps: int
    step_seconds: float
    makespan: float

    def step(self, step: int = -1) -> list[Interval]:
        step = step % self.num_steps
        return [iv for iv in self.intervals if iv.step == step]

    def mfc_spans(self, step: int = -1) -> dict[str, tuple[float, float]]:
        """MFC name -> (start, end) in `step`, relative to that step's first start."""
        ivs = self.step(step)
        origin = min(iv.start for iv in ivs)
        return {iv.task: (iv.start - origin, iv.end - origin)
                for iv in ivs if iv.kind is TaskKind.MFC}


@dataclasses.dataclass(frozen=True)
class _Segments:
    """The devices cut at every task range's ends: devices of one segment are always occupied
    together, so the simulation tracks one free time per segment instead of per device."""

    bounds: tuple[int, ...]  # first device of each segment

    def of(self, devices: DeviceRange) -> tuple[int, int]:
        """[first, last) segment indices that make up `devices`."""
        return (bisect.bisect_left(self.bounds, devices.first),
                bisect.bisect_left(self.bounds, devices.last + 1))


def _segments(tasks: Sequence[Task], num_devices: int) -> _Segments:
    cuts = {0}
    for task in tasks:
        for r in task.devices:
            if r.last >= num_devices:
                raise ValueError(f"task {task.name} uses devices {r} of {num_devices}")
            cuts.update((r.first, r.last + 1))
    return _Segments(tuple(sorted(c for c in cuts if c < num_devices)))


def simulate(tasks: Sequence[Task], num_devices: int, num_steps: int = 2,
             overlap_steps: bool = False) -> SimResult:
    """Runs Algorithm 1 over `num_steps` copies of `tasks` (given in dispatch order)."""
    if num_steps < 1:
        raise ValueError(f"num_steps must be >= 1, got {num_steps}")
    position = {t.name: i for i, t in enumerate(tasks)}
    for i, task in enumerate(tasks):
        late = [a for a in task.after if position.get(a, len(tasks)) >= i]
        if late:
            raise ValueError(f"task {task.name} waits for {late}, not dispatched before it")
        unknown = [a for a in task.after_previous if a not in position]
        if unknown:
            raise ValueError(f"task {task.name} waits for unknown task(s) {unknown}")
    segments = _segments(tasks, num_devices)
    free = [0.0] * len(segments.bounds)  # when each segment's devices are next free
    spans = [[segments.of(r) for r in task.devices] for task in tasks]
    ends: dict[tuple[int, str], float] = {}
    intervals, step_ends, barrier = [], [], 0.0
    for step in range(num_steps):
        for task, task_spans in zip(tasks, spans):
            ready = max([barrier] + [ends[step, a] for a in task.after]
                        + [ends[step - 1, a] for a in task.after_previous if step > 0])
            busy = max((max(free[a:b]) for a, b in task_spans), default=0.0)
            start = max(ready, busy)
            end = start + task.seconds
            for a, b in task_spans:
                free[a:b] = [end] * (b - a)
            ends[step, task.name] = end
            intervals.append(Interval(task.name, task.kind, task.mfc, step, start, end,
                                      task.devices))
        step_ends.append(max(ends[step, t.name] for t in tasks))
        if not overlap_steps:
            barrier = step_ends[-1]
    per_step = (step_ends[-1] - step_ends[0]) / (num_steps - 1) if num_steps > 1 else step_ends[0]
    return SimResult(tuple(intervals), num_steps, per_step, step_ends[-1])


def dispatch_order(experiment: Experiment) -> list[str]:
    """The runtime scheduler's dispatch order of the graph's MFCs."""
    graph = experiment.graph
    return Scheduler(graph, {n: None for n in graph.order}, {}).dispatch_order(
        set(graph.dataset_keys))


@dataclasses.dataclass(frozen=True)
class _Slot:
    """What the augmented graph needs to know about one MFC, independent of the plan."""

    name: str
    role: Role
    host: bool
    parents: tuple[str, ...]
    previous: tuple[str, ...]  # parameter-version parents in the previous step
    trainable: bool
    home: str  # MFC whose layout is the role's home ("" for host MFCs)
    version: tuple[str, ...]  # the role's last train_step (a reallocation's source version)


class Skeleton:
    """The plan-independent part of the augmented graph, computed once per experiment."""

    def __init__(self, experiment: Experiment):
        self.experiment = experiment
        graph = experiment.graph
        version = {first: last for last, first in graph.parameter_version_edges()}
        self.slots = []
        for name in dispatch_order(experiment):
            mfc = graph.mfc(name)
            trainable = not mfc.host and experiment.trainable(mfc.role)
            last_train = [m.name for m in graph.calls_of(mfc.role) if m.call is Call.TRAIN_STEP]
            self.slots.append(_Slot(
                name, mfc.role, mfc.host, tuple(graph.graph.predecessors(name)),
                (version[name],) if name in version else (), trainable,
                "" if mfc.host else experiment.home_mfc(mfc.role),
                tuple(last_train[-1:]) if trainable else (),
            ))


ReallocSeconds = Callable[[Role, CallChoice, CallChoice], float]
OffloadSeconds = Callable[[Role, CallChoice], float]


def augmented_tasks(skeleton: Skeleton, plan: ExecutionPlan, mfc_seconds: Mapping[str, float],
                    realloc_seconds: ReallocSeconds, offload_seconds: OffloadSeconds,
                    state_seconds: OffloadSeconds | None = None) -> list[Task]:
    """The augmented graph of one step, in dispatch order.

    A trained model that offloads its state (`Experiment.offloads_state`) onloads its
    parameters before each of its calls that reads them on its home layout (or copies them to
    another), its whole state before its train step, and offloads the whole state after it.

    Args:
      skeleton: `Skeleton(experiment)`.
      plan: every model MFC's choice.
      mfc_seconds: model MFC name -> its duration.
      realloc_seconds: (role, home choice, call choice) -> seconds to copy the parameters.
      offload_seconds: (role, call choice) -> seconds to move them between host and devices.
      state_seconds: (role, home choice) -> seconds to move a trained model's parameters and
        optimizer state between host and devices (needed when trained models offload).
    """
    experiment = skeleton.experiment
    choices = dict(plan.items())
    offloads = experiment.offload_frozen
    devices = {name: choice.devices for name, choice in choices.items()}
    offloaded = {s.role for s in skeleton.slots
                 if s.trainable and experiment.offloads_state(s.role, devices)}
    copies: set = set()
    last_offload: dict[Role, str] = {}
    tasks: list[Task] = []
    for slot in skeleton.slots:
        name = slot.name
        if slot.host:
            tasks.append(Task(name, TaskKind.MFC, experiment.host_mfc_seconds(name), (),
                              slot.parents, slot.previous, name))
            continue
        choice, home = choices[name], choices[slot.home]
        moves = []
        if not slot.trainable and offloads:
            previous = last_offload.get(slot.role)
            moves.append(Task(f"onload:{name}", TaskKind.ONLOAD,
                              offload_seconds(slot.role, choice), (choice.devices,),
                              after=(previous,) if previous else (), mfc=name))
        else:
            realloc = (choice.param_layout != home.param_layout
                       and (slot.role, choice.param_layout) not in copies)
            if slot.role in offloaded and (realloc or name == slot.home
                                           or choice.param_layout == home.param_layout):
                moves.append(_trained_onload(slot, home, last_offload, offload_seconds,
                                             state_seconds))
            if realloc:
                copies.add((slot.role, choice.param_layout))
                moves.append(Task(f"realloc:{name}", TaskKind.REALLOC,
                                  realloc_seconds(slot.role, home, choice),
                                  (home.devices, choice.devices),
                                  after=tuple(t.name for t in moves),
                                  after_previous=slot.version, mfc=name))
        tasks += moves
        tasks.append(Task(name, TaskKind.MFC, mfc_seconds[name], (choice.devices,),
                          slot.parents + tuple(t.name for t in moves), slot.previous, name))
        if (not slot.trainable and offloads) or (slot.role in offloaded and name == slot.home):
            seconds = (state_seconds(slot.role, home) if slot.trainable
                       else offload_seconds(slot.role, choice))
            tasks.append(Task(f"offload:{name}", TaskKind.OFFLOAD, seconds,
                              (choice.devices,), (name,), mfc=name))
            last_offload[slot.role] = f"offload:{name}"
    return tasks


def _trained_onload(slot: _Slot, home: CallChoice, last_offload: Mapping[Role, str],
                    offload_seconds: OffloadSeconds,
                    state_seconds: OffloadSeconds | None) -> Task:
    """A trained model waiting in host memory comes back to its home devices for a call: its
    parameters for a call that reads them, its whole state for its train step (which
    follows the previous step's offload after that step's train step)."""
    train = slot.name == slot.home
    if train and state_seconds is None:
        raise ValueError("augmented_tasks: trained models offload; pass state_seconds")
    seconds = state_seconds(slot.role, home) if train else offload_seconds(slot.role, home)
    previous = last_offload.get(slot.role)
    return Task(f"onload:{slot.name}", TaskKind.ONLOAD, seconds, (home.devices,),
                after=(previous,) if previous else (),
                # The state went to host after the previous step's train step (the home).
                after_previous=() if previous or not slot.version else (f"offload:{slot.home}",),
                mfc=slot.name)
