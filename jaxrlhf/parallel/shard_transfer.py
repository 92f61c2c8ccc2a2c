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
nothing but its own shards and the buckets it packs out of them (no gather, no replica).

Buckets (`buckets`): the crossing pieces of one (source device, destination device) pair
travel in buckets, all of a pair's in one `device_put` with the pair's checksums last, pairs
in the order they first occur: JAX pairs a sender with its receiver by a per-process
transfer-key counter, and a batched `device_put` of several pairs takes its keys in an order
that differs between processes (`reshard._send`), and every process issues every transfer,
its own or not (JAX counts them on each: skipping another pair's hung 3 processes). A bucket
is either consecutive pieces of the pair smaller than `_ALONE`, packed back to back into one
flat uint8 array of at most `BUCKET_BYTES` by one program on the sender (which also cuts them
out of its shards and sums them), or one piece of at least `_ALONE` bytes, sent as it is
(packed, it would cost a copy on each side). Every bucket is in flight at once; the receiver
pastes each destination box from its buckets (one program per box) while the rest arrive.
The hop is synchronous, as the staged one was: the receivers wait for their buckets, then
every process meets at a barrier.

Where the time goes (qwen3-0.6b f4 -> d2 across 2 processes on this machine's 2 loaded
cores, the run stack's malloc: `benchmarks/weight_sync.py --keep_freed`): JAX's own
cross-process `device_put` of the same bytes as one flat array reaches only 0.30-0.55 of a
raw loopback socket's GB/s, so its transport, not the pieces, is the ceiling here. The sync
adds on the receiver a paste of every byte into its box and, for a replicated box, a copy to
each other device; on the sender the checksums; it runs at 0.75 of that transport (f4 -> d2;
d2t2 -> t4, four device pairs in flight, beats the one array's 1.1 times), with or without
buckets: the pieces of a model's tensors are megabytes and travel as they are (packing
them into 64 MiB buckets cost d2t2 -> t4 a fifth more: a copy on each side). The buckets pay
off for the many small pieces of norms, biases and small models: one transfer, one program
and one checksum per bucket instead of per piece. Under glibc's default malloc every fresh
buffer is paged in anew on each sync, and that, not the transport, dominates (7-11 s for the
same move).

Checksums: every bucket travels with a checksum its sender computes on its device (a position-
weighted sum of its words, `checksum`, `flat_checksum`: any one changed word changes it), and
the receiver checks it against the bucket it got. A mismatch is resent: every process learns
which buckets failed (`_exchange`, through the coordination service) and the senders, which
keep their buckets until then, send those again, up to `RESENDS` times. One that still differs
raises `CorruptTransfer` on its receiver, one line naming the parameters in the bucket, before
any array is returned: a generator never decodes with weights that arrived wrong.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable

import jax
import numpy as np
from jax.sharding import NamedSharding, SingleDeviceSharding

from jaxrlhf.parallel import watchdog

Box = tuple[tuple[int, int], ...]  # (start, stop) per dimension, global coordinates
# A fault on the wire, for tests: (the bucket's parameter names, attempt, received bucket) -> the
# bucket kept.
InTransit = Callable[[tuple[str, ...], int, jax.Array], jax.Array]
BUCKET_BYTES = 64 << 20  # the most one packed bucket carries (`buckets`)
_ALONE = 1 << 20  # a piece this big travels as it is (`buckets`)
RESENDS = 2  # times a corrupt bucket is sent again before the move gives up
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


@dataclasses.dataclass(frozen=True)
class Bucket:
    """Crossing pieces of one (source device, destination device) pair that travel as one
    transfer, with one checksum.

    Attributes:
      src, dst: the pair.
      items: (array index, piece index) of each piece, in order.
      packed: True: the pieces' bytes back to back in one flat uint8 array (`_packer`);
        False: one piece, sent as it is (its sender's shard or a slice of it).
      nbytes: the bytes it carries.
    """

    src: jax.Device
    dst: jax.Device
    items: tuple[tuple[int, int], ...]
    packed: bool
    nbytes: int


def buckets(plans: list[Plan], bucket_bytes: int) -> list[Bucket]:
    """Every crossing piece in a bucket, pair by pair in the order the pairs first occur (every
    process computes the same list). Within a pair, consecutive pieces smaller than `_ALONE`
    fill a bucket up to `bucket_bytes`; a piece of at least `_ALONE` bytes travels as it is,
    in its own shape: packed, it would cost a copy on the sender where it is a whole shard and
    one on the receiver where it is a whole destination box, for a transfer overhead that is
    small beside its bytes."""
    pairs: dict[tuple[int, int], list[tuple[int, int]]] = {}
    for i, p in enumerate(plans):
        for j, piece in enumerate(p.pieces):
            if piece.crosses:
                pairs.setdefault((piece.src.id, piece.dst.id), []).append((i, j))
    out = []
    for items in pairs.values():
        first = plans[items[0][0]].pieces[items[0][1]]
        run: list[tuple[int, int]] = []
        size = 0
        for i, j in items:
            piece = plans[i].pieces[j]
            nbytes = _size(piece.box) * plans[i].itemsize
            if nbytes >= _ALONE:
                out.append(Bucket(first.src, first.dst, ((i, j),), False, nbytes))
                continue
            if run and size + nbytes > bucket_bytes:
                out.append(Bucket(first.src, first.dst, tuple(run), True, size))
                run, size = [], 0
            run.append((i, j))
            size += nbytes
        if run:
            out.append(Bucket(first.src, first.dst, tuple(run), True, size))
    return out


def _to_bytes(x: jax.Array) -> jax.Array:
    """uint8 [x.nbytes]: `x`'s bytes (a bool mask's values as bytes)."""
    jnp = jax.numpy
    if x.dtype == jnp.bool_:
        return x.reshape(-1).astype(jnp.uint8)
    return jax.lax.bitcast_convert_type(x, jnp.uint8).reshape(-1)


def _from_bytes(b: jax.Array, shape: tuple[int, ...], dtype) -> jax.Array:
    """The array of `shape` and `dtype` whose bytes are uint8 `b` (inverse of `_to_bytes`)."""
    jnp = jax.numpy
    dtype = jnp.dtype(dtype)
    if dtype == jnp.bool_:
        return b.reshape(shape) != 0
    if dtype.itemsize == 1:
        return jax.lax.bitcast_convert_type(b.reshape(shape), dtype)
    return jax.lax.bitcast_convert_type(b.reshape(shape + (dtype.itemsize,)), dtype)


def _flat_checksum(b: jax.Array) -> jax.Array:
    """uint32 [1]: `checksum` of flat uint8 `b` read as 32-bit words (a trailing 1-3 bytes as
    words of their own, weighted on): one changed byte changes one word by a nonzero multiple
    of 2**(8k) < 2**32, times an odd weight."""
    jnp = jax.numpy
    n4 = b.size // 4 * 4
    words = jax.lax.bitcast_convert_type(b[:n4].reshape(-1, 4), jnp.uint32)
    tail = b[n4:].astype(jnp.uint32)
    weights = jax.lax.iota(jnp.uint32, n4 // 4 + tail.size) * jnp.uint32(2) + jnp.uint32(1)
    return (jnp.sum(words * weights[:n4 // 4], dtype=jnp.uint32)
            + jnp.sum(tail * weights[n4 // 4:], dtype=jnp.uint32)).reshape(1)


flat_checksum = jax.jit(_flat_checksum)


@functools.lru_cache(maxsize=512)
def _packer(cuts: tuple[tuple[int, tuple[tuple[int, int], ...]], ...]):
    """A program that cuts each (input, slice) out of the sender's shards and lays the bytes
    back to back: (uint8 [bytes], its `_flat_checksum`), one pass over the pieces."""

    def pack(*shards):
        flat = jax.numpy.concatenate(
            [_to_bytes(shards[k][tuple(slice(lo, hi) for lo, hi in box)]) for k, box in cuts])
        return flat, _flat_checksum(flat)

    return jax.jit(pack)


# One piece of a destination box in `_paster`'s inputs: (input, byte offset in it or -1 when
# the input is the piece itself, the piece's shape, its start in the box).
_Part = tuple[int, int, tuple[int, ...], tuple[int, ...]]


@functools.lru_cache(maxsize=512)
def _paster(shape: tuple[int, ...], dtype: str, parts: tuple[_Part, ...]):
    """A program that takes a destination box's pieces out of their buckets and pastes them
    into a block of `shape` (the pieces tile it)."""
    nbytes = jax.numpy.dtype(dtype).itemsize

    def paste(*inputs):
        out = jax.numpy.empty(shape, dtype)
        for k, offset, piece_shape, start in parts:
            piece = inputs[k]
            if offset >= 0:
                piece = _from_bytes(piece[offset:offset + math.prod(piece_shape) * nbytes],
                                    piece_shape, dtype)
            out = jax.lax.dynamic_update_slice(out, piece, start)
        return out

    return jax.jit(paste)


def _slice(data: jax.Array, piece: Piece) -> jax.Array:
    """The piece cut out of the sender's shard (the shard itself when it is all of it)."""
    if piece.box == piece.src_box:
        return data
    return data[_within(piece.box, piece.src_box)]


def _placeholder(shape: tuple[int, ...], device: jax.Device, dtype) -> jax.Array:
    """Another process's array: what this process passes to the same transfer."""
    return jax.make_array_from_single_device_arrays(
        shape, SingleDeviceSharding(device), [], dtype=dtype)


def _shard(x: jax.Array, device: jax.Device) -> jax.Array:
    return next(s.data for s in x.addressable_shards if s.device == device)


class _Transfer:
    """One move's buckets on this process: the sender's payloads (kept until every receiver
    has accepted them, for a resend) and the receiver's buckets with both sides' checksums."""

    def __init__(self, xs: list[jax.Array], plans: list[Plan], bs: list[Bucket]):
        self.xs, self.plans, self.buckets = xs, plans, bs
        self.me = jax.process_index()
        self.payloads: dict[int, tuple[jax.Array, jax.Array]] = {}  # sender: (data, checksum)
        self.made: list[int] = []  # sender: the payloads that are copies (not its own shards)
        self.received: dict[int, jax.Array] = {}  # receiver: data by bucket
        # receiver: (the pair's sender checksums, this bucket's position in them, its own)
        self.sums: dict[int, tuple[jax.Array, int, jax.Array]] = {}

    def _payload(self, b: int) -> tuple[jax.Array, jax.Array]:
        if b not in self.payloads:
            bucket = self.buckets[b]
            if not bucket.packed:
                (i, j), = bucket.items
                piece = self.plans[i].pieces[j]
                data = _slice(_shard(self.xs[i], bucket.src), piece)
                self.payloads[b] = data, checksum(data)
                if piece.box != piece.src_box:
                    self.made.append(b)
            else:
                arrays = list(dict.fromkeys(i for i, _ in bucket.items))
                cuts = tuple((arrays.index(i), _within(self.plans[i].pieces[j].box,
                                                       self.plans[i].pieces[j].src_box))
                             for i, j in bucket.items)
                cuts = tuple((k, tuple((s.start, s.stop) for s in box)) for k, box in cuts)
                self.payloads[b] = _packer(cuts)(*[_shard(self.xs[i], bucket.src)
                                                   for i in arrays])
                self.made.append(b)
        return self.payloads[b]

    def _placeholder(self, b: int) -> jax.Array:
        bucket = self.buckets[b]
        if bucket.packed:
            return _placeholder((bucket.nbytes,), bucket.src, jax.numpy.uint8)
        (i, j), = bucket.items
        return _placeholder(self.plans[i].pieces[j].shape, bucket.src, self.xs[i].dtype)

    def send(self, which: list[int], attempt: int, in_transit: InTransit | None,
             names: list[str]) -> list[jax.Array]:
        """Issues the buckets `which` pair by pair, each pair's buckets and then its sender's
        checksums (uint32 [buckets]) in one `device_put` (one per pair: module docstring);
        returns what this process received (to wait for)."""
        pairs: dict[tuple[int, int], list[int]] = {}
        for b in which:  # every process issues every transfer (JAX counts them on each)
            pairs.setdefault((self.buckets[b].src.id, self.buckets[b].dst.id), []).append(b)
        arrived = []
        for bs in pairs.values():
            src, dst = self.buckets[bs[0]].src, self.buckets[bs[0]].dst
            if src.process_index == self.me:
                data = [self._payload(b)[0] for b in bs]
                data.append(_concat(*[self._payload(b)[1] for b in bs]))
            else:
                data = [self._placeholder(b) for b in bs]
                data.append(_placeholder((len(bs),), src, jax.numpy.uint32))
            moved = jax.device_put(data, [SingleDeviceSharding(dst)] * len(data),
                                   may_alias=False)
            if dst.process_index != self.me:
                continue
            for k, (b, got) in enumerate(zip(bs, moved)):
                if in_transit is not None:
                    got = in_transit(self.bucket_names(b, names), attempt, got)
                self.received[b] = got
                self.sums[b] = (moved[-1], k, (flat_checksum if self.buckets[b].packed
                                               else checksum)(got))
            arrived += [moved[-1]] + [self.received[b] for b in bs]
        return arrived

    def bad(self, which: list[int]) -> list[int]:
        """The buckets among `which` this process received whose checksums differ (one small
        device-to-host read for all of them)."""
        mine = [b for b in which if b in self.sums]
        got = jax.device_get([(self.sums[b][0], self.sums[b][2]) for b in mine])
        return [b for b, (sent, own) in zip(mine, got) if sent[self.sums[b][1]] != own[0]]

    def bucket_names(self, b: int, names: list[str]) -> tuple[str, ...]:
        return tuple(dict.fromkeys(names[i] for i, _ in self.buckets[b].items))

    def drop(self) -> None:
        """Deletes what the sender made to send (its whole shards stay: they are the source)."""
        for b in self.made:
            self.payloads[b][0].delete()


@jax.jit
def _concat(*sums):
    return jax.numpy.concatenate(sums)


def _exchange(move: int, attempt: int, mine: list[int]) -> list[int]:
    """The union over every process of `mine` (bucket indices) in attempt `attempt` of this
    process's move number `move`, through the coordination service: each process publishes its
    own, then reads every other's. Called after the move's barrier, so every process is done
    reading the keys of the previous move that published any: this process's go then."""
    from jax._src import distributed

    client = distributed.global_state.client
    timeout_ms = int(2 * (watchdog.timeout_s() or 300) * 1000)
    me = jax.process_index()
    if attempt == 0 and _PUBLISHED[0]:
        client.key_value_delete(f"jaxrlhf_transfer/{me}/{_PUBLISHED[0]}")
    _PUBLISHED[0] = move
    client.key_value_set(f"jaxrlhf_transfer/{me}/{move}/{attempt}", ",".join(map(str, mine)))
    out = set()
    for p in range(jax.process_count()):
        text = client.blocking_key_value_get(f"jaxrlhf_transfer/{p}/{move}/{attempt}",
                                             timeout_ms)
        out.update(int(b) for b in text.split(",") if b)
    return sorted(out)


def _local(xs: list[jax.Array], plans: list[Plan]) -> dict[tuple[int, int], jax.Array]:
    """The pieces that stay in this process, each on its destination device."""
    me = jax.process_index()
    items = [(i, j) for i, p in enumerate(plans) for j, piece in enumerate(p.pieces)
             if piece.src.process_index == me and not piece.crosses]
    if not items:
        return {}
    pieces = [_slice(_shard(xs[i], plans[i].pieces[j].src), plans[i].pieces[j])
              for i, j in items]
    targets = [SingleDeviceSharding(plans[i].pieces[j].dst) for i, j in items]
    return dict(zip(items, jax.device_put(pieces, targets, may_alias=False)))


def assemble(x: jax.Array, dst: NamedSharding, i: int, p: Plan, t: _Transfer,
             local: dict) -> jax.Array:
    """The destination array from this process's accepted buckets and local pieces (and
    local replica copies): one paste program per destination box, unless one piece is all
    of it."""
    me = jax.process_index()
    where: dict[tuple[int, int], tuple[int, int]] = {}  # (i, j) -> (bucket, byte offset)
    for b, data in t.received.items():
        bucket, offset = t.buckets[b], 0
        for i2, j in bucket.items:
            where[i2, j] = (b, offset if bucket.packed else -1)
            offset += _size(t.plans[i2].pieces[j].box) * t.plans[i2].itemsize
    by_device: dict[jax.Device, jax.Array] = {}
    boxes: dict[jax.Device, list[int]] = {}
    for j, piece in enumerate(p.pieces):
        if piece.dst.process_index == me:
            boxes.setdefault(piece.dst, []).append(j)
    for device, js in boxes.items():
        dst_box = p.pieces[js[0]].dst_box
        inputs: list[jax.Array] = []
        parts = []
        for j in js:
            if (i, j) in local:
                data, offset = local[i, j], -1
            else:
                b, offset = where[i, j]
                data = t.received[b]
            k = next((n for n, a in enumerate(inputs) if a is data), None)
            if k is None:
                k, inputs = len(inputs), inputs + [data]
            start = tuple(lo - o for (lo, _), (o, _) in zip(p.pieces[j].box, dst_box))
            parts.append((k, offset, p.pieces[j].shape, start))
        if len(js) == 1 and parts[0][1] < 0 and p.pieces[js[0]].box == dst_box:
            by_device[device] = inputs[0]
        else:
            shape = tuple(hi - lo for lo, hi in dst_box)
            by_device[device] = _paster(shape, x.dtype.name, tuple(parts))(*inputs)
    copies = [(primary, device) for primary, device in p.replicas if device.process_index == me]
    if copies:
        moved = jax.device_put([by_device[a] for a, _ in copies],
                               [SingleDeviceSharding(b) for _, b in copies], may_alias=False)
        by_device.update({b: y for (_, b), y in zip(copies, moved)})
    shards = [by_device[d] for d in dst.addressable_devices_indices_map(x.shape)]
    return jax.make_array_from_single_device_arrays(x.shape, dst, shards, dtype=x.dtype)


def _refusal(t: _Transfer, b: int, names: list[str]) -> str:
    bucket = t.buckets[b]
    what = ", ".join(f"{names[i]} {list(t.plans[i].pieces[j].box)}" for i, j in bucket.items)
    return (f"weights corrupted in transit {RESENDS + 1} times: {what} from process "
            f"{bucket.src.process_index} (device {bucket.src.id}) to device {bucket.dst.id}: "
            f"checksum mismatch; not using them")


_MOVES = [0]  # moves so far in this process (every process counts the same)
_PUBLISHED = [0]  # the last move whose checksum verdicts this process published


def move(xs: list[jax.Array], dsts: list[NamedSharding], wait: Callable[[list], None],
         names: list[str] | None = None, in_transit: InTransit | None = None,
         bucket_bytes: int = BUCKET_BYTES) -> tuple[list[jax.Array], int]:
    """Moves each array to its destination sharding (device memory, any processes) in buckets;
    `wait(arrays)` blocks until this process's buckets are in and every process has reached
    the same point (the caller's barrier). A bucket whose checksum differs on arrival is sent
    again, up to `RESENDS` times (every process learns which, `_exchange`); one that still
    differs raises `CorruptTransfer` on its receiver, naming its parameters.

    Args:
      names: each array's name in a `CorruptTransfer` message (default: its position).
      in_transit: called with every bucket this process receives (its parameters' names, the
        attempt, the data) as it arrives; what it returns is kept (tests flip a bit there to
        stand for a fault on the wire).
      bucket_bytes: the most bytes one packed bucket carries.

    Returns:
      (arrays, bytes that crossed processes, resends included).
    """
    names = names or [f"array {i}" for i in range(len(xs))]
    plans = [plan(x.sharding, dst, x.shape, x.dtype.itemsize) for x, dst in zip(xs, dsts)]
    bs = buckets(plans, bucket_bytes)
    t = _Transfer(xs, plans, bs)
    local = _local(xs, plans)
    _MOVES[0] += 1
    which, wire = list(range(len(bs))), 0
    for attempt in range(RESENDS + 1):
        arrived = t.send(which, attempt, in_transit, names)
        wire += sum(bs[b].nbytes for b in which)
        # Pasted while the rest is in flight and checked; returned only once every bucket
        # it was pasted from is accepted.
        out = [assemble(x, dst, i, p, t, local) for i, (x, dst, p) in
               enumerate(zip(xs, dsts, plans))]
        wait(arrived + list(local.values()))
        if not bs:
            break
        which = _exchange(_MOVES[0], attempt, t.bad(which))
        if not which:
            break
    t.drop()
    corrupt = [b for b in which if b in t.received]
    if corrupt:  # (a process whose own buckets all arrived whole goes on; this one stops)
        raise CorruptTransfer(_refusal(t, corrupt[0], names))
    return out, wire
