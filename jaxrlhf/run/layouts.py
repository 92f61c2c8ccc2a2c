"""Where every MFC runs: the spec's placement resolved, once, into a `RunPlan`.

A `RunPlan` is the planner's `ExecutionPlan` (each MFC's devices, degrees and micro-batches)
plus the layouts built from it on this machine's devices. Every placement kind becomes an
allocation (`plan.allocation.Entry` per MFC, objects throughout) and `plan_of` turns it into the
plan: `placement.kind=auto` runs exactly the searched plan, micro-batches included; for the
other kinds an MFC without `@N` gets the run's default (train_step: `micro_batches` or
`micro_batch_tokens`; generate and inference: one, or on a pipeline up to its stage count).
A pipelined MFC's layout carries its count (`Layout.micro_batches`): the micro-batches its
pipeline streams. Text appears only where the config gives it (`placement.allocation`,
`placement.strategy`) and in `RunPlan.specs`, for logs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import jax

from jaxrlhf.algorithms.pairs import check_pair_split
from jaxrlhf.algorithms.spec import BatchKind
from jaxrlhf.dataflow.graph import DataflowGraph
from jaxrlhf.dataflow.placement import Placement, PlacementError, resolve_placement
from jaxrlhf.engine.microbatch import MicrobatchConfig, num_microbatches
from jaxrlhf.mfc import MFC, Call, Role
from jaxrlhf.parallel.layout import Layout, make_layout
from jaxrlhf.plan.allocation import Entry, parse_allocation, plan_of
from jaxrlhf.plan.choice import CallChoice, ExecutionPlan
from jaxrlhf.plan.cluster import load_cluster
from jaxrlhf.plan.search import search
from jaxrlhf.spec import RunSpec


@dataclasses.dataclass(frozen=True)
class RunPlan:
    """What runs where: the execution plan and its layouts on the present devices."""

    plan: ExecutionPlan
    layouts: Mapping[str, Layout]

    @property
    def specs(self) -> dict[str, str]:
        """MFC name -> its allocation entry (`RANGE:STRATEGY@N`), for reports."""
        return {name: str(choice) for name, choice in self.plan.items()}

    def micro_batches(self, name: str) -> int:
        return self.plan[name].micro_batches

    def home(self, graph: DataflowGraph, role: Role) -> Layout:
        """A model's home: the layout of its train_step, else of its first call."""
        calls = graph.calls_of(role)
        train = [m for m in calls if m.call is Call.TRAIN_STEP]
        return self.layouts[(train or list(calls))[0].name]


# placement.compile_check: the searched plans compiled, best first, until one fits
COMPILE_CHECK_PLANS = 3


def searched_plan(spec: RunSpec, devices: int | None = None) -> ExecutionPlan:
    """placement.kind=auto: the planner's plan for `placement.cluster`, a cluster of this job's
    `devices` (when given)."""
    return searched_plans(spec, devices, 1)[0]


def searched_plans(spec: RunSpec, devices: int | None = None,
                   count: int = 1) -> list[ExecutionPlan]:
    """placement.kind=auto: the planner's `count` best plans (`SearchReport.best`, fastest
    first) for `placement.cluster`, a cluster of this job's `devices` (when given)."""
    p = spec.placement
    if not p.cluster:
        raise PlacementError("placement.kind=auto needs placement.cluster (e.g. meshes/cpu_8.py)")
    cluster = load_cluster(p.cluster)
    if devices is not None and cluster.num_devices != devices:
        raise PlacementError(
            f"placement.cluster={p.cluster!r}: the plan is made for its {cluster.hosts} × "
            f"{cluster.devices_per_host} = {cluster.num_devices} devices, but this job has "
            f"{devices}; run on that cluster or set placement.cluster to a file for this one")
    report = search(spec.experiment(), cluster)
    if report.searched.plan is None:
        raise PlacementError(f"placement.kind=auto: no plan fits: {report.searched.reason}")
    best = report.best(count)
    print(f"planner: {best[0].name} plan, {best[0].step_seconds:.2f} s/step estimated "
          f"(search took {report.search_seconds:.1f} s)", flush=True)
    return [r.plan for r in best]


def _field(kind: Placement) -> str:
    """The config field a placement of this kind comes from, for error messages."""
    match kind:
        case Placement.AUTO:
            return "placement"
        case Placement.MANUAL:
            return "placement.allocation"
    return "placement.strategy"


def _entries(plan: ExecutionPlan) -> dict[str, Entry]:
    """A searched plan as an allocation (its entries carry their micro-batches)."""
    return {k: Entry(c.strategy, c.micro_batches) for k, c in plan.items()}


def _allocation(spec: RunSpec, n: int) -> dict[str, Entry]:
    """The placement on `n` devices as an allocation: MFC name -> Entry, in graph order (a
    searched plan's entries carry their micro-batches, the other kinds' only where `@N` says)."""
    p, graph = spec.placement, spec.graph
    match p.kind:
        case Placement.AUTO:
            return _entries(searched_plan(spec, n))
        case Placement.MANUAL:
            entries = parse_allocation(p.allocation)  # the config's text, read once
            strategies = resolve_placement(graph, p.kind, n, allocation={
                k: e.strategy for k, e in entries.items()})
            return {k: entries[k] for k in strategies}
    strategies = resolve_placement(graph, p.kind, n, p.strategy, gen_replicas=p.gen_replicas)
    return {k: Entry(s) for k, s in strategies.items()}


def _oversampled(spec: RunSpec) -> str:
    """"/ <algorithm>.oversample " where the algorithm trains a share of what it generates (the
    key is its own section's); "" otherwise."""
    return f"/ {spec.algorithm.name}.oversample " if spec.oversample > 1 else ""


def _micro_batches(spec: RunSpec, mfc: MFC, entry: Entry, where: str) -> int:
    """The micro-batches `mfc` runs with: the entry's count or the run's default, checked
    against the batch; raises PlacementError naming the MFC and the field."""
    strategy = entry.strategy
    per_update = (spec.train_rows // spec.mini_batches if mfc.call is Call.TRAIN_STEP
                  else spec.step_rows)
    if per_update % strategy.dp_size:
        raise PlacementError(
            f"{where}: MFC {mfc.name!r} ({strategy}) splits the batch {strategy.dp_size} ways, "
            f"which does not divide its batch of {per_update} (rollout.batch_size × group_size "
            f"{_oversampled(spec)}/ mini-batches)")
    if entry.micro_batches is None and mfc.call is not Call.TRAIN_STEP:
        # 1, or on a pipeline the most up to its stage count that split the rows evenly over
        # its data-parallel devices (fewer leave stages idle: the bubble is (p-1)/(M+p-1))
        return max(k for k in range(1, strategy.pipeline + 1)
                   if per_update % k == 0 and (per_update // k) % strategy.dp_size == 0)
    micro = (spec.micro if entry.micro_batches is None
             else MicrobatchConfig.by_count(entry.micro_batches))
    try:
        count = num_microbatches(micro, per_update, spec.rollout.seq_len, strategy.dp_size)
        if mfc.call is Call.TRAIN_STEP and spec.algorithm.batches is BatchKind.PAIRS:
            # a pair's loss needs its chosen and its rejected row in one micro-batch
            check_pair_split(spec.rollout.batch_size, count, "the number of micro-batches")
        return count
    except ValueError as e:
        field = "micro_batches" if entry.micro_batches is None else where
        raise PlacementError(f"{field}: MFC {mfc.name!r}: {e}") from None


def _checked(spec: RunSpec, allocation: Mapping[str, Entry]) -> ExecutionPlan:
    """`allocation` as a plan, each MFC's micro-batches checked against the batch."""
    where = _field(spec.placement.kind)
    return plan_of(allocation, lambda name, entry: _micro_batches(
        spec, spec.graph.mfc(name), entry, where))


def execution_plan(spec: RunSpec, num_devices: int) -> ExecutionPlan:
    """The plan the run runs on `num_devices` devices, whatever `placement.kind` says: every
    model MFC's devices, degrees and micro-batches, checked against the batch (not yet against
    the devices or the model: `place`). The planner's command line prices this same plan."""
    return _checked(spec, _allocation(spec, num_devices))


def place(spec: RunSpec) -> RunPlan:
    """Resolves and validates every model MFC's layout and micro-batches on this machine's
    devices; raises naming the MFC and the field."""
    devices = jax.devices()
    return run_plan(spec, execution_plan(spec, len(devices)), devices)


def place_candidates(spec: RunSpec) -> list[RunPlan]:
    """placement.compile_check: the searched plans the run may run, best first (at most
    `COMPILE_CHECK_PLANS`), each resolved and validated as `place` does the one plan. The
    best one's error is raised, naming the MFC and the field, as without the check; a later
    plan that does not validate is left out (the run would not have run it either)."""
    devices = jax.devices()
    best, *others = searched_plans(spec, len(devices), COMPILE_CHECK_PLANS)
    placed = [run_plan(spec, _checked(spec, _entries(best)), devices)]
    for plan in others:
        try:
            placed.append(run_plan(spec, _checked(spec, _entries(plan)), devices))
        except PlacementError:
            continue
    return placed


def run_plan(spec: RunSpec, plan: ExecutionPlan, devices: Sequence[jax.Device]) -> RunPlan:
    """`plan`'s layouts on `devices` (this machine's, or a described cluster's that calls are
    compiled for: `plan --compile`); raises naming the MFC and the field."""
    layouts = {}
    for name in filter(plan.__contains__, spec.graph.order):  # graph order, as MFCs run
        mfc, choice = spec.graph.mfc(name), plan[name]
        # a pipelined MFC's layout carries the micro-batches its pipeline streams
        micro = choice.micro_batches if choice.pipeline > 1 else None
        try:
            layouts[name] = make_layout(choice.strategy, model=spec.models[mfc.role].config,
                                        devices=devices, micro_batches=micro)
        except ValueError as e:
            raise PlacementError(f"{_field(spec.placement.kind)}: MFC {name!r} "
                                 f"({choice.strategy}): {e}") from None
    return RunPlan(plan, layouts)


def single(name: str, layout: Layout, micro_batches: int = 1) -> RunPlan:
    """A one-MFC plan (the warm start's SFT step on the trained model's home)."""
    choice = CallChoice.of(layout.strategy, micro_batches=micro_batches)
    return RunPlan(ExecutionPlan.of({name: choice}), {name: layout})
