"""The strategy grammar: `[range ":"] (letter size)+`, e.g. `0-7:d2f2t2`, `0-7:d2e4`, `f8`.

    spec    := [range ":"] axes
    range   := INT ["-" INT]              inclusive device indices, e.g. 0-7 or 3
    axes    := (LETTER INT)+              each letter at most once, any order
    LETTER  := "d" (data) | "e" (expert) | "f" (fsdp) | "t" (tensor) | "p" (pipeline)

Missing letters mean size 1. With `p` > 1 the model's layers are cut into that many stages, one
per slice of the mesh's "pipeline" axis (see `jaxrlhf/parallel/pipeline.py`).

`e` is expert parallelism for mixture-of-experts models: the ranks of the "expert" axis are
data-parallel ranks for attention and the dense layers (the batch is split over d×e×f, as
Megatron and MaxText do) and each holds 1/e of every sparse layer's experts; tokens travel to
their experts by all-to-all (`jaxrlhf/models/expert_parallel.py`). A dense model with e > 1 is
refused (`check_model`): it has no experts to split, and calling its data axis `e` would only
make two names for one thing.

The parser is a regex tokenizer plus a small recursive-descent reader, so every malformed
string gets a one-line `ValueError` naming the problem. Checks that
need to know the devices or the model live in `check_devices` / `check_model`.
"""

from __future__ import annotations

import dataclasses
import enum
import re

from jaxrlhf.models.config import ModelConfig


class Axis(enum.Enum):
    """Parallelism axes; the values are the mesh axis names."""

    DATA = "data"
    FSDP = "fsdp"
    TENSOR = "tensor"
    PIPELINE = "pipeline"
    EXPERT = "expert"


LETTERS: dict[str, Axis] = {"d": Axis.DATA, "e": Axis.EXPERT, "f": Axis.FSDP, "t": Axis.TENSOR,
                            "p": Axis.PIPELINE}
# Mesh axis order: pipeline outermost (stages talk least: one activation per micro-batch),
# tensor innermost (it talks most: neighbouring devices are the best connected); expert just
# outside tensor, since its all-to-all moves every routed token twice per sparse layer.
MESH_AXES: tuple[Axis, ...] = (Axis.PIPELINE, Axis.DATA, Axis.FSDP, Axis.EXPERT, Axis.TENSOR)
# Order of the letters when a strategy is written (as ReaL writes plans, e.g. d4p16t2).
_WRITE_ORDER: tuple[Axis, ...] = (Axis.DATA, Axis.EXPERT, Axis.PIPELINE, Axis.FSDP, Axis.TENSOR)
MESH_AXIS_NAMES: tuple[str, ...] = tuple(axis.value for axis in MESH_AXES)


@dataclasses.dataclass(frozen=True)
class DeviceRange:
    """Inclusive range of device indices `first..last` into a device list."""

    first: int
    last: int

    def __post_init__(self):
        if self.first < 0:
            raise ValueError(f"device range {self} starts below 0")
        if self.last < self.first:
            raise ValueError(f"device range {self.first}-{self.last} is reversed")

    @property
    def size(self) -> int:
        return self.last - self.first + 1

    def indices(self) -> range:
        return range(self.first, self.last + 1)

    def __str__(self) -> str:
        return str(self.first) if self.size == 1 else f"{self.first}-{self.last}"


@dataclasses.dataclass(frozen=True)
class Strategy:
    """data × fsdp × tensor × pipeline × expert parallel sizes, optionally pinned to a device
    range."""

    data: int = 1
    fsdp: int = 1
    tensor: int = 1
    devices: DeviceRange | None = None
    pipeline: int = 1  # after devices, so positional construction without a pipeline stays valid
    expert: int = 1

    def __post_init__(self):
        for axis in MESH_AXES:
            size = self.size(axis)
            if not isinstance(size, int) or size < 1:
                raise ValueError(f"{axis.value} size must be a positive integer, got {size!r}")
        if self.devices is not None and self.devices.size != self.num_devices:
            raise ValueError(
                f"strategy {self.axes_str()} uses {self.num_devices} devices but range "
                f"{self.devices} has {self.devices.size}"
            )

    def size(self, axis: Axis) -> int:
        match axis:
            case Axis.DATA:
                return self.data
            case Axis.FSDP:
                return self.fsdp
            case Axis.TENSOR:
                return self.tensor
            case Axis.PIPELINE:
                return self.pipeline
            case Axis.EXPERT:
                return self.expert

    @property
    def num_devices(self) -> int:
        return self.data * self.fsdp * self.tensor * self.pipeline * self.expert

    @property
    def mesh_shape(self) -> tuple[int, ...]:
        return tuple(self.size(axis) for axis in MESH_AXES)

    @property
    def dp_size(self) -> int:
        """How many ways the batch is split (data × expert × fsdp)."""
        return self.data * self.expert * self.fsdp

    def axes_str(self) -> str:
        letters = {axis: letter for letter, axis in LETTERS.items()}
        return "".join(f"{letters[a]}{self.size(a)}" for a in _WRITE_ORDER
                       if self.size(a) > 1) or "d1"

    def __str__(self) -> str:
        prefix = "" if self.devices is None else f"{self.devices}:"
        return prefix + self.axes_str()

    def check_devices(self, num_available: int) -> DeviceRange:
        """The device range this strategy occupies among `num_available` devices.

        Without an explicit range the strategy must span all devices.
        """
        if self.devices is None:
            if self.num_devices != num_available:
                raise ValueError(
                    f"strategy {self} uses {self.num_devices} devices but {num_available} are "
                    f"given; add a device range such as '0-{self.num_devices - 1}:{self}'"
                )
            return DeviceRange(0, num_available - 1)
        if self.devices.last >= num_available:
            raise ValueError(
                f"device range {self.devices} is out of bounds for {num_available} devices"
            )
        return self.devices

    def check_model(self, model: ModelConfig) -> None:
        """Tensor parallelism splits attention heads, so t must divide both head counts; a
        pipeline gives every stage the same number of layers, so p must divide the layers;
        expert parallelism splits the experts, so the model must have them and e divide them."""
        if self.expert > 1:
            if model.moe is None:
                as_data = dataclasses.replace(self, data=self.data * self.expert, expert=1)
                raise ValueError(f"strategy {self} has expert={self.expert} but the model is "
                                 f"dense (no experts to split); use {as_data.axes_str()} "
                                 f"instead")
            if model.moe.num_experts % self.expert:
                raise ValueError(f"expert={self.expert} does not divide the model's "
                                 f"num_experts={model.moe.num_experts}")
        for what, count in (("num_heads", model.num_heads), ("num_kv_heads", model.num_kv_heads)):
            if count % self.tensor:
                raise ValueError(
                    f"tensor={self.tensor} does not divide the model's {what}={count}"
                )
        if model.num_layers % self.pipeline:
            raise ValueError(f"pipeline={self.pipeline} does not divide the model's "
                             f"num_layers={model.num_layers}")


_TOKEN = re.compile(r"\s*(?:(?P<int>\d+)|(?P<letter>[A-Za-z])|(?P<punct>[-:])|(?P<bad>\S))")


def _tokenize(spec: str) -> list[tuple[str, str]]:
    tokens = []
    for match in _TOKEN.finditer(spec):
        kind = match.lastgroup
        if kind == "bad":
            raise ValueError(f"unexpected character {match.group(kind)!r} in strategy {spec!r}")
        tokens.append((kind, match.group(kind)))
    return tokens


class _Reader:
    """Recursive-descent reader over the token list."""

    def __init__(self, spec: str):
        self.spec = spec
        self.tokens = _tokenize(spec)
        self.pos = 0

    def peek(self, offset: int = 0) -> tuple[str, str] | None:
        i = self.pos + offset
        return self.tokens[i] if i < len(self.tokens) else None

    def take(self) -> tuple[str, str]:
        token = self.tokens[self.pos]
        self.pos += 1
        return token

    def device_range(self) -> DeviceRange | None:
        has_range = any(tok == ("punct", ":") for tok in self.tokens)
        if not has_range:
            return None
        first = self.integer("device range start")
        last = first
        if self.peek() == ("punct", "-"):
            self.take()
            last = self.integer("device range end")
        if self.peek() != ("punct", ":"):
            raise ValueError(f"expected ':' after device range in strategy {self.spec!r}")
        self.take()
        if last < first:
            raise ValueError(f"device range {first}-{last} is reversed in strategy {self.spec!r}")
        return DeviceRange(first, last)

    def integer(self, what: str) -> int:
        token = self.peek()
        if token is None or token[0] != "int":
            raise ValueError(f"expected an integer for {what} in strategy {self.spec!r}")
        return int(self.take()[1])

    def axes(self) -> dict[Axis, int]:
        sizes: dict[Axis, int] = {}
        if self.peek() is None:
            raise ValueError(f"strategy {self.spec!r} names no parallel axes")
        while self.peek() is not None:
            kind, text = self.take()
            if kind != "letter":
                raise ValueError(f"expected an axis letter, got {text!r} in strategy {self.spec!r}")
            letter = text.lower()
            if letter not in LETTERS:
                raise ValueError(
                    f"unknown axis letter {text!r} in strategy {self.spec!r}; "
                    f"known: {', '.join(LETTERS)}"
                )
            axis = LETTERS[letter]
            if axis in sizes:
                raise ValueError(f"axis letter {letter!r} repeated in strategy {self.spec!r}")
            nxt = self.peek()
            if nxt is None or nxt[0] != "int":
                raise ValueError(f"missing size after {letter!r} in strategy {self.spec!r}")
            size = int(self.take()[1])
            if size < 1:
                raise ValueError(f"size of {letter!r} must be at least 1 in strategy {self.spec!r}")
            sizes[axis] = size
        return sizes


def parse_strategy(spec: str) -> Strategy:
    """Parses `[range:]axes`, e.g. "0-7:d2f2t2" -> Strategy(2, 2, 2, DeviceRange(0, 7)),
    "0-7:d2p2t2" -> Strategy(2, 1, 2, DeviceRange(0, 7), pipeline=2),
    "0-7:d2e4" -> Strategy(data=2, expert=4, devices=DeviceRange(0, 7))."""
    reader = _Reader(spec)
    devices = reader.device_range()
    sizes = reader.axes()
    strategy = Strategy(
        data=sizes.get(Axis.DATA, 1), fsdp=sizes.get(Axis.FSDP, 1),
        tensor=sizes.get(Axis.TENSOR, 1), pipeline=sizes.get(Axis.PIPELINE, 1),
        expert=sizes.get(Axis.EXPERT, 1),
    )
    if devices is not None and devices.size != strategy.num_devices:
        raise ValueError(
            f"strategy {spec!r} uses {strategy.num_devices} devices but range {devices} "
            f"has {devices.size}"
        )
    return dataclasses.replace(strategy, devices=devices)

