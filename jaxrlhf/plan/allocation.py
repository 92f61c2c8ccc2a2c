"""The allocation: an execution plan before every micro-batch count is known, and its text.

An allocation gives each model MFC an `Entry`: a strategy with a device range, and a micro-batch
count when one is fixed. The text form is for humans and sits at the edges only (the config's
`placement.allocation`, the planner's printout): one MFC is `NAME=RANGE:STRATEGY[@MICRO_BATCHES]`,
e.g. `actor_train=0-7:d2f2t2@4` (4 micro-batches), MFCs separated by commas.
`parse_allocation` reads it once; `format_allocation(plan)` writes every MFC with its count, so
`plan_of(parse_allocation(format_allocation(plan))) == plan`.

`plan_of` is the one door from an allocation to an `ExecutionPlan`; a count left out is the
run's default, which the caller supplies (`jaxrlhf.run.layouts.execution_plan`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping

from jaxrlhf.parallel.strategy import Strategy, parse_strategy
from jaxrlhf.plan.choice import CallChoice, ExecutionPlan


class AllocationError(ValueError):
    """Text that is not an allocation; the message names `placement.allocation`."""


@dataclasses.dataclass(frozen=True)
class Entry:
    """One MFC's entry: its strategy (with a device range) and its micro-batches if fixed."""

    strategy: Strategy
    micro_batches: int | None = None

    def __post_init__(self):
        if self.strategy.devices is None:
            raise AllocationError(f"strategy {self.strategy} has no device range (e.g. 0-3:d4)")

    def __str__(self) -> str:
        count = "" if self.micro_batches is None else f"@{self.micro_batches}"
        return f"{self.strategy}{count}"


def _entry(item: str) -> tuple[str, Entry]:
    """One `NAME=RANGE:STRATEGY[@MICRO_BATCHES]` item, read."""
    name, sep, rest = item.partition("=")
    name, rest = name.strip(), rest.strip()
    if not sep or not name or not rest:
        raise AllocationError(
            f"placement.allocation entry {item!r} is not MFC=RANGE:STRATEGY (e.g. "
            "actor_gen=0-3:d4, or actor_train=0-3:d4@2 for 2 micro-batches)")
    text, at, micro = rest.partition("@")
    if at and (not micro.isdigit() or int(micro) < 1):
        raise AllocationError(f"placement.allocation entry {item!r}: micro-batches {micro!r} "
                              "is not a count >= 1")
    try:
        return name, Entry(parse_strategy(text), int(micro) if at else None)
    except ValueError as e:  # AllocationError included: name the MFC and the field
        raise AllocationError(f"placement.allocation: MFC {name!r} ({text}): {e}") from None


def parse_allocation(text: str) -> dict[str, Entry]:
    """MFC name -> Entry, in the order written; an MFC named twice is an AllocationError."""
    entries = [_entry(item) for item in filter(None, (s.strip() for s in text.split(",")))]
    names = [name for name, _ in entries]
    if twice := sorted({name for name in names if names.count(name) > 1}):
        raise AllocationError(f"placement.allocation names {', '.join(map(repr, twice))} more "
                              "than once (one entry per MFC)")
    return dict(entries)


def format_allocation(plan: ExecutionPlan) -> str:
    """The plan as `placement.allocation` text, micro-batches included."""
    return ",".join(f"{name}={choice}" for name, choice in plan.items())


def _given(name: str, entry: Entry) -> int:
    if entry.micro_batches is None:
        raise AllocationError(f"placement.allocation: MFC {name!r} ({entry}) has no "
                              "micro-batch count (@N) and no default was given")
    return entry.micro_batches


def plan_of(allocation: Mapping[str, Entry],
            micro_batches: Callable[[str, Entry], int] = _given) -> ExecutionPlan:
    """The ExecutionPlan an allocation describes.

    Args:
      allocation: MFC name -> Entry.
      micro_batches: (MFC name, its entry) -> the count it runs with: the entry's own or the
        run's default, checked against the run's batch (raising naming the MFC). Default:
        every entry must carry its count.
    """
    return ExecutionPlan.of({name: CallChoice.of(entry.strategy, micro_batches(name, entry))
                             for name, entry in allocation.items()})
