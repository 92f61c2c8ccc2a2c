"""The allocation grammar: an execution plan as text, for humans, that round-trips.

One MFC is `NAME=RANGE:STRATEGY[@MICRO_BATCHES]`, e.g. `actor_train=0-7:d2f2t2@4` (4
micro-batches); MFCs are separated by commas. `format_allocation(plan)` writes every MFC with
its micro-batch count, and `parse_allocation` reads it back into the same `ExecutionPlan`
(`plan_of`). A count left out means "the run's default" (`None` in `parse_allocation`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from jaxrlhf.plan.choice import CallChoice, ExecutionPlan
from jaxrlhf.parallel.strategy import parse_strategy


class AllocationError(ValueError):
    """Text that is not an allocation; the message names `placement.allocation`."""


@dataclasses.dataclass(frozen=True)
class Entry:
    """One MFC's entry: its strategy string (`RANGE:STRATEGY`) and micro-batches if given."""

    spec: str
    micro_batches: int | None = None


def parse_allocation(text: str) -> dict[str, Entry]:
    """MFC name -> Entry, in the order written."""
    allocation = {}
    for item in filter(None, (s.strip() for s in text.split(","))):
        name, sep, rest = item.partition("=")
        if not sep or not name.strip() or not rest.strip():
            raise AllocationError(
                f"placement.allocation entry {item!r} is not MFC=RANGE:STRATEGY (e.g. "
                "actor_gen=0-3:d4, or actor_train=0-3:d4@2 for 2 micro-batches)")
        spec, at, micro = rest.strip().partition("@")
        count = None
        if at:
            if not micro.isdigit() or int(micro) < 1:
                raise AllocationError(f"placement.allocation entry {item!r}: micro-batches "
                                      f"{micro!r} is not a count >= 1")
            count = int(micro)
        allocation[name.strip()] = Entry(spec, count)
    return allocation


def format_allocation(plan: ExecutionPlan) -> str:
    """The plan as `placement.allocation` text, micro-batches included."""
    return ",".join(f"{name}={choice.spec()}@{choice.micro_batches}"
                    for name, choice in plan.items())


def plan_of(allocation: Mapping[str, Entry], default_micro_batches: int = 1) -> ExecutionPlan:
    """The ExecutionPlan an allocation writes (entries need a device range)."""
    return ExecutionPlan.of({
        name: CallChoice.of(parse_strategy(e.spec), e.micro_batches or default_micro_batches)
        for name, e in allocation.items()})
