"""An execution plan: for every model MFC, its device range, parallel degrees and micro-batches.

`CallChoice` is one MFC's decision and `ExecutionPlan` the whole assignment. Both are frozen and
hashable, so the search caches costs and evaluations by them. They travel as objects from the
planner and the config to the runtime; `str(choice)` is the allocation grammar's text of one MFC
(`RANGE:STRATEGY@MICRO_BATCHES`, see `plan.allocation`), for logs and printouts.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterator, Mapping

from jaxrlhf.parallel.strategy import Axis, DeviceRange, Strategy


@dataclasses.dataclass(frozen=True)
class CallChoice:
    """Where and how one MFC runs.

    Attributes:
      devices: its sub-mesh (a legal ReaL sub-mesh of the cluster).
      data, fsdp, tensor, pipeline, expert: parallel degrees; their product is the number of
        devices. Expert ranks (a mixture of experts' `e`) are data-parallel ranks for attention
        and dense layers, and each holds 1/e of every sparse layer's experts.
      micro_batches: slices of the MFC's batch (of one optimizer update when training). Without
        a pipeline they run one after the other; with one (pipeline > 1) the pipeline streams
        them through its stages, so more of them shrink the bubble, (p-1)/(M+p-1) of the time.
    """

    devices: DeviceRange
    data: int = 1
    fsdp: int = 1
    tensor: int = 1
    micro_batches: int = 1
    pipeline: int = 1  # after micro_batches, so positional construction stays valid
    expert: int = 1

    def __post_init__(self):
        if self.stage_size * self.pipeline != self.devices.size:
            raise ValueError(f"{self.axes_str()} needs {self.stage_size * self.pipeline} "
                             f"devices but range {self.devices} has {self.devices.size}")
        if self.micro_batches < 1:
            raise ValueError(f"micro_batches must be >= 1, got {self.micro_batches}")
        key = (self.devices.first, self.devices.last, self.data, self.fsdp, self.tensor,
               self.micro_batches, self.pipeline, self.expert)
        object.__setattr__(self, "_hash", hash(key))

    def __hash__(self) -> int:  # choices key every cache of the search: hash once
        return self._hash

    @classmethod
    def of(cls, strategy: Strategy, micro_batches: int = 1) -> "CallChoice":
        """From a parsed strategy string with a device range, e.g. parse_strategy("0-3:d2t2")."""
        if strategy.devices is None:
            raise ValueError(f"strategy {strategy} has no device range")
        return cls(strategy.devices, strategy.data, strategy.fsdp, strategy.tensor, micro_batches,
                   strategy.size(Axis.PIPELINE), strategy.size(Axis.EXPERT))

    @property
    def num_devices(self) -> int:
        return self.devices.size

    @property
    def stage_size(self) -> int:
        """Devices of one pipeline stage (all of them without a pipeline)."""
        return self.data * self.fsdp * self.tensor * self.expert

    @property
    def dp_size(self) -> int:
        """How many ways the batch is split: data × expert × fsdp."""
        return self.data * self.expert * self.fsdp

    @functools.cached_property
    def strategy(self) -> Strategy:
        """Cached: the cost model asks it for axis sizes (`Strategy.size`) millions of times."""
        return Strategy(self.data, self.fsdp, self.tensor, self.devices, self.pipeline,
                        self.expert)

    @property
    def param_layout(self) -> tuple[DeviceRange, int, int, int, int]:
        """What decides where parameter shards sit: equal keys need no reallocation."""
        return (self.devices, self.fsdp, self.tensor, self.pipeline, self.expert)

    def axes_str(self) -> str:
        """Degrees in the strategy grammar, e.g. `d4p16t2` (sizes of 1 left out)."""
        return Strategy(self.data, self.fsdp, self.tensor, None, self.pipeline,
                        self.expert).axes_str()

    def spec(self) -> str:
        """`RANGE:STRATEGY`, as `parallel.strategy.parse_strategy` reads it."""
        return str(self.strategy)

    def __str__(self) -> str:
        """`RANGE:STRATEGY@MICRO_BATCHES`, one MFC's entry of an allocation."""
        return f"{self.strategy}@{self.micro_batches}"

    def overlaps(self, other: "CallChoice") -> bool:
        return self.devices.first <= other.devices.last and other.devices.first <= self.devices.last


@dataclasses.dataclass(frozen=True)
class ExecutionPlan:
    """MFC name -> CallChoice for every model-backed MFC (host MFCs have none)."""

    choices: tuple[tuple[str, CallChoice], ...]

    def __post_init__(self):
        object.__setattr__(self, "_hash", hash(self.choices))
        object.__setattr__(self, "_by_name", dict(self.choices))

    def __hash__(self) -> int:
        return self._hash

    @classmethod
    def of(cls, choices: Mapping[str, CallChoice]) -> "ExecutionPlan":
        return cls(tuple(sorted(choices.items())))

    def __getitem__(self, name: str) -> CallChoice:
        return self._by_name[name]

    def __contains__(self, name: str) -> bool:
        return name in self._by_name

    def __iter__(self) -> Iterator[str]:
        return (key for key, _ in self.choices)

    def items(self) -> tuple[tuple[str, CallChoice], ...]:
        return self.choices

    def replace(self, **changes: CallChoice) -> "ExecutionPlan":
        return ExecutionPlan.of({**dict(self.choices), **changes})

    def micro_batches(self) -> dict[str, int]:
        return {name: choice.micro_batches for name, choice in self.choices}
