"""Placement strategies of the papers, resolved to one `Strategy` per MFC.

A placement gives every model MFC a `parallel.strategy.Strategy` with a device range: where it
runs and its parallel degrees (written "0-3:d2t2" in logs and configs). The micro-batches are
the run's to choose (`jaxrlhf.run.layouts.execution_plan`). The strategies:

  colocate    every MFC on all devices (DeepSpeed-Chat, ReaL's heuristic), one strategy.
  standalone  every model on its own devices: the actor half of them, the rest halved in turn.
  split       actor + ref on the first half, critics + reward + cost on the second (OpenRLHF).
  interleave  actor and critics on all devices; ref on the first half and reward/cost on the
              second, so the frozen models' inference runs side by side (FlexRLHF).
  disaggregate  generation on its own devices, disjoint from everything else (FlexRLHF's
              shadow actors, AReaL's rollout workers): the devices split into 1 + R equal
              blocks (R = `placement.gen_replicas`); every call but generation on the first
              (the trainer's), the actor's generate calls on the second (replica 1; replicas
              2..R run the same layout on blocks 3..R+1, jaxrlhf/run/async_procs.py). The
              trainer comes first so that, multi-process, it is process 0 (which writes the
              metrics and the summary). The trainer feeds generation new weights through
              `parallel.reshard`; with `async_rl.max_staleness` > 0 the two overlap.
  manual      one strategy per MFC, given in the config (its allocation, parsed by
              `jaxrlhf.plan.allocation`); here only checked to name every model MFC once.
  auto        the planner (jaxrlhf.plan) searches the plan for a cluster; the run stack
              (jaxrlhf.run.layouts) runs that ExecutionPlan as is, without coming here.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping

from jaxrlhf.dataflow.graph import Call, DataflowGraph, Role
from jaxrlhf.parallel.strategy import DeviceRange, Strategy, parse_strategy


class Placement(enum.Enum):
    COLOCATE = "colocate"
    STANDALONE = "standalone"
    SPLIT = "split"
    INTERLEAVE = "interleave"
    DISAGGREGATE = "disaggregate"
    MANUAL = "manual"
    AUTO = "auto"


class PlacementError(ValueError):
    """An allocation that cannot run; the message names the MFC and the config field."""


_ROLE_PRIORITY = (Role.ACTOR, Role.CRITIC, Role.COST_CRITIC, Role.REF, Role.REWARD, Role.COST)
_TRAINED = (Role.ACTOR, Role.CRITIC, Role.COST_CRITIC)


def _span(start: int, size: int) -> DeviceRange:
    return DeviceRange(start, start + size - 1)


def _data_parallel(start: int, size: int) -> Strategy:
    """Pure data parallelism over devices start..start+size-1."""
    return Strategy(data=size, devices=_span(start, size))


def _colocated(name: str, start: int, size: int, degrees: str) -> Strategy:
    """`placement.strategy`'s degrees (config text, e.g. "d2f2t2") on one device block; errors
    name the MFC and the field."""
    text = f"{_span(start, size)}:{degrees}"
    try:
        return parse_strategy(text)
    except ValueError as e:
        raise PlacementError(f"placement.strategy: MFC {name!r} ({text}): {e}") from None


def _halves(num_devices: int) -> tuple[tuple[int, int], tuple[int, int]]:
    if num_devices < 2:
        raise PlacementError(f"placement.kind needs at least 2 devices, have {num_devices}")
    half = num_devices // 2
    return (0, half), (half, num_devices - half)


def _standalone_blocks(roles: list[Role], num_devices: int) -> dict[Role, tuple[int, int]]:
    """Halving blocks in role priority order, each leaving a device for every role after it;
    the last role takes what is left."""
    if len(roles) > num_devices:
        raise PlacementError(
            f"placement.kind=standalone needs a device per model: {len(roles)} models, "
            f"{num_devices} devices"
        )
    blocks, start, left = {}, 0, num_devices
    for i, role in enumerate(roles):
        after = len(roles) - 1 - i
        size = left if not after else max(1, min(left // 2, left - after))
        blocks[role] = (start, size)
        start, left = start + size, left - size
    return blocks


def _role_blocks(kind: Placement, roles: list[Role], n: int) -> dict[Role, tuple[int, int]]:
    whole = (0, n)
    match kind:
        case Placement.COLOCATE:
            return {r: whole for r in roles}
        case Placement.STANDALONE:
            return _standalone_blocks(roles, n)
        case Placement.SPLIT:
            first, second = _halves(n)
            return {r: first if r in (Role.ACTOR, Role.REF) else second for r in roles}
        case Placement.INTERLEAVE:
            first, second = _halves(n)
            return {
                r: whole if r in _TRAINED else first if r is Role.REF else second
                for r in roles
            }
    raise PlacementError(f"placement.kind={kind.value} has no role blocks")


def _disaggregated(model_mfcs, num_devices: int, gen_replicas: int) -> dict[str, Strategy]:
    """Training calls on the first of 1 + gen_replicas equal device blocks, generate calls on
    the second (the first replica's)."""
    if not any(m.call is Call.GENERATE for m in model_mfcs):
        raise PlacementError("placement.kind=disaggregate separates generation from training; "
                             "this algorithm does not generate")
    blocks = 1 + gen_replicas
    if num_devices < blocks or num_devices % blocks:
        raise PlacementError(f"placement.gen_replicas={gen_replicas}: {num_devices} devices do "
                             f"not split into {blocks} equal blocks (trainer + replicas)")
    size = num_devices // blocks
    train, gen = (0, size), (size, size)
    return {m.name: _data_parallel(*(gen if m.call is Call.GENERATE else train))
            for m in model_mfcs}


def resolve_placement(
    graph: DataflowGraph,
    kind: Placement,
    num_devices: int,
    strategy: str = "",
    allocation: Mapping[str, Strategy] | None = None,
    gen_replicas: int = 1,
) -> dict[str, Strategy]:
    """One strategy, with its device range, per model-backed MFC.

    Args:
      graph: the algorithm's graph; host MFCs get no layout.
      kind: the placement strategy.
      num_devices: devices in the cluster.
      strategy: `placement.strategy`, colocate's degrees as the config writes them (e.g.
        "d2f2t2"), read here with the device range so that errors name the MFC; default pure
        data parallel.
      allocation: for manual placement, MFC name -> its strategy (with a device range).
      gen_replicas: for disaggregate, the generation replicas (each a device block).

    Returns:
      MFC name -> Strategy (e.g. data=8 on devices 0-7), in graph order. They are checked
      against the batch and the model later (`jaxrlhf.run.layouts`), before anything compiles.
    """
    model_mfcs = [graph.mfc(n) for n in graph.order if not graph.mfc(n).host]
    if kind is Placement.AUTO:
        raise PlacementError("placement.kind=auto is resolved by the planner before placement")
    if kind is Placement.MANUAL:
        allocation = dict(allocation or {})
        unknown = sorted(set(allocation) - {m.name for m in model_mfcs})
        if unknown:
            raise PlacementError(f"placement.allocation names unknown MFCs: {unknown}")
        missing = [m.name for m in model_mfcs if m.name not in allocation]
        if missing:
            raise PlacementError(f"placement.allocation has no layout for MFC(s) {missing}")
        return {m.name: allocation[m.name] for m in model_mfcs}
    if kind is Placement.DISAGGREGATE:
        return _disaggregated(model_mfcs, num_devices, gen_replicas)
    roles = [r for r in _ROLE_PRIORITY if any(m.role is r for m in model_mfcs)]
    blocks = _role_blocks(kind, roles, num_devices)
    strategies = {}
    for mfc in model_mfcs:
        start, size = blocks[mfc.role]
        strategies[mfc.name] = (_colocated(mfc.name, start, size, strategy)
                                if kind is Placement.COLOCATE and strategy
                                else _data_parallel(start, size))
    return strategies
