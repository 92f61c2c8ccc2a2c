"""Which block of every parameter matrix each device of a layout holds.

A layout's mesh is its device range reshaped to the runtime's mesh axes (`mesh_order`,
row-major), and the big matrices are cut along the layer stack by pipeline, along `embed` by
fsdp, over the experts by expert and along heads / mlp / vocab by tensor. So the device at mesh
index i holds block (stage, fsdp, expert, tensor index) of every matrix (`device_blocks`),
whatever the data degree. Both the cost model (bytes a reallocation moves) and the memory model
(the buffers a reallocation holds) ask how much of a destination block its device already holds
under the source layout (`missing_share`).
"""

from __future__ import annotations

import functools
import math

import numpy as np

from jaxrlhf.parallel import strategy as strategy_lib
from jaxrlhf.parallel.strategy import Axis
from jaxrlhf.plan.choice import CallChoice

CUTS = (Axis.PIPELINE, Axis.FSDP, Axis.EXPERT, Axis.TENSOR)  # the axes that cut parameters


@functools.cache
def mesh_order() -> tuple[Axis, ...]:
    """The runtime's mesh axes, outermost first. Where the strategy module does not place the
    pipeline axis, it is outermost (ReaL's and Megatron's order: a stage is a block of
    consecutive devices, so stage-to-stage sends are the only traffic between blocks)."""
    order = strategy_lib.MESH_AXES
    return order if Axis.PIPELINE in order else (Axis.PIPELINE, *order)


def axis_size(choice: CallChoice, axis: Axis) -> int:
    return choice.strategy.size(axis)


def stride(axis: Axis, choice: CallChoice) -> int:
    """Device-index distance between neighbours along `axis` (row-major mesh)."""
    order = mesh_order()
    return math.prod(axis_size(choice, a) for a in order[order.index(axis) + 1:])


def device_blocks(choice: CallChoice, devices: np.ndarray) -> tuple[np.ndarray, ...]:
    """(stage, fsdp, expert, tensor index) of each device's block under `choice`, one [n]
    array per axis of `CUTS`. The expert axis cuts only the experts, but they are nearly all of
    a mixture's bytes (Qwen3-30B-A3B: 95%), so it is counted as cutting every matrix."""
    i = devices - choice.devices.first
    return tuple((i // stride(axis, choice)) % axis_size(choice, axis) for axis in CUTS)


def _overlap(i: np.ndarray, n: int, j: np.ndarray, m: int) -> np.ndarray:
    """Length of [i/n, (i+1)/n) ∩ [j/m, (j+1)/m), as a fraction of the whole axis."""
    return np.clip(np.minimum((i + 1) / n, (j + 1) / m) - np.maximum(i / n, j / m), 0.0, None)


def missing_share(src: CallChoice, dst: CallChoice) -> np.ndarray:
    """Per destination device, [n]: the share of its `dst` shard of the parameters that it does
    not hold under `src` (1: all must arrive; 0: its shard is cut out of its own source shard)."""
    devices = np.arange(dst.devices.first, dst.devices.last + 1)
    held = (devices >= src.devices.first) & (devices <= src.devices.last)
    kept = held.astype(np.float64)
    for axis, i_dst, i_src in zip(CUTS, device_blocks(dst, devices), device_blocks(src, devices)):
        kept *= _overlap(i_dst, axis_size(dst, axis), i_src, axis_size(src, axis))
    return 1.0 - kept * dst.fsdp * dst.tensor * dst.pipeline * dst.expert
