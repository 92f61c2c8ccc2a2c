"""What a device holds while a model's parameters move from one layout to another.

Reallocation (`parallel.reshard.reshard`) runs chunk by chunk; beside the two layouts each
chunk's program holds collective buffers (`move_memory`). A copy whose every shard contains the
home shard replaces the home parameters while it lives (`holds_home_shards`), so its move frees
the source as it goes. The memory model (`plan/memory.py`) adds a move's peak to what the
devices keep; `plan --compile` sets XLA's figure beside `MoveMemory.program`.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jaxrlhf.parallel.reshard import CHUNK_BYTES, chunks
from jaxrlhf.plan.blocks import missing_share
from jaxrlhf.plan.choice import CallChoice
from jaxrlhf.plan.profile import ModelProfile


def holds_home_shards(home: CallChoice, other: CallChoice) -> bool:
    """Whether, on the same devices, every device's shard of a parameter under `other`
    contains its shard under `home` (`parallel.reshard.contains_shards` for shardings).

    Then a copy on `other` replaces the home parameters while it lives (zero-redundancy
    reallocation, `dataflow.runtime.ModelRuntime.params_on`). Per mesh axis that shards
    parameters (pipeline: layers, fsdp: embed, tensor: heads/mlp/vocab), a device's slice
    index under `other` must be its home index coarsened by the ratio of the two degrees
    (the mesh order is pipeline, data, fsdp, tensor; device k's index on an axis of size n
    and stride w is k // w % n)."""
    if home.devices != other.devices:
        return False

    def strides(c: CallChoice) -> dict[str, tuple[int, int]]:
        return {"pipeline": (c.stage_size, c.pipeline),
                "fsdp": (c.expert * c.tensor, c.fsdp), "expert": (c.tensor, c.expert),
                "tensor": (1, c.tensor)}

    mine, theirs = strides(home), strides(other)
    for axis, (w_home, n_home) in mine.items():
        w_other, n_other = theirs[axis]
        if n_home % n_other:
            return False
        ratio = n_home // n_other
        if any(k // w_other % n_other != k // w_home % n_home // ratio
               for k in range(home.devices.size)):
            return False
    return True


@dataclasses.dataclass(frozen=True)
class MoveMemory:
    """Bytes per device while `parallel.reshard.reshard` moves a model's parameters from one
    layout to another (a copy on another call's layout), chunk by chunk.

    Attributes:
      source, destination: the parameters' shards on the two layouts (a leaf whose layout
        does not change, such as a norm scale both leave whole, counts on both sides).
      temporaries: the collective buffers of the largest chunk (`move_memory`).
      source_chunk: the largest chunk's source shards.
    """

    source: int
    destination: int
    temporaries: int
    source_chunk: int

    @property
    def program(self) -> int:
        """What the move's programs hold at once: both layouts whole and the largest chunk's
        buffers (`plan --compile` sets XLA's figure beside it)."""
        return self.source + self.destination + self.temporaries

    def peak(self, frees_source: bool) -> int:
        """The move's peak on a device; `frees_source`: the copy replaces the source
        (`holds_home_shards`), which is deleted chunk by chunk as it is moved, so at the last
        chunk the destination is whole beside that chunk's source alone."""
        if frees_source:
            return self.destination + self.source_chunk + self.temporaries
        return self.program


def move_memory(p: ModelProfile, src: CallChoice, dst: CallChoice,
                chunk_bytes: int = CHUNK_BYTES) -> MoveMemory:
    """A model's move from `src`'s parameter layout to `dst`'s, per device.

    `reshard` moves the leaves in chunks of at most `chunk_bytes` global bytes (a bigger leaf
    alone), waiting for each. Beside its two layouts a chunk's program holds buffers, as XLA's
    partitioner forms them (measured on TPU v5p 2x2x1, tests/test_plan_compile.py):
      * a gather (each device's destination shard contains its source shard,
        `holds_home_shards(src, dst)`, e.g. f4 -> d4): the chunk's destination shards, the
        gathered result, which is then laid out into the output;
      * any other change: the part of the chunk's destination shards a device does not hold
        already (`blocks.missing_share`, the most of any device): an exchange buffers what
        crosses, and a device that cuts its destination shard out of its own source shard
        (d4 -> f4) buffers nothing;
      * none where no program runs (copies of equal shards onto other devices).
    Moves out of a pipelined layout, whose stacked layers XLA re-slices along the layer axis,
    hold more than this (up to a third more on v5p 2x2x1)."""
    src_b = p.leaf_shard_bytes(src.tensor, src.fsdp, src.pipeline, src.expert)
    dst_b = p.leaf_shard_bytes(dst.tensor, dst.fsdp, dst.pipeline, dst.expert)
    groups = chunks([leaf.size * leaf.itemsize for leaf in p.leaves], chunk_bytes)
    if src.devices != dst.devices and src_b == dst_b:  # copies of equal shards: no program
        missing = 0.0
    elif holds_home_shards(src, dst):  # a gather: its result formed in a buffer, then placed
        missing = 1.0
    else:  # an exchange: buffers for what crosses
        missing = float(np.max(missing_share(src, dst)))
    temporaries = int(missing * max(sum(dst_b[i] for i in g) for g in groups))
    return MoveMemory(sum(src_b), sum(dst_b), temporaries,
                      max(sum(src_b[i] for i in g) for g in groups))
