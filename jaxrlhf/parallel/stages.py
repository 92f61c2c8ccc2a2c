"""A collective reshard split into steps XLA's partitioner moves efficiently.

An identity program from one sharding to another on the same devices lets XLA pick the
collectives. For one kind of change at a time it picks well: a mesh axis a dimension starts to
be split over (a local slice), one moved between dimensions (an all-to-all), one dropped (an
all-gather). For several at once it often gives up ("involuntary full rematerialization"):
every device gathers the whole array and slices its shard out. A mixture's expert stacks hit
this moving from training to generation: on a v5p-64, Qwen3-30B-A3B's d8f2t2 -> d4e2t4 (the
experts split over a former data axis while the tensor axis grows over the former fsdp one)
gathered each 18 GiB stack on all 32 chips, 1729 GiB where 180 GiB must cross.

So the move goes in up to three programs (`collective_stages`):
  1. slice: every dimension also takes the destination's splits over mesh axes the source
     leaves replicated (each device keeps part of what it holds; nothing crosses);
  2. exchange: the destination's splits, keeping those over mesh axes only the source uses
     (between the same mesh axes): one all-to-all per run of mesh axes that moves from the
     minor end of one dimension to its place in another (`_exchanges`; XLA gathers whole
     arrays for two at once, d2f2t2 -> d2e4), then one program for what is left (a permute);
  3. gather: drop those (an all-gather).
Both shardings are written on one mesh of the common refinement of their mesh axes (the same
devices in the same order, each mesh axis a run of its factors, major first), so "the same mesh
axis" is well defined across the two meshes. Where no such refinement exists (mesh sizes that
do not nest) or a stage's split would not divide a dimension, the move stays one program.
"""

from __future__ import annotations

import math

import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

_FINE = "_stage"  # fine mesh axes are named _stage0, _stage1, ... (outermost first)


def _spans(mesh: Mesh) -> dict[str, tuple[int, int]]:
    """Each mesh axis's [stride, stride × size) in the flat device order (row-major)."""
    spans, stride = {}, 1
    for name in reversed(mesh.axis_names):
        size = mesh.shape[name]
        spans[name] = (stride, stride * size)
        stride *= size
    return spans


def _refinement(a: Mesh, b: Mesh) -> list[int] | None:
    """The strides bounding the common refinement's axes, innermost first (1 ... devices), or
    None where the two meshes' axis boundaries do not nest."""
    bounds = sorted({s for m in (a, b) for span in _spans(m).values() for s in span} | {1})
    if any(hi % lo for lo, hi in zip(bounds, bounds[1:])):
        return None
    return bounds


def _fine_axes(mesh: Mesh, bounds: list[int]) -> dict[str, list[str]]:
    """Each axis of `mesh` as the fine axes it spans, major first (fine axis k spans
    [bounds[k], bounds[k+1]))."""
    fine = {}
    for name, (lo, hi) in _spans(mesh).items():
        fine[name] = [f"{_FINE}{k}" for k in reversed(range(len(bounds) - 1))
                      if lo <= bounds[k] and bounds[k + 1] <= hi]
    return fine


def _dims(sharding: NamedSharding, ndim: int, fine: dict[str, list[str]]) -> list[list[str]]:
    """Per array dimension, the fine axes splitting it, major first."""
    spec = tuple(sharding.spec) + (None,) * (ndim - len(sharding.spec))
    out = []
    for entry in spec:
        names = () if entry is None else (entry,) if isinstance(entry, str) else entry
        out.append([axis for name in names for axis in fine[name]])
    return out


def _extended(base: list[list[str]], extra: list[list[str]], unused: set[str],
              shape: tuple[int, ...], size: dict[str, int]) -> list[list[str]] | None:
    """`base`, each dimension also split (minor) over its `extra` axes found in `unused`; None
    where a dimension would not divide."""
    out = []
    for axes, more, n in zip(base, extra, shape):
        axes = axes + [a for a in more if a in unused]
        if n % math.prod(size[a] for a in axes):
            return None
        out.append(axes)
    return out


def _move(cur: list[list[str]], want: list[list[str]]) -> list[list[str]] | None:
    """`cur` after one all-to-all that moves a run of mesh axes from the minor end of one
    dimension to the minor end of the dimension `want` puts them on, which then is a prefix of
    what `want` has there (the longest such run of the first dimension that has one), or None."""
    for s, axes in enumerate(cur):
        for n in range(len(axes), 0, -1):
            run = axes[-n:]
            t = next(i for i, w in enumerate(want) if run[0] in w)
            grown = cur[t] + run
            if t != s and grown == want[t][:len(grown)]:
                out = [list(x) for x in cur]
                out[s], out[t] = axes[:-n], grown
                return out
    return None


def _exchanges(start: list[list[str]], want: list[list[str]]) -> list[list[list[str]]]:
    """The states between `start` and `want` (the same mesh axes, other dimensions), one
    all-to-all each (`_move`) while one applies; XLA moves the rest in one program."""
    states, cur = [], start
    while cur != want and (cur := _move(cur, want)) is not None:
        states.append(cur)
    return states if states and states[-1] == want else states + [want]


def collective_stages(src: NamedSharding, dst: NamedSharding, shape: tuple[int, ...]
                      ) -> list[NamedSharding]:
    """The shardings an array of `shape` passes through from `src` to `dst` (same devices in
    the same order), one identity program each, ending with `dst` (module docstring)."""
    bounds = _refinement(src.mesh, dst.mesh)
    same_order = [d.id for d in src.mesh.devices.flat] == [d.id for d in dst.mesh.devices.flat]
    if bounds is None or not same_order:
        return [dst]
    size = {f"{_FINE}{k}": hi // lo for k, (lo, hi) in enumerate(zip(bounds, bounds[1:]))}
    names = [f"{_FINE}{k}" for k in reversed(range(len(bounds) - 1))]
    mesh = Mesh(np.asarray(src.mesh.devices).reshape([size[n] for n in names]), tuple(names))
    s = _dims(src, len(shape), _fine_axes(src.mesh, bounds))
    d = _dims(dst, len(shape), _fine_axes(dst.mesh, bounds))
    used_s, used_d = {a for x in s for a in x}, {a for x in d for a in x}
    sliced = _extended(s, d, used_d - used_s, shape, size)
    exchanged = _extended(d, s, used_s - used_d, shape, size)
    if sliced is None or exchanged is None:
        return [dst]
    steps = [sliced, *_exchanges(sliced, exchanged)]
    if any(n % math.prod(size[a] for a in axes) for dims in steps
           for axes, n in zip(dims, shape)):
        steps = [sliced, exchanged]
    stages, at = [], src
    for dims in steps:
        stage = NamedSharding(mesh, PartitionSpec(*(tuple(x) if x else None for x in dims)),
                              memory_kind=dst.memory_kind)
        if not stage.is_equivalent_to(at, len(shape)) and not stage.is_equivalent_to(
                dst, len(shape)):
            stages.append(stage)
            at = stage
    return stages + [dst]
