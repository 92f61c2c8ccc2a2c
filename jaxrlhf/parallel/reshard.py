"""The one door for moving parameters between layouts and memories.

`reshard(tree, dst_shardings)` moves every leaf to its destination sharding, chunk by chunk,
and never through host memory (unless the destination *is* host memory). Why not a bare
`jax.device_put`? On this JAX, `device_put` between shardings only copies device buffers when
every destination shard already exists as a source shard; otherwise it silently falls back to
`x._value`, a full gather into a host numpy array and a re-upload. So each leaf takes one of
these routes (chosen per leaf from its shardings):

  * SAME      the sharding is unchanged (or equivalent): nothing moves.
  * COPY      every destination shard exists among the source shards (e.g. the same mesh
              shape on other devices): each destination shard is a fresh device-to-device
              copy of a matching source shard.
  * COLLECTIVE same device set, new shard boundaries: an identity `jit` with `out_shardings`
              lets XLA reshard with collectives on the devices, as up to three programs
              (slice, exchange, gather: `stages.py`) where one would gather whole arrays.
  * GATHER_THEN_COPY  different devices, |src| a multiple of |dst|: first reshard on the source
              devices into "the destination's shards, repeated |src|/|dst| times" (a mesh of the
              source devices shaped like the destination mesh plus a replica axis), then COPY.
  * COPY_THEN_SCATTER different devices, |dst| a multiple of |src|: COPY the source shards onto a
              replica-extended mesh of the destination devices, then reshard there.
  * CROSS_PROCESS  a COPY would need a shard that only another process holds (multi-controller:
              e.g. generation on host 0, training on host 1). By default shard to shard
              (`shard_transfer.py`): each destination process receives only the boxes it lacks,
              each overlap from a process that holds it, one single-device transfer per
              (source device, destination device) pair; no gather, no replica on the sender.
              `cross_process_path(CrossPath.STAGED)` keeps the older staged hop (benchmarks
              compare the two): |src| >= |dst|: reshard inside the
              source mesh into the destination's layout on its first |dst| devices, which then
              cross. |src| < |dst|: the source's layout crosses onto each consecutive block of
              |src| destination devices, then the destination reshards locally. A crossing is
              cross-host `device_put` between two meshes of the same shape with every shard
              changing process (the only kind JAX supports; a block in the source's own
              processes is a local COPY instead), one call per pair of device lists (`_send`
              says why). See "Multi-process" below.
Legal sub-meshes (submesh.py) are powers of two inside a host or whole hosts, so one of the last
three applies unless two host counts do not divide each other (e.g. 3 hosts vs 2): that raises.

Multi-process: every process runs the same schedule, so every process plans the same hops from
the (global) shardings and takes part in every hop; a COPY only reads this process's shards,
which is why routes are chosen by where shards live per process. A cross-process hop is
synchronous: it waits for the destination shards and then for every process at a coordination
service barrier before anything else is dispatched. Without that, a source process could enter
a later collective that waits for the destination process, which is itself waiting for the
transfer that the busy source no longer serves (observed on the CPU client: a deadlock).
`fetch` brings arrays to the host of every process (metrics, host reward functions).

Host memory: leaves in a host memory kind are first copied to device memory with the same
sharding (a COPY), moved, then copied to the destination memory kind (adjacent COPYs fold into
one, so plain offload/onload is a single copy per shard). On CPU the devices expose
"device", "pinned_host" and "unpinned_host"; offload uses "pinned_host" where present and
"unpinned_host" otherwise (`host_memory_kind`).

Chunking: leaves are grouped into chunks of at most `chunk_bytes` (global bytes; a bigger leaf
travels alone). Each chunk is dispatched, then blocked on, then its sources (when
`free_source`) and intermediates are deleted, so the extra memory at any moment is about one
chunk (times the replica factor of GATHER_THEN_COPY).
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import functools
import math
import time
from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec, Sharding, SingleDeviceSharding

from jaxrlhf.parallel import shard_transfer, stages, watchdog

DEVICE_MEMORY = "device"
_REPLICA_AXIS = "_reshard_replica"


@dataclasses.dataclass(frozen=True)
class ReshardStats:
    """Global bytes of the leaves that moved, and wall-clock seconds including the wait."""

    bytes_moved: int
    seconds: float
    wire_bytes: int = 0  # of them, bytes that crossed processes (the cross-process route)


class Route(enum.Enum):
    SAME = "same"
    COPY = "copy"
    COLLECTIVE = "collective"
    GATHER_THEN_COPY = "gather_then_copy"
    COPY_THEN_SCATTER = "copy_then_scatter"
    CROSS_PROCESS = "cross_process"


class CrossPath(enum.Enum):
    """How the CROSS_PROCESS route moves a leaf (module docstring)."""

    SHARDS = "shards"  # shard to shard: each destination box's overlaps, no staging
    STAGED = "staged"  # the destination's layout built on the sender, then equal meshes cross


_CROSS_PATH = CrossPath.SHARDS


@contextlib.contextmanager
def cross_process_path(path: CrossPath):
    """Inside, cross-process moves take `path` (every process must choose the same)."""
    global _CROSS_PATH
    before, _CROSS_PATH = _CROSS_PATH, path
    try:
        yield
    finally:
        _CROSS_PATH = before


def host_memory_kind(device: jax.Device | None = None) -> str:
    """"pinned_host" when the device exposes it (GPU, TPU, CPU here), else "unpinned_host".

    Another process's device cannot be asked; all devices of one platform expose the same kinds.
    """
    if device is None or device.process_index != jax.process_index():
        device = jax.local_devices()[0]
    kinds = {memory.kind for memory in device.addressable_memories()}
    for kind in ("pinned_host", "unpinned_host"):
        if kind in kinds:
            return kind
    raise ValueError(f"device {device} exposes no host memory kind, only {sorted(kinds)}")


def _as_named(sharding: Sharding) -> NamedSharding:
    match sharding:
        case NamedSharding():
            return sharding
        case SingleDeviceSharding():
            (device,) = sharding.device_set
            mesh = Mesh(np.asarray([device], dtype=object), ("_single",))
            return NamedSharding(mesh, PartitionSpec(), memory_kind=sharding.memory_kind)
    raise TypeError(f"reshard handles NamedSharding and SingleDeviceSharding, got {sharding}")


def _in_device_memory(sharding: NamedSharding) -> NamedSharding:
    return sharding.with_memory_kind(DEVICE_MEMORY)


def _index_key(index: tuple[slice, ...]) -> tuple:
    return tuple((s.start, s.stop, s.step) for s in index)


def _copy_is_local(src: Sharding, dst: Sharding, shape: tuple[int, ...]) -> bool:
    """Whether every destination shard exists on a source device of the same process."""
    held = {(device.process_index, _index_key(index))
            for device, index in src.devices_indices_map(shape).items()}
    return all((device.process_index, _index_key(index)) in held
               for device, index in dst.devices_indices_map(shape).items())


def _within(inner: tuple[slice, ...], outer: tuple[slice, ...], shape) -> bool:
    """Whether the block `inner` of an array of `shape` lies inside the block `outer`."""
    for a, b, n in zip(inner, outer, shape):
        a_start, a_stop, _ = a.indices(n)
        b_start, b_stop, _ = b.indices(n)
        if not b_start <= a_start <= a_stop <= b_stop:
            return False
    return True


def contains_shards(src: Sharding, dst: Sharding, shape: tuple[int, ...]) -> bool:
    """Whether `dst` lives on the devices of `src` and each device's `dst` shard contains its
    `src` shard (e.g. generation on d4t2 from training on f4t2 over the same 8 devices).

    Then moving to `dst` only adds to what each device holds, and `src` can be cut back out
    of `dst` on every device without communication: a copy on `dst` can replace the source
    while it lives (zero-redundancy reallocation, HybridFlow's 3D-HybridEngine;
    `dataflow.runtime.ModelRuntime.params_on`)."""
    src_map, dst_map = src.devices_indices_map(shape), dst.devices_indices_map(shape)
    if set(src_map) != set(dst_map):
        return False
    return all(_within(index, dst_map[device], shape) for device, index in src_map.items())


def choose_route(src: Sharding, dst: Sharding, shape: tuple[int, ...]) -> Route:
    """How one leaf of `shape` gets from `src` to `dst` without touching host memory."""
    src, dst = _as_named(src), _as_named(dst)
    if src.is_equivalent_to(dst, len(shape)):
        return Route.SAME
    if _copy_is_local(src, dst, shape):
        return Route.COPY
    if src.device_set == dst.device_set:
        return Route.COLLECTIVE
    n_src, n_dst = len(src.device_set), len(dst.device_set)
    if n_src % n_dst and n_dst % n_src:
        raise ValueError(
            f"cannot reshard between {n_src} and {n_dst} devices: neither count divides the other"
        )
    if n_src % n_dst == 0 and _copy_is_local(_replica_extended(dst, src), dst, shape):
        return Route.GATHER_THEN_COPY
    if n_dst % n_src == 0 and _copy_is_local(src, _replica_extended(src, dst), shape):
        return Route.COPY_THEN_SCATTER
    return Route.CROSS_PROCESS


def _replica_extended(layout_of: NamedSharding, devices_of: NamedSharding) -> NamedSharding:
    """`layout_of`'s shards, laid out on `devices_of`'s devices and repeated to fill them.

    The result holds exactly the slices `layout_of` holds, so COPY works between the two.
    """
    shape = layout_of.mesh.devices.shape
    devices = np.asarray(devices_of.mesh.devices).reshape(-1)
    repeats = devices.size // layout_of.mesh.devices.size
    mesh = Mesh(devices.reshape(shape + (repeats,)), layout_of.mesh.axis_names + (_REPLICA_AXIS,))
    return NamedSharding(mesh, layout_of.spec, memory_kind=DEVICE_MEMORY)


def _identity(*xs):
    return xs


@functools.lru_cache(maxsize=256)
def _collective(out_shardings: tuple[NamedSharding, ...]):
    return jax.jit(_identity, out_shardings=out_shardings)


def _copy(xs: list[jax.Array], dsts: list[NamedSharding]) -> list[jax.Array]:
    """Assembles each destination from copies of matching source shards (device to device).

    Not `jax.device_put(x, dst)`: its shard-matching path hands over a source buffer that
    already sits on the right device instead of copying it, so deleting the source (or an
    intermediate) would delete part of the result too. Here every shard is a fresh copy.
    """
    shards, targets, layout = [], [], []
    for x, dst in zip(xs, dsts):
        by_index = {_index_key(shard.index): shard.data for shard in x.addressable_shards}
        count = 0
        for device, index in dst.addressable_devices_indices_map(x.shape).items():
            key = _index_key(index)
            if key not in by_index:
                raise ValueError(f"shard {index} of {dst} is not among the local source shards")
            shards.append(by_index[key])
            targets.append(SingleDeviceSharding(device, memory_kind=dst.memory_kind))
            count += 1
        layout.append(count)
    copies = iter(jax.device_put(shards, targets, may_alias=False))
    return [
        jax.make_array_from_single_device_arrays(x.shape, dst, [next(copies) for _ in range(n)],
                                                 dtype=x.dtype)
        for x, dst, n in zip(xs, dsts, layout)
    ]


def _collect(xs: list[jax.Array], dsts: list[NamedSharding]) -> list[jax.Array]:
    """Identity jit per device set (jit needs all its inputs on one device set)."""
    out: list[jax.Array | None] = [None] * len(xs)
    by_devices: dict[frozenset, list[int]] = {}
    for i, dst in enumerate(dsts):
        by_devices.setdefault(frozenset(dst.device_set), []).append(i)
    for indices in by_devices.values():
        results = _collective(tuple(dsts[i] for i in indices))(*[xs[i] for i in indices])
        for i, result in zip(indices, results):
            out[i] = result
    return out


_BLOCK_AXIS = "_reshard_block"


def _blocks(layout_of: NamedSharding, devices_of: NamedSharding) -> NamedSharding:
    """`layout_of`'s mesh shape and spec, repeated over consecutive blocks of `devices_of`'s
    devices (a leading block axis; none when the device counts are equal).

    Devices run host by host, so with legal sub-meshes a block lies in one host or spans whole
    hosts: a block either matches a same-sized mesh elsewhere process for process or in no
    process at all, which is what the cross-host `device_put` needs.
    """
    devices = np.asarray(devices_of.mesh.devices).reshape(-1)
    shape, names = layout_of.mesh.devices.shape, layout_of.mesh.axis_names
    repeats = devices.size // layout_of.mesh.devices.size
    if repeats > 1:
        shape, names = (repeats,) + shape, (_BLOCK_AXIS,) + names
    return NamedSharding(Mesh(devices.reshape(shape), names), layout_of.spec,
                         memory_kind=DEVICE_MEMORY)


def _block(sharding: NamedSharding, k: int) -> NamedSharding:
    """Block `k` of a `_blocks` sharding, as a sharding of its own."""
    if sharding.mesh.axis_names[0] != _BLOCK_AXIS:
        return sharding
    mesh = Mesh(sharding.mesh.devices[k], sharding.mesh.axis_names[1:])
    return NamedSharding(mesh, sharding.spec, memory_kind=sharding.memory_kind)


def _barrier() -> None:
    """Waits for every process at the coordination service (no device collective involved)."""
    # There is no public barrier that avoids device collectives; orbax uses this client too.
    from jax._src import distributed

    _barrier.count = getattr(_barrier, "count", 0) + 1
    # The service's own deadline backs up the watchdog's (which ends the job, named, first).
    timeout_s = 2 * (watchdog.timeout_s() or 300)
    distributed.global_state.client.wait_at_barrier(f"jaxrlhf_reshard_{_barrier.count}",
                                                    timeout_in_ms=int(timeout_s * 1000))


def _processes(items) -> str:
    """"processes 0,1" for arrays or shardings (what a watchdog message names)."""
    shardings = [x.sharding if isinstance(x, jax.Array) else x for x in items]
    ids = sorted({d.process_index for s in shardings for d in s.device_set})
    return "process" + ("es " if len(ids) > 1 else " ") + ",".join(map(str, ids))


def _same_process(x: jax.Array, group: NamedSharding) -> bool:
    pairs = zip(x.sharding.mesh.devices.flat, group.mesh.devices.flat)
    return all(a.process_index == b.process_index for a, b in pairs)


def _device_ids(sharding: Sharding) -> tuple[int, ...]:
    return tuple(d.id for d in np.asarray(_as_named(sharding).mesh.devices).flat)


def _send(xs: list[jax.Array], remote: list[tuple[int, NamedSharding]]) -> list[jax.Array]:
    """The cross-host `device_put`s of `_cross`: one per (source devices, destination devices)
    pair, in the order the pairs first occur in `remote`, which every process computes alike.

    Not one `device_put` of everything: the runtime pairs a sender with its receiver by a
    per-process transfer-key counter, and a batched copy with several device-list pairs takes
    its keys group by group in hash-map order, which differs between processes. With two or
    more destination processes (a checkpoint of a sub-mesh model in a 3-process job: one block
    on each other process) sender and receivers then disagree about the keys and the receivers
    wait forever. One pair per call makes every process count the keys in the same order.
    """
    groups: dict[tuple, list[int]] = {}
    for j, (i, block) in enumerate(remote):
        key = (_device_ids(xs[i].sharding), xs[i].sharding.memory_kind, _device_ids(block),
               block.memory_kind)
        groups.setdefault(key, []).append(j)
    pieces: list = [None] * len(remote)
    for js in groups.values():
        moved = jax.device_put([xs[remote[j][0]] for j in js], [remote[j][1] for j in js],
                               may_alias=False)
        for j, piece in zip(js, moved):
            pieces[j] = piece
    return pieces


def _cross(xs: list[jax.Array], dsts: list[NamedSharding]) -> list[jax.Array]:
    """Cross-process hop: `x` onto every block of its target, then a barrier.

    Each block has `x`'s mesh shape and spec on other devices: a block in `x`'s own processes is
    a local COPY, any other one a cross-host `device_put` (the kind JAX supports: equal shapes,
    every shard crossing). Synchronous on purpose (see the module docstring).
    """
    local, remote = [], []
    for i, (x, dst) in enumerate(zip(xs, dsts)):
        repeats = dst.mesh.shape[_BLOCK_AXIS] if _BLOCK_AXIS in dst.mesh.shape else 1
        for k in range(repeats):
            block = _block(dst, k)
            if block.mesh.devices.shape != x.sharding.mesh.devices.shape:
                raise ValueError(f"cross-process hop needs equal mesh shapes: {x.sharding} -> {dst}")
            (local if _same_process(x, block) else remote).append((i, block))
    pieces = _copy([xs[i] for i, _ in local], [block for _, block in local]) if local else []
    pieces += _send(xs, remote)
    # Every device of a remote block receives a whole shard of the crossing layout.
    wire = sum(math.prod(xs[i].sharding.shard_shape(xs[i].shape)) * xs[i].dtype.itemsize
               * block.mesh.devices.size for i, block in remote)
    with watchdog.guard(lambda: f"cross-process transfer of {len(remote)} array(s) "
                                f"({_processes(xs)} -> {_processes([b for _, b in remote])})"):
        jax.block_until_ready(pieces)
        if jax.process_count() > 1:
            _barrier()
    by_device: list[dict] = [{} for _ in xs]
    for (i, _), piece in zip(local + remote, pieces):
        by_device[i].update({shard.device: shard.data for shard in piece.addressable_shards})
    return [
        jax.make_array_from_single_device_arrays(
            x.shape, dst, [by_device[i][d] for d in dst.addressable_devices_indices_map(x.shape)],
            dtype=x.dtype)
        for i, (x, dst) in enumerate(zip(xs, dsts))
    ], wire


def _shards(xs: list[jax.Array], dsts: list[NamedSharding], names: list[str] | None = None
            ) -> tuple[list[jax.Array], int]:
    """Cross-process hop shard to shard (`shard_transfer.py`); synchronous like `_cross`.
    `names` name the leaves in a `CorruptTransfer`'s message."""

    def wait(received: list[jax.Array]) -> None:
        with watchdog.guard(lambda: f"cross-process transfer of {len(xs)} array(s) "
                                    f"({_processes(xs)} -> {_processes(dsts)})"):
            jax.block_until_ready(received)
            if jax.process_count() > 1:
                _barrier()

    return shard_transfer.move(xs, dsts, wait, names)


class _Step(enum.Enum):
    """One hop of a route."""

    COPY = "copy"  # device_put of matching shards (any devices, any memory kind)
    COLLECTIVE = "collective"  # identity jit on one device set, in device memory
    CROSS = "cross"  # onto equally shaped meshes of other processes (`_cross`)
    SHARDS = "shards"  # shard to shard onto any layout of other processes (`_shards`)


def _order(sharding: NamedSharding) -> tuple[int, ...]:
    """The device ids of a sharding's mesh in mesh order (a program's device assignment)."""
    return tuple(d.id for d in sharding.mesh.devices.flat)


def _staged(src: NamedSharding, dst: NamedSharding, shape) -> list[tuple[_Step, NamedSharding]]:
    """A collective reshard on one device order as slice / exchange / gather programs
    (`stages.collective_stages`: one program for several changes at once can gather the
    whole array on every device)."""
    return [(_Step.COLLECTIVE, stage) for stage in stages.collective_stages(src, dst, shape)]


def _route_hops(src: NamedSharding, dst: NamedSharding, shape) -> list[tuple[_Step, NamedSharding]]:
    """The hops between two device-memory shardings."""
    match choose_route(src, dst, shape):
        case Route.SAME:
            return []
        case Route.COPY:
            return [(_Step.COPY, dst)]
        case Route.COLLECTIVE if _order(src) == _order(dst):
            return _staged(src, dst, shape)
        case Route.COLLECTIVE:
            # The same devices in another mesh order (a TPU slice's meshes follow its torus,
            # shape by shape): one program must keep its devices' order, so it lays dst's
            # shards out on src's order, and a copy then puts each on its device.
            return _staged(src, _replica_extended(dst, src), shape) + [(_Step.COPY, dst)]
        case Route.GATHER_THEN_COPY:
            return _staged(src, _replica_extended(dst, src), shape) + [(_Step.COPY, dst)]
        case Route.COPY_THEN_SCATTER:
            landing = _replica_extended(src, dst)
            return [(_Step.COPY, landing)] + _staged(landing, dst, shape)
        case Route.CROSS_PROCESS if _CROSS_PATH is CrossPath.SHARDS:
            return [(_Step.SHARDS, dst)]
        case Route.CROSS_PROCESS if src.mesh.devices.size >= dst.mesh.devices.size:
            # Reshard inside the source mesh into dst's layout; its first block then crosses.
            staged = _blocks(dst, src)
            # Even when equivalent, the crossing array must carry dst's mesh shape: copy.
            hops = _route_hops(src, staged, shape) or [(_Step.COPY, staged)]
            if staged.mesh.axis_names[0] == _BLOCK_AXIS:
                hops.append((_Step.COPY, _block(staged, 0)))  # same devices: a local copy
            return hops + [(_Step.CROSS, dst)]
        case Route.CROSS_PROCESS:
            # The source's layout lands on every block of dst's devices, then reshards there.
            landing = _blocks(src, dst)
            return [(_Step.CROSS, landing)] + _route_hops(landing, dst, shape)


def collective_hops(src: NamedSharding, dst: NamedSharding, shape: tuple[int, ...]
                    ) -> list[tuple[NamedSharding, NamedSharding]]:
    """(from, to) of each COLLECTIVE hop that moving an array of `shape` from `src` to `dst`
    (device memory) takes: the identity programs `reshard` runs, which can be compiled for
    devices that are only described (`plan --compile`); COPY hops run no program."""
    hops, at = [], src
    for step, target in _route_hops(src, dst, shape):
        if step is _Step.COLLECTIVE:
            hops.append((at, target))
        at = target
    return hops


def _plan(x: jax.Array, dst: NamedSharding) -> list[tuple[_Step, NamedSharding]]:
    """The hops that take `x` to `dst`: stage to device memory, route, then to dst memory."""
    src = _as_named(x.sharding)
    src_dev, dst_dev = _in_device_memory(src), _in_device_memory(dst)
    hops = [] if src.memory_kind == DEVICE_MEMORY else [(_Step.COPY, src_dev)]
    hops += _route_hops(src_dev, dst_dev, x.shape)
    if dst.memory_kind != DEVICE_MEMORY:
        hops.append((_Step.COPY, dst))
    # Each COPY target holds a subset of its input's slices, so two COPYs in a row fold into one.
    merged: list[tuple[_Step, NamedSharding]] = []
    for hop in hops:
        if merged and merged[-1][0] is _Step.COPY and hop[0] is _Step.COPY:
            merged.pop()
        merged.append(hop)
    return merged


def _apply(values: list, indices: list[int], dsts: Sequence, step) -> int:
    """Runs one kind of hop on `indices`; returns the bytes that crossed processes."""
    if not indices:
        return 0
    results = step([values[i] for i in indices], [dsts[i] for i in indices])
    results, wire = results if isinstance(results, tuple) else (results, 0)
    for i, result in zip(indices, results):
        values[i] = result
    return wire


_HOPS = ((_Step.COPY, _copy), (_Step.COLLECTIVE, _collect), (_Step.CROSS, _cross),
         (_Step.SHARDS, _shards))


def _move_chunk(xs: list[jax.Array], dsts: list[NamedSharding], names: list[str] | None = None
                ) -> tuple[list, list, int]:
    """Dispatches every hop of every leaf in a chunk; returns (results, intermediates, bytes
    that crossed processes). `names`: the leaves' names (in a corrupt transfer's message)."""
    plans = [_plan(x, dst) for x, dst in zip(xs, dsts)]
    values = list(xs)
    produced: list[jax.Array] = []
    wire = 0
    for hop in range(max(len(plan) for plan in plans)):
        steps = [plan[hop] if hop < len(plan) else (None, None) for plan in plans]
        targets = [target for _, target in steps]
        for step, run in _HOPS:
            indices = [i for i, (kind, _) in enumerate(steps) if kind is step]
            if step is _Step.SHARDS and names is not None:
                run = functools.partial(_shards, names=[names[i] for i in indices])
            wire += _apply(values, indices, targets, run)
            produced += [values[i] for i in indices]
    # An identity jit may forward its input; never count a source or a result as intermediate.
    keep = {id(x) for x in values} | {id(x) for x in xs}
    return values, [x for x in produced if id(x) not in keep], wire


# What `reshard` moves between waits (global bytes); the planner prices a move's temporaries
# by its largest chunk (`plan.moves.move_memory`).
CHUNK_BYTES = 256 << 20


def chunks(sizes: Sequence[int], chunk_bytes: int) -> list[list[int]]:
    """Indices of `sizes` in consecutive groups of at most `chunk_bytes` (a bigger one alone)."""
    groups: list[list[int]] = [[]]
    total = 0
    for i, size in enumerate(sizes):
        if groups[-1] and total + size > chunk_bytes:
            groups.append([])
            total = 0
        groups[-1].append(i)
        total += size
    return [group for group in groups if group]


def reshard(tree, dst_shardings, *, free_source: bool = False, chunk_bytes: int = CHUNK_BYTES):
    """Moves a pytree of jax.Arrays to `dst_shardings`, chunk by chunk, device to device.

    Args:
      tree: pytree of committed jax.Array (any mesh, any memory kind).
      dst_shardings: matching pytree (prefix) of NamedSharding / SingleDeviceSharding; the
        devices may be the same as, overlap with, or be disjoint from the source devices.
      free_source: delete each moved source leaf once its destination is ready.
      chunk_bytes: at most this many (global) bytes in flight between waits.

    Returns:
      (new_tree, ReshardStats): leaves whose sharding did not change are returned as is and
      not counted in `bytes_moved`.
    """
    start = time.perf_counter()
    paths, treedef = jax.tree_util.tree_flatten_with_path(tree)
    leaves = [x for _, x in paths]
    names = [jax.tree_util.keystr(path) for path, _ in paths]
    dsts = [_as_named(d) for d in treedef.flatten_up_to(dst_shardings)]
    out = list(leaves)
    moving = [
        i for i, (x, d) in enumerate(zip(leaves, dsts))
        if not x.sharding.is_equivalent_to(d, x.ndim)
    ]
    bytes_moved = wire_bytes = 0
    for chunk in chunks([leaves[i].nbytes for i in moving], chunk_bytes):
        indices = [moving[j] for j in chunk]
        moved, intermediates, wire = _move_chunk([leaves[i] for i in indices],
                                                 [dsts[i] for i in indices],
                                                 [names[i] for i in indices])
        with watchdog.guard(lambda: f"reshard of {len(indices)} array(s) onto "
                                    f"{_processes(moved)}"):
            jax.block_until_ready(moved)
        wire_bytes += wire
        for i, result in zip(indices, moved):
            out[i] = result
            bytes_moved += leaves[i].nbytes
        doomed = intermediates + ([leaves[i] for i in indices] if free_source else [])
        for x in doomed:
            if not x.is_deleted():
                x.delete()
    stats = ReshardStats(bytes_moved=bytes_moved, seconds=time.perf_counter() - start,
                         wire_bytes=wire_bytes)
    return jax.tree_util.tree_unflatten(treedef, out), stats


def transfer(tree, dst_shardings):
    """Places a pytree of batch data on `dst_shardings` without waiting (the scheduler's door).

    Host leaves (numpy, Python scalars) are uploaded: every process holds the same global host
    value and places only its own shards. Device leaves take the same device-to-device routes as
    `reshard`. Unlike `reshard` it does not block (except for a cross-process hop, which is
    synchronous), so a consumer's inputs can be moved while their producer is still running, and
    it frees nothing: a source may still be read by other consumers. Meant for activations and
    batches, which are small; parameters go through `reshard`, whose chunking bounds peak memory.

    Returns:
      The placed pytree (leaves already on their destination are returned as they are).
    """
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    dsts = treedef.flatten_up_to(dst_shardings)
    # An uncommitted array (a key, a scalar made on the default device) has no placement to
    # route from; multi-process, it is a value every process holds, like a host value.
    is_host = [not isinstance(x, jax.Array) or not x.committed for x in leaves]
    on_device = [i for i, x in enumerate(leaves) if not is_host[i]
                 and x.sharding != _as_named(dsts[i])]
    if on_device:
        moved, _, _ = _move_chunk([leaves[i] for i in on_device],
                                  [_as_named(dsts[i]) for i in on_device])
        for i, x in zip(on_device, moved):
            leaves[i] = x
    on_host = [i for i, host in enumerate(is_host) if host]
    local = [i for i in on_host if dsts[i].is_fully_addressable]
    for i, x in zip(local, jax.device_put([leaves[i] for i in local], [dsts[i] for i in local])):
        leaves[i] = x
    for i in sorted(set(on_host) - set(local)):
        leaves[i] = _upload_global(leaves[i], dsts[i])
    return jax.tree_util.tree_unflatten(treedef, leaves)


def _upload_global(value, sharding: Sharding) -> jax.Array:
    """A value every process holds, placed on a sharding that spans other processes.

    Each process uploads only its own shards; `device_put` would first compare the value across
    processes with a device collective (and refuses PRNG keys).
    """
    if isinstance(value, jax.Array) and jax.dtypes.issubdtype(value.dtype, jax.dtypes.prng_key):
        data = _upload_global(jax.random.key_data(value), sharding)
        return jax.random.wrap_key_data(data, impl=jax.random.key_impl(value))
    host = np.asarray(jax.device_get(value))
    host = host.astype(jax.dtypes.canonicalize_dtype(host.dtype), copy=False)
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index],
                                        dtype=host.dtype)


def spanning(sharding: Sharding) -> NamedSharding:
    """`sharding`'s layout repeated over consecutive blocks of all the job's devices.

    Orbax (multi-process) only writes and reads arrays that span every process; a model on a
    sub-mesh is moved to this for a checkpoint and back after a restore. Each device then holds
    what the sub-mesh's devices hold, so no device needs more memory than the sub-mesh's.
    Single process, or a sharding that already spans every process: unchanged.
    """
    sharding = _as_named(sharding)
    if len({d.process_index for d in sharding.device_set}) == jax.process_count():
        return sharding
    if jax.device_count() % sharding.num_devices:
        raise ValueError(f"{sharding.num_devices} devices do not tile the job's "
                         f"{jax.device_count()}; cannot span every process")
    return _blocks(sharding, NamedSharding(Mesh(np.asarray(jax.devices()), ("_all",)),
                                           PartitionSpec()))


_PROCESS_LOCAL_ON = False  # process-wide: the host reward pool's threads fetch too


@contextlib.contextmanager
def process_local(enabled: bool = True):
    """Inside, `fetch` (in every thread of this process) is its own device-to-host copy.

    For multi-process jobs whose processes run different programs on their own devices (the
    asynchronous loop's trainer and generation processes, jaxrlhf/run/async_procs.py): their
    values never span processes, and a job-wide `fetch` would wait for processes that are
    busy elsewhere. `process_local(False)` inside: job-wide again (a section every process
    runs, such as a checkpoint save).
    """
    global _PROCESS_LOCAL_ON
    before, _PROCESS_LOCAL_ON = _PROCESS_LOCAL_ON, enabled
    try:
        yield
    finally:
        _PROCESS_LOCAL_ON = before


def fetch(tree):
    """The whole value of every leaf as numpy, on every process (a sync point).

    Single process: a plain device-to-host copy. Multi-process: each leaf is first made fully
    replicated over all devices of the job (through the same routes as `reshard`, including the
    cross-process one), then each process copies its local replica, so metrics and host reward
    functions see the same full arrays everywhere. Under `process_local()`: a plain copy of
    this process's arrays.
    """
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    on_device = [i for i, x in enumerate(leaves) if isinstance(x, jax.Array)]
    if _PROCESS_LOCAL_ON:
        leaves_away = [i for i in on_device if not leaves[i].is_fully_addressable]
        if leaves_away:
            raise ValueError(f"process_local fetch of {len(leaves_away)} array(s) held partly "
                             "by other processes")
    elif on_device and jax.process_count() > 1:
        everywhere = NamedSharding(Mesh(np.asarray(jax.devices()), ("_all",)), PartitionSpec())
        moved, _, _ = _move_chunk([leaves[i] for i in on_device],
                                  [everywhere] * len(on_device))
        for i, x in zip(on_device, moved):
            leaves[i] = x.addressable_data(0)
    with watchdog.guard(f"fetch of {len(on_device)} array(s) to the host"):
        host = jax.device_get([leaves[i] for i in on_device])
    for i, x in zip(on_device, host):
        leaves[i] = np.asarray(x)
    return jax.tree_util.tree_unflatten(treedef, leaves)


def offload_to_host(tree, *, free_source: bool = True, chunk_bytes: int = CHUNK_BYTES):
    """Moves every leaf to host memory on the same devices and sharding (idle models).

    Returns:
      (host_tree, ReshardStats).
    """
    dsts = jax.tree_util.tree_map(
        lambda x: _as_named(x.sharding).with_memory_kind(
            host_memory_kind(next(iter(x.sharding.device_set)))
        ),
        tree,
    )
    return reshard(tree, dsts, free_source=free_source, chunk_bytes=chunk_bytes)


def onload(tree, shardings=None, *, free_source: bool = True, chunk_bytes: int = CHUNK_BYTES):
    """Moves host-memory leaves back to device memory: to `shardings` (any layout), or to
    the same sharding in device memory when None.

    Returns:
      (device_tree, ReshardStats).
    """
    if shardings is None:
        shardings = jax.tree_util.tree_map(lambda x: _in_device_memory(_as_named(x.sharding)), tree)
    return reshard(tree, shardings, free_source=free_source, chunk_bytes=chunk_bytes)
