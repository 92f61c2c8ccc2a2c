"""Calls measured against the floor in rounds: the matmul probe and every call timed in turn.

A fraction of the floor divides two timings: the probe's (the machine's FLOP/s) and a call's.
On shared cores either one can be slowed by other processes, and a probe timed once before a
benchmark (or after it) says little about the seconds a call got minutes later: W-cpu's probe
ranged over 85-200 GFLOP/s under load. So every round times the probe (best of a few calls)
and then each call once, and each call's fraction of the floor is taken per round, against
that round's probe; the rounds give a median and a spread (lowest, highest).

Each timing is kept on two clocks:
  * WALL: seconds until the results are ready;
  * CPU: CPU seconds of this process, every thread (`time.process_time`). Time the process
    waits for the cores while others run does not count, so on a loaded host the CPU fraction
    (the probe's FLOPs per CPU second against the call's) holds where the wall one does not. It
    leaves out what a call loses to idle cores (work one thread does while the others wait
    counts its own seconds only), so a quiet host's wall fraction is the one that says how
    fast a call is; on accelerators CPU seconds are the host's, and only WALL counts.
"""

from __future__ import annotations

import dataclasses
import enum
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax


class Clock(enum.Enum):
    WALL = "wall"
    CPU = "cpu"


@dataclasses.dataclass(frozen=True)
class Seconds:
    """One timing on both clocks."""

    wall: float
    cpu: float

    def on(self, clock: Clock) -> float:
        return self.wall if clock is Clock.WALL else self.cpu


def timed(fn: Callable[[], Any]) -> Seconds:
    """Wall and CPU seconds of `fn()` until its results are ready."""
    wall, cpu = time.perf_counter(), time.process_time()
    jax.block_until_ready(fn())
    return Seconds(time.perf_counter() - wall, time.process_time() - cpu)


@dataclasses.dataclass(frozen=True)
class Spread:
    """A median and the range around it, of one figure over the rounds."""

    median: float
    low: float
    high: float

    @staticmethod
    def of(values: Sequence[float]) -> "Spread":
        return Spread(statistics.median(values), min(values), max(values))

    def percent(self) -> str:
        """'61.2% (58.0-63.1)': the median, then the lowest and highest round."""
        return f"{self.median:.1%} ({100 * self.low:.1f}-{100 * self.high:.1f})"

    def as_dict(self) -> dict[str, float]:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class Row:
    """One call's timings over the rounds.

    Attributes:
      name: the call (an MFC's name, or "step").
      flops: its model FLOPs (`perf.flops.call_flops`).
      seconds_r: one timing per round.
    """

    name: str
    flops: float
    seconds_r: tuple[Seconds, ...]

    def seconds(self, clock: Clock) -> Spread:
        return Spread.of([s.on(clock) for s in self.seconds_r])


@dataclasses.dataclass(frozen=True)
class Rounds:
    """The probe's and every call's timings, round by round.

    Attributes:
      probe_flops: FLOPs of one probe call.
      probe_r: per round, the best of that round's probe calls on each clock.
      rows: the calls, in the order they ran in each round.
    """

    probe_flops: float
    probe_r: tuple[Seconds, ...]
    rows: tuple[Row, ...]

    def peak(self, clock: Clock) -> Spread:
        """The probe's FLOP/s (per CPU second on the CPU clock) over the rounds."""
        return Spread.of([self.probe_flops / s.on(clock) for s in self.probe_r])

    def fraction(self, row: Row, clock: Clock) -> Spread:
        """The row's fraction of the floor over the rounds, each round's against its own
        probe: (FLOPs / the round's probe rate) / the call's seconds."""
        return Spread.of([row.flops / self.probe_flops * probe.on(clock) / call.on(clock)
                          for probe, call in zip(self.probe_r, row.seconds_r, strict=True)])

    def best_fraction(self, row: Row, clock: Clock) -> float:
        """The best call against the best probe (load only slows either)."""
        return (row.flops / self.probe_flops * min(p.on(clock) for p in self.probe_r)
                / min(s.on(clock) for s in row.seconds_r))


def measure(probe: Callable[[], Any], probe_flops: float,
            calls: Mapping[str, tuple[Callable[[], Any], float]], rounds: int,
            probe_calls: int = 2) -> Rounds:
    """`rounds` rounds of: the probe `probe_calls` times, then each call once, in order.

    Args:
      probe: the compiled matmul probe (`perf.floor.machine_probe`).
      probe_flops: its FLOPs.
      calls: name -> (a call, warm: compiled already; its FLOPs).
      rounds: how many rounds.
      probe_calls: probe calls per round; the best on each clock counts.
    """
    jax.block_until_ready(probe())
    probe_r, seconds = [], {name: [] for name in calls}
    for _ in range(rounds):
        probes = [timed(probe) for _ in range(probe_calls)]
        probe_r.append(Seconds(min(p.wall for p in probes), min(p.cpu for p in probes)))
        for name, (call, _) in calls.items():
            seconds[name].append(timed(call))
    rows = tuple(Row(name, flops, tuple(seconds[name])) for name, (_, flops) in calls.items())
    return Rounds(probe_flops, tuple(probe_r), rows)
