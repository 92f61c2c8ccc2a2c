"""Where every MFC runs: the spec's placement resolved, once, into a `RunPlan`.

A `RunPlan` is the planner's `ExecutionPlan` (each MFC's devices, degrees and micro-batches)
plus the layouts built from it on this machine's devices. `placement.kind=auto` runs exactly
the searched plan, micro-batches included; the other kinds are written as the same object
(train_step micro-batches from `micro_batches`/`micro_batch_tokens` unless `@N` says otherwise,
one for generate and inference, or on a pipeline up to its stage count). A pipelined MFC's layout
carries its count (`Layout.micro_batches`): the micro-batches its pipeline streams.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import jax

from jaxrlhf.algorithms.pairs import check_pair_split
from jaxrlhf.algorithms.spec import BatchKind
from jaxrlhf.dataflow.graph import DataflowGraph
from jaxrlhf.dataflow.placement import Placement, PlacementError, resolve_placement
from jaxrlhf.engine.microbatch import MicrobatchConfig, num_microbatches
from jaxrlhf.mfc import MFC, Call, Role
from jaxrlhf.parallel.layout import Layout, make_layout
from jaxrlhf.plan.allocation import Entry, parse_allocation
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
        return {name: f"{c.spec()}@{c.micro_batches}" for name, c in self.plan.items()}

    def micro_batches(self, name: str) -> int:
        return self.plan[name].micro_batches

    def home(self, graph: DataflowGraph, role: Role) -> Layout:
        """A model's home: the layout of its train_step, else of its first call."""
        calls = graph.calls_of(role)
        train = [m for m in calls if m.call is Call.TRAIN_STEP]
        return self.layouts[(train or list(calls))[0].name]


def searched_plan(spec: RunSpec, devices: int | None = None) -> ExecutionPlan:
    """placement.kind=auto: the planner's plan for `placement.cluster`, a cluster of this job's
    `devices` (when given)."""
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
    print(f"planner: searched plan, {report.searched.step_seconds:.2f} s/step estimated "
          f"(search took {report.search_seconds:.1f} s)", flush=True)
    return report.searched.plan


def _entries(spec: RunSpec, n: int) -> tuple[dict[str, Entry], str]:
    """(MFC name -> Entry, the field the entries come from) on `n` devices."""
    p, graph = spec.placement, spec.graph
    match p.kind:
        case Placement.AUTO:
            plan = searched_plan(spec, n)
            return {k: Entry(c.spec(), c.micro_batches) for k, c in plan.items()}, "placement"
        case Placement.MANUAL:
            entries = parse_allocation(p.allocation)
            specs = resolve_placement(graph, p.kind, n, allocation={
                k: e.spec for k, e in entries.items()})
            return {k: entries[k] for k in specs}, "placement.allocation"
    specs = resolve_placement(graph, p.kind, n, p.strategy, gen_replicas=p.gen_replicas)
    return {k: Entry(s) for k, s in specs.items()}, "placement.strategy"


def _micro_batches(spec: RunSpec, mfc: MFC, layout: Layout, entry: Entry, where: str) -> int:
    rows = spec.step_rows
    per_update = rows // spec.mini_batches if mfc.call is Call.TRAIN_STEP else rows
    if per_update % layout.dp_size:
        raise PlacementError(
            f"{where}: MFC {mfc.name!r} ({entry.spec}) splits the batch {layout.dp_size} ways, "
            f"which does not divide its batch of {per_update} (rollout.batch_size × group_size "
            f"/ mini-batches)")
    if entry.micro_batches is None and mfc.call is not Call.TRAIN_STEP:
        # 1, or on a pipeline the most up to its stage count that split the rows evenly over
        # its data-parallel devices (fewer leave stages idle: the bubble is (p-1)/(M+p-1))
        return max(k for k in range(1, layout.pipeline + 1)
                   if per_update % k == 0 and (per_update // k) % layout.dp_size == 0)
    micro = (spec.micro if entry.micro_batches is None
             else MicrobatchConfig.by_count(entry.micro_batches))
    try:
        count = num_microbatches(micro, per_update, spec.rollout.seq_len, layout.dp_size)
        if mfc.call is Call.TRAIN_STEP and spec.algorithm.batches is BatchKind.PAIRS:
            # a pair's loss needs its chosen and its rejected row in one micro-batch
            check_pair_split(spec.rollout.batch_size, count, "the number of micro-batches")
        return count
    except ValueError as e:
        field = "micro_batches" if entry.micro_batches is None else where
        raise PlacementError(f"{field}: MFC {mfc.name!r}: {e}") from None


def place(spec: RunSpec) -> RunPlan:
    """Resolves and validates every model MFC's layout and micro-batches; raises naming the MFC
    and the field."""
    devices = jax.devices()
    entries, where = _entries(spec, len(devices))
    choices, layouts = {}, {}
    for name, entry in entries.items():
        mfc = spec.graph.mfc(name)
        try:
            layout = make_layout(entry.spec, model=spec.models[mfc.role].config, devices=devices)
        except ValueError as e:
            raise PlacementError(f"{where}: MFC {name!r} ({entry.spec}): {e}") from None
        micro = _micro_batches(spec, mfc, layout, entry, where)
        if layout.pipeline > 1:  # the pipeline streams `micro` micro-batches through its stages
            layout = dataclasses.replace(layout, micro_batches=micro)
        layouts[name] = layout
        choices[name] = CallChoice.of(layout.strategy, micro_batches=micro)
    return RunPlan(ExecutionPlan.of(choices), layouts)


def single(name: str, layout: Layout, micro_batches: int = 1) -> RunPlan:
    """A one-MFC plan (the warm start's SFT step on the trained model's home)."""
    choice = CallChoice.of(layout.strategy, micro_batches=micro_batches)
    return RunPlan(ExecutionPlan.of({name: choice}), {name: layout})
