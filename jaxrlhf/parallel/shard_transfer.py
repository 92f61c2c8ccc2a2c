"""Cross-process moves shard to shard: each destination shard gets only the bytes it lacks.

`reshard`'s cross-process route (a COPY would need a shard that only another process holds:
trainer on one host, generator on another) used to stage: reshard inside the source mesh into
the destination's layout, then cross as whole meshes of equal shape. That sends a replicated
destination's full copy from a full replica built on the sender first, and a source smaller
than its destination crosses once per block of destination devices.

Here the move is planned box by box from the two shardings alone (every process plans the same
pieces from the global shardings, so every process takes part in the same transfers in the same
order):

  * a destination *box* (the slice of the array one destination device holds) is received once
    per destination process, by the first of that process's devices that holds it (its
    *primary*); the process's other devices holding the same box get a local copy of it;
  * every source box that overlaps it sends exactly the overlap, as one single-device array
    (JAX's cross-process `device_put` needs equal shapes on both sides: a single device on each
    side with the piece's shape fits it). A source box held by several devices (a replicated
    or fsdp-replicated source) is sent by a holder in the destination's own process when there
    is one (no wire), else by the holder with the fewest bytes to send so far (spreading the
    senders);
  * the pieces of one box are pasted into it on the destination device by one small program.

So the bytes that cross processes are exactly what each destination process lacks (each
distinct box once per process, less what the process already holds), and the sender holds
nothing but its own shards and the overlaps it slices out of them (no gather, no replica).
Transfers go one `device_put` per (source device, destination device) pair, in the order the
pairs first occur: JAX pairs a sender with its receiver by a per-process transfer-key counter,
and a batched `device_put` of several pairs takes its keys in an order that differs between
processes (`reshard._send`). The hop is synchronous, as the staged one was: the receivers wait
for their pieces, then every process meets at a barrier before the sender drops its slices.

Checksums: every piece travels with a checksum the sender computes on its device (a position-
weighted sum of its words, `checksum`: any one changed word changes it), and the receiver
checks it against the piece it got. A mismatch raises `CorruptTransfer`, one line naming the
parameter, before the arrays are assembled: a generator never decodes with weights that
arrived wrong.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable

import jax
import numpy as np
from jax.sharding import NamedSharding, SingleDeviceSharding

Box = tuple[tuple[int, int], ...]  # (start, stop) per dimension, global coordinates
# A fault on the wire, for tests: (array index, piece index, received piece) -> the piece kept.
InTransit = Callable[[int, int, jax.Array], jax.Array]
_WORD = {1: "uint8", 2: "uint16", 4: "uint32", 8: "uint32"}  # unsigned words of an element


class CorruptTransfer(RuntimeError):
    """A piece whose checksum on arrival differs from the sender's."""


@jax.jit
def checksum(x: jax.Array) -> jax.Array:
    """uint32 [1]: the sum of every word of `x` (its elements' bits as unsigned integers of
    their width, 32-bit halves of 64-bit ones) times an odd weight 2i + 1, mod 2**32.

    Any change to one word changes it: an odd weight is invertible mod 2**32, so a nonzero
    change times it is nonzero. One pass over the words in their own width (a byte-wise sum
    cost four times the conversions and, on XLA:CPU, more than the transfer itself)."""
    jnp = jax.numpy
    if x.dtype == jnp.bool_:  # a mask (bitcast refuses bools): its values are its bits
        words = x.reshape(-1).astype(jnp.uint32)
    else:
        words = jax.lax.bitcast_convert_type(x, jnp.dtype(_WORD[x.dtype.itemsize]))
        words = words.reshape(-1).astype(jnp.uint32)
    weights = jax.lax.iota(jnp.uint32, words.size) * jnp.uint32(2) + jnp.uint32(1)
    return jnp.sum(words * weights, dtype=jnp.uint32).reshape(1)


def box_of(index: tuple[slice, ...], shape: tuple[int, ...]) -> Box:
    """A device's slice of an array of `shape` as (start, stop) per dimension."""
    return tuple(s.indices(n)[:2] for s, n in zip(index, shape))


def _overlap(a: Box, b: Box) -> Box | None:
    box = tuple((max(a0, b0), min(a1, b1)) for (a0, a1), (b0, b1) in zip(a, b))
    return box if all(lo < hi for lo, hi in box) else None


def _size(box: Box) -> int:
    return math.prod(hi - lo for lo, hi in box)


def _within(box: Box, outer: Box) -> tuple[slice, ...]:
    """`box` (global) as slices of the block `outer` (global)."""
    return tuple(slice(lo - o, hi - o) for (lo, hi), (o, _) in zip(box, outer))


@dataclasses.dataclass(frozen=True)
class Piece:
    """One overlap of a source box and a destination box, sent from one device to another.

    Attributes:
      src: the source device that sends it (holds `src_box`).
      dst: the destination box's primary device (receives it).
      src_box: the sending device's box of the array.
      dst_box: the receiving device's box.
      box: the overlap (global coordinates), the piece's extent.
    """

    src: jax.Device
    dst: jax.Device
    src_box: Box
    dst_box: Box
    box: Box

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(hi - lo for lo, hi in self.box)

    @property
    def crosses(self) -> bool:
        return self.src.process_index != self.dst.process_index


@dataclasses.dataclass(frozen=True)
class Plan:
    """How one array moves between two shardings across processes.

    Attributes:
      pieces: every transfer, in the order the processes issue them.
      replicas: (primary, other device) of the same process holding the same destination box:
        the other device gets a local copy of the primary's assembled box.
      itemsize: bytes per element.
    """

    pieces: tuple[Piece, ...]
    replicas: tuple[tuple[jax.Device, jax.Device], ...]
    itemsize: int

    @property
    def wire_bytes(self) -> int:
        """Bytes that cross processes."""
        return sum(_size(p.box) for p in self.pieces if p.crosses) * self.itemsize


def need_bytes(src: NamedSharding, dst: NamedSharding, shape: tuple[int, ...],
               itemsize: int) -> int:
    """The least any cross-process move can send: for every destination process, each distinct
    box its devices hold, less the parts of it that process already holds in the source.

    Computed from elements held, independently of `plan`: a destination element lacking in its
    process must cross once per process, and nothing else needs to.
    """
    total = 0
    processes = {d.process_index for d in dst.device_set}
    for p in processes:
        wanted = np.zeros(shape, bool)
        for device, index in dst.devices_indices_map(shape).items():
            if device.process_index == p:
                wanted[index] = True
        for device, index in src.devices_indices_map(shape).items():
            if device.process_index == p:
                wanted[index] = False
        total += int(wanted.sum())
    return total * itemsize


def plan(src: NamedSharding, dst: NamedSharding, shape: tuple[int, ...], itemsize: int) -> Plan:
    """The pieces that move an array of `shape` from `src` to `dst` (module docstring)."""
    sources: dict[Box, list[jax.Device]] = {}
    for device in src.mesh.devices.flat:
        sources.setdefault(box_of(src.devices_indices_map(shape)[device], shape), []).append(
            device)
    load = {device: 0 for device in src.mesh.devices.flat}
    primaries: dict[tuple[int, Box], jax.Device] = {}
    pieces, replicas = [], []
    dst_map = dst.devices_indices_map(shape)
    for device in dst.mesh.devices.flat:
        dst_box = box_of(dst_map[device], shape)
        key = (device.process_index, dst_box)
        if key in primaries:
            replicas.append((primaries[key], device))
            continue
        primaries[key] = device
        for src_box, holders in sources.items():
            box = _overlap(src_box, dst_box)
            if box is None:
                continue
            local = [d for d in holders if d.process_index == device.process_index]
            sender = local[0] if local else min(holders, key=lambda d: load[d])
            load[sender] += _size(box)
            pieces.append(Piece(sender, device, src_box, dst_box, box))
    return Plan(tuple(pieces), tuple(replicas), itemsize)


@functools.lru_cache(maxsize=512)
def _paster(shape: tuple[int, ...], starts: tuple[tuple[int, ...], ...]):
    """A program that pastes pieces at `starts` into a block of `shape` (the pieces tile it)."""

    def paste(*pieces):
        out = jax.numpy.empty(shape, pieces[0].dtype)
        for piece, start in zip(pieces, starts):
            out = jax.lax.dynamic_update_slice(out, piece, start)
        return out

    return jax.jit(paste)


def _slice(data: jax.Array, piece: Piece) -> jax.Array:
    """The piece cut out of the sender's shard (the shard itself when it is all of it)."""
    if piece.box == piece.src_box:
        return data
    return data[_within(piece.box, piece.src_box)]


def _placeholder_sum(piece: Piece) -> jax.Array:
    return jax.make_array_from_single_device_arrays(
        (1,), SingleDeviceSharding(piece.src), [], dtype=jax.numpy.uint32)


def _placeholder(piece: Piece, dtype) -> jax.Array:
    """The piece as another process's array: what this process passes to the same transfer."""
    return jax.make_array_from_single_device_arrays(
        piece.shape, SingleDeviceSharding(piece.src), [], dtype=dtype)


def send(xs: list[jax.Array], plans: list[Plan], in_transit: InTransit | None = None
         ) -> tuple[list[dict], list[jax.Array]]:
    """Issues every piece of every array, then their checksums; returns, per array, this
    process's received (piece, sender's checksum, receiver's checksum) by piece index, and
    the arrays made on this side (to drop after the barrier).

    The pieces go first, so none waits for a checksum; each piece's checksum on either side
    is dispatched as soon as the piece exists there, to run while others are in flight.
    """
    me = jax.process_index()
    pairs: dict[tuple[int, int], list[tuple[int, int]]] = {}
    for i, p in enumerate(plans):
        for j, piece in enumerate(p.pieces):
            if piece.crosses or piece.src.process_index == me:
                pairs.setdefault((piece.src.id, piece.dst.id), []).append((i, j))
    received: list[dict] = [{} for _ in xs]
    cut: list[jax.Array] = []
    sums: dict[tuple[int, int], jax.Array] = {}  # the sender's checksums, by (array, piece)
    for items in pairs.values():
        outgoing = []
        for i, j in items:
            piece = plans[i].pieces[j]
            if piece.src.process_index == me:
                shard = next(s.data for s in xs[i].addressable_shards if s.device == piece.src)
                outgoing.append(_slice(shard, piece))
                sums[i, j] = checksum(outgoing[-1])
                cut += [outgoing[-1], sums[i, j]] if outgoing[-1] is not shard else [sums[i, j]]
            else:
                outgoing.append(_placeholder(piece, xs[i].dtype))
                sums[i, j] = _placeholder_sum(piece)
        target = SingleDeviceSharding(plans[items[0][0]].pieces[items[0][1]].dst)
        moved = jax.device_put(outgoing, [target] * len(outgoing), may_alias=False)
        for (i, j), data in zip(items, moved):
            if plans[i].pieces[j].dst.process_index == me:
                data = data if in_transit is None else in_transit(i, j, data)
                received[i][j] = (data, None, checksum(data))
    for items in pairs.values():  # the checksums, pair by pair in the same order
        target = SingleDeviceSharding(plans[items[0][0]].pieces[items[0][1]].dst)
        moved = jax.device_put([sums[key] for key in items], [target] * len(items),
                               may_alias=False)
        for (i, j), sent in zip(items, moved):
            if plans[i].pieces[j].dst.process_index == me:
                data, _, got = received[i][j]
                received[i][j] = (data, sent, got)
    return received, cut


def verify(received: list[dict], plans: list[Plan], names: list[str]) -> None:
    """Raises `CorruptTransfer` naming the first parameter a received piece of which does not
    match its sender's checksum (one small device-to-host read for all of them)."""
    keys = [(i, j) for i, got in enumerate(received) for j in got]
    if not keys:
        return
    same = jax.device_get([received[i][j][2] == received[i][j][1] for i, j in keys])
    for (i, j), ok in zip(keys, same):
        if not bool(ok[0]):
            piece = plans[i].pieces[j]
            raise CorruptTransfer(
                f"weights corrupted in transit: {names[i]}, elements {list(piece.box)} from "
                f"process {piece.src.process_index} (device {piece.src.id}) to device "
                f"{piece.dst.id}: checksum mismatch; not using them")


def assemble(x: jax.Array, dst: NamedSharding, p: Plan, received: dict) -> jax.Array:
    """The destination array from this process's received pieces (and local replica copies)."""
    me = jax.process_index()
    by_device: dict[jax.Device, jax.Array] = {}
    boxes: dict[jax.Device, list[int]] = {}
    for j, piece in enumerate(p.pieces):
        if piece.dst.process_index == me:
            boxes.setdefault(piece.dst, []).append(j)
    for device, js in boxes.items():
        dst_box = p.pieces[js[0]].dst_box
        pieces = [received[j][0] for j in js]
        if len(js) == 1 and p.pieces[js[0]].box == dst_box:
            by_device[device] = pieces[0]
        else:
            starts = tuple(tuple(lo - o for (lo, _), (o, _) in zip(p.pieces[j].box, dst_box))
                           for j in js)
            shape = tuple(hi - lo for lo, hi in dst_box)
            by_device[device] = _paster(shape, starts)(*pieces)
    copies = [(primary, device) for primary, device in p.replicas if device.process_index == me]
    if copies:
        moved = jax.device_put([by_device[a] for a, _ in copies],
                               [SingleDeviceSharding(b) for _, b in copies], may_alias=False)
        by_device.update({b: y for (_, b), y in zip(copies, moved)})
    shards = [by_device[d] for d in dst.addressable_devices_indices_map(x.shape)]
    return jax.make_array_from_single_device_arrays(x.shape, dst, shards, dtype=x.dtype)


def move(xs: list[jax.Array], dsts: list[NamedSharding], wait: Callable[[list], None],
         names: list[str] | None = None, in_transit: InTransit | None = None
         ) -> tuple[list[jax.Array], int]:
    """Moves each array to its destination sharding (device memory, any processes) piece by
    piece; `wait(arrays)` blocks until this process's pieces are in and every process has
    reached the same point (the caller's barrier), then every piece's checksum is checked.

    Args:
      names: each array's name in a `CorruptTransfer` message (default: its position).
      in_transit: called with every piece this process receives, as it arrives; what it
        returns is kept (tests flip a bit there to stand for a fault on the wire).

    Returns:
      (arrays, bytes that crossed processes).
    """
    plans = [plan(x.sharding, dst, x.shape, x.dtype.itemsize) for x, dst in zip(xs, dsts)]
    received, cut = send(xs, plans, in_transit)
    wait([piece for pieces in received for got in pieces.values() for piece in got])
    for piece in cut:
        piece.delete()
    verify(received, plans, names or [f"array {i}" for i in range(len(xs))])
    out = [assemble(x, dst, p, got) for x, dst, p, got in zip(xs, dsts, plans, received)]
    return out, sum(p.wire_bytes for p in plans)
