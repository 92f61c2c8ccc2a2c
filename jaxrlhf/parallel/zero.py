"""ZeRO-1: a trained model's optimizer state sharded over its data-parallel ranks.

With `d` > 1 every data-parallel rank holds the same parameters, so a full copy of Adam's
moments (and of a fp32 master) on each would be d-fold redundant. Megatron's distributed
optimizer and ZeRO stage 1 keep 1/d of that state per rank instead: each rank updates its 1/d
slice of the parameters with its slice of the reduced gradients, and the new parameters are
all-gathered. Under GSPMD this is only a choice of shardings: the optimizer state carries the
parameter's sharding with "data" added to one dimension (`shard_over_data`), the train_step's
output keeps the parameter sharding, and XLA slices the update and inserts the all-gather.

The gradients are summed whole (all-reduced, as without ZeRO-1) and then sliced, not
reduce-scattered: a reduce-scatter over 4 or more ranks adds the ranks' partial sums in
another order than the all-reduce, so the step would no longer be bitwise equal to the
replicated one (measured on XLA:CPU, d4). The memory saved is the optimizer state's; the
gradient accumulator stays whole (`plan.memory` counts it so). The update is elementwise, so
each value is computed by the same operations as without the split (the norm too:
`engine.train_step` keeps the gradients whole through it).

Which dimension: the last whose size the mesh axes already on it times "data" divide, so a
shard stays a regular slice (padded shards would break bitwise resharding and the memory
model, as in `parallel.layout`); a leaf no dimension of which divides stays replicated over
"data" (a norm scale of an odd width, a scalar).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax
from jax.sharding import NamedSharding, PartitionSpec

DATA_AXIS = "data"


def _axes(entry) -> tuple[str, ...]:
    """The mesh axes one PartitionSpec entry names, as a tuple."""
    if entry is None:
        return ()
    return (entry,) if isinstance(entry, str) else tuple(entry)


def shard_over_data(sharding: NamedSharding, shape: Sequence[int]) -> NamedSharding:
    """`sharding` with the mesh's "data" axis added to the last dimension it divides evenly.

    Args:
      sharding: a parameter's sharding (data-replicated, as `Layout.param_shardings` gives).
      shape: the parameter's global shape.

    Returns:
      The sharding of that parameter's optimizer state (Adam's moments, a master copy);
      `sharding` itself when the mesh has no data parallelism or no dimension divides.
    """
    mesh = sharding.mesh
    data = mesh.shape.get(DATA_AXIS, 1)
    entries = list(sharding.spec) + [None] * (len(shape) - len(sharding.spec))
    if data == 1 or any(DATA_AXIS in _axes(e) for e in entries):
        return sharding
    for dim, size in reversed(list(enumerate(shape))):
        axes = _axes(entries[dim])
        if size % (math.prod(mesh.shape[a] for a in axes) * data) == 0:
            entries[dim] = axes + (DATA_AXIS,) if axes else DATA_AXIS
            return NamedSharding(mesh, PartitionSpec(*entries), memory_kind=sharding.memory_kind)
    return sharding


def over_data(param_shardings, params_shape):
    """`shard_over_data` leaf by leaf: shardings (tree) and shapes (arrays or
    ShapeDtypeStructs, same tree structure) -> the ZeRO-1 shardings tree."""
    return jax.tree.map(lambda s, x: shard_over_data(s, x.shape), param_shardings, params_shape)
