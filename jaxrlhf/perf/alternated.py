"""Alternatives measured alike: the calls of a benchmark row timed in turn, in one process, and
the rows printed as a fixed-width table (`perf.rollout_rows`, `perf.packing_rows`).

Timing the alternatives in turn, rather than one after the other, makes the load from other
processes (a shared machine, a CI runner) hit each of them alike, so that their ratio holds
where their absolute seconds do not.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Hashable, TypeVar

import jax

Name = TypeVar("Name", bound=Hashable)


def timed(fn: Callable[[], Any]) -> float:
    """Seconds of `fn()` until its results are ready on the device."""
    start = time.perf_counter()
    jax.block_until_ready(fn())
    return time.perf_counter() - start


def seconds(calls: Mapping[Name, Callable[[], Any]], repeats: int) -> dict[Name, list[float]]:
    """Each call's seconds over `repeats` rounds, every round calling each once in turn (compile
    them first: a round's calls should all be warm)."""
    measured = {name: [] for name in calls}
    for _ in range(repeats):
        for name, call in calls.items():
            measured[name].append(timed(call))
    return measured


@dataclasses.dataclass(frozen=True)
class Column:
    """One column of a table: its head, the row key it shows, right-aligned in `width`
    characters with the format `spec` (".3f"), the value multiplied by `scale` first."""

    head: str
    key: str
    width: int
    spec: str = ""
    scale: float = 1.0


def table(rows: Sequence[Mapping[str, Any]], columns: Sequence[Column]) -> str:
    """The rows as a text table: a head line, then one line a row, columns one space apart."""

    def cell(column: Column, row: Mapping[str, Any]) -> str:
        value = row[column.key]
        if column.scale != 1.0:
            value = column.scale * value
        return f"{value:>{column.width}{column.spec}}"

    lines = [" ".join(f"{c.head:>{c.width}}" for c in columns)]
    lines += [" ".join(cell(c, row) for c in columns) for row in rows]
    return "\n".join(lines)
