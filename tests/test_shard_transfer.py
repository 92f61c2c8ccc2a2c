"""Shard-to-shard moves (`parallel/shard_transfer.py`): exact values, and across processes
exactly the bytes each destination process lacks on the wire, against the staged hop's."""

import subprocess
import sys

import jax
import numpy as np
import pytest

from jaxrlhf.parallel import make_layout, shard_transfer
from tests.processes import run_processes

# Sharded to replicated and back, onto fewer, more, disjoint and overlapping devices.
PAIRS = [("0-7:f8", "0-3:t4"), ("0-1:t2", "0-7:t2f4"), ("0-7:t2f4", "0-7:d8"),
         ("4-7:d2t2", "0-3:t4")]
SHAPES = {"embedding": (16, 8), "q_kernel": (2, 8, 4, 2), "down_kernel": (2, 16, 8),
          "norm": (8,), "up_kernel": (4, 512, 512)}  # up_kernel: pieces of 1 MiB and more
AXES = {"embedding": ("vocab", "embed"), "q_kernel": ("layers", "embed", "heads", "head_dim"),
        "down_kernel": ("layers", "mlp", "embed"), "norm": ("embed",),
        "up_kernel": ("layers", "embed", "mlp")}


def _values():
    return {name: np.random.default_rng(i).standard_normal(shape).astype(np.float32)
            for i, (name, shape) in enumerate(SHAPES.items())}


def _shardings(spec, devices=None):
    layout = make_layout(spec, devices=devices)
    return {name: layout.sharding(AXES[name], SHAPES[name]) for name in SHAPES}


def _placed(values, shardings):
    return {name: jax.make_array_from_callback(v.shape, shardings[name], lambda i, v=v: v[i],
                                               dtype=v.dtype)
            for name, v in values.items()}


def _box_cover(p: shard_transfer.Plan) -> dict:
    """Elements each primary device receives, by device, counting overlaps twice."""
    out = {}
    for piece in p.pieces:
        out[piece.dst] = out.get(piece.dst, 0) + int(np.prod(piece.shape))
    return out


@pytest.mark.parametrize("src_spec,dst_spec", PAIRS)
def test_pieces_tile_every_destination_box_and_values_arrive_exactly(src_spec, dst_spec):
    """One process: every piece lies in its source and destination boxes, a primary's pieces
    add up to its box (so they tile it: boxes of one sharding do not overlap), replicas copy
    a primary of their box; the moved arrays equal the source bit for bit."""
    values = _values()
    src, dst = _shardings(src_spec), _shardings(dst_spec)
    xs = _placed(values, src)
    names = list(SHAPES)
    for name in names:
        shape = SHAPES[name]
        p = shard_transfer.plan(src[name], dst[name], shape, 4)
        dst_map = dst[name].devices_indices_map(shape)
        cover = _box_cover(p)
        for device, count in cover.items():
            box = shard_transfer.box_of(dst_map[device], shape)
            assert count == np.prod([hi - lo for lo, hi in box])
        for primary, other in p.replicas:
            assert dst_map[primary] == dst_map[other] and primary in cover
        assert set(cover) | {b for _, b in p.replicas} == set(dst_map)
        assert p.wire_bytes == 0  # one process: nothing crosses
    moved, wire = shard_transfer.move([xs[n] for n in names], [dst[n] for n in names],
                                      jax.block_until_ready)
    assert wire == 0
    for name, x in zip(names, moved):
        assert x.sharding == dst[name]
        for shard in x.addressable_shards:
            np.testing.assert_array_equal(np.asarray(shard.data), values[name][shard.index])


# --- two processes × 4 CPU devices: trainer layouts on process 0, generator's on process 1 ------

CASES = ["0-3:f4>4-5:d2", "0-3:d2t2>4-7:t4", "0-1:p2>4-7:d4", "0-3:t4>4-7:f2t2"]


def _two_process_worker(address: str, process_id: int) -> None:
    from jaxrlhf import distributed
    from jaxrlhf.backend import use_cpu_devices

    cfg = distributed.from_flags(address, 2, process_id, heartbeat_timeout_s=5, wait_timeout_s=60)
    use_cpu_devices(4)
    distributed.initialize(cfg)
    from jaxrlhf.parallel.reshard import CrossPath, cross_process_path, reshard

    values = _values()
    kinds = set()  # packed buckets, pieces as they are
    for case in CASES:
        src_spec, dst_spec = case.split(">")
        src = _shardings(src_spec, jax.devices())
        dst = _shardings(dst_spec, jax.devices())
        xs = _placed(values, src)
        need = sum(shard_transfer.need_bytes(src[n], dst[n], SHAPES[n], 4) for n in SHAPES)
        plans = [shard_transfer.plan(src[n], dst[n], SHAPES[n], 4) for n in SHAPES]
        kinds |= {b.packed for b in shard_transfer.buckets(plans, shard_transfer.BUCKET_BYTES)}
        wire = {}
        for path in CrossPath:
            with cross_process_path(path):
                moved, stats = reshard(xs, dst)
            wire[path] = stats.wire_bytes
            for name, x in moved.items():
                for shard in x.addressable_shards:
                    np.testing.assert_array_equal(np.asarray(shard.data),
                                                  values[name][shard.index])
        assert wire[CrossPath.SHARDS] == need > 0, (case, wire, need)
        assert wire[CrossPath.STAGED] >= need, (case, wire, need)
        print(case, wire[CrossPath.STAGED], wire[CrossPath.SHARDS], need, flush=True)
    assert kinds == {True, False}, kinds
    print("shards-ok", flush=True)
    _corrupt_in_transit()


def _flip_a_byte(x):
    """`x` with bit 4 of its first byte flipped."""
    import jax.numpy as jnp

    raw = x if x.dtype == jnp.uint8 else jax.lax.bitcast_convert_type(x, jnp.uint8)
    flat = raw.reshape(-1)
    flat = flat.at[0].set(flat[0] ^ jnp.uint8(16)).reshape(raw.shape)
    return flat if x.dtype == jnp.uint8 else jax.lax.bitcast_convert_type(flat, x.dtype)


def _corrupt_in_transit() -> None:
    """t4 on process 0 -> d2t2 on process 1, one bucket per piece: one byte of each bucket of
    `q_kernel` flipped on arrival, first only on the first attempt (process 1 prints the bytes
    moved and checks the values), then on every attempt (process 1 prints the refusal)."""
    from jax._src import distributed as jax_distributed

    values = _values()
    src, dst = _shardings("0-3:t4", jax.devices()), _shardings("4-7:d2t2", jax.devices())
    xs = _placed(values, src)
    names = list(SHAPES)
    need = sum(shard_transfer.need_bytes(src[n], dst[n], SHAPES[n], 4) for n in SHAPES)
    waits = iter(range(100))

    def wait(arrays):
        jax.block_until_ready(arrays)
        jax_distributed.global_state.client.wait_at_barrier(f"corrupt{next(waits)}", 60_000)

    for persistent in (False, True):
        attempts = []

        def flip(bucket_names, attempt, data):
            if "q_kernel" not in bucket_names or (attempt > 0 and not persistent):
                return data
            attempts.append(attempt)
            return _flip_a_byte(data)

        try:
            moved, wire = shard_transfer.move(
                [xs[n] for n in names], [dst[n] for n in names], wait, names,
                flip if jax.process_index() == 1 else None, bucket_bytes=1)
        except shard_transfer.CorruptTransfer as error:
            print(f"attempts {sorted(set(attempts))}", flush=True)
            print(f"refused: {error}", flush=True)
            continue
        for name, x in zip(names, moved):
            for shard in x.addressable_shards:
                np.testing.assert_array_equal(np.asarray(shard.data), values[name][shard.index])
        print(f"moved {wire} {need}", flush=True)


@pytest.fixture(scope="module")
def two_processes() -> list[tuple[subprocess.Popen, str, str]]:
    """Both processes' (process, stdout, stderr) after the worker's moves (one start-up for
    the tests below: ~15 s, mostly JAX start-ups)."""
    return run_processes(__file__, 2)


def test_a_bucket_flipped_in_transit_once_is_resent(two_processes):
    """A bucket whose checksum differs on arrival is sent again: the values arrive exact, and
    the wire carries the need plus q_kernel's buckets once more (its 2 boxes of 2x8x2x2 f32)."""
    (p0, out0, err0), (p1, out1, err1) = two_processes
    assert p0.returncode == 0 and p1.returncode == 0, err1[-3000:]
    moved = [line.split() for line in out1.splitlines() if line.startswith("moved")]
    assert len(moved) == 1, out1[-3000:]
    _, wire, need = moved[0]
    assert int(wire) == int(need) + 2 * 2 * 8 * 2 * 2 * 4


def test_a_bucket_corrupt_on_every_attempt_stops_naming_the_parameter(two_processes):
    """Corrupt on the first send and on each resend: the receiver refuses in one line naming
    the parameter, before assembling anything; the sender's side is clean."""
    (p0, out0, err0), (p1, out1, err1) = two_processes
    assert p0.returncode == 0 and out0.count("moved") == 2, err0[-3000:]
    assert p1.returncode == 0, err1[-3000:]
    assert f"attempts {list(range(shard_transfer.RESENDS + 1))}" in out1.splitlines()
    (line,) = [x for x in out1.splitlines() if x.startswith("refused")]
    assert line.startswith(f"refused: weights corrupted in transit "
                           f"{shard_transfer.RESENDS + 1} times: q_kernel [(0, 2), "), line
    assert "from process 0" in line and line.endswith("checksum mismatch; not using them")


def test_checksum_changes_with_any_one_byte():
    """Every single-byte change of a bf16 and an f32 array changes the checksum (so any change
    of one element: its words' weights are odd)."""
    import jax.numpy as jnp

    for dtype in (jnp.bfloat16, jnp.float32):
        x = jnp.asarray(np.random.default_rng(0).standard_normal(24), dtype)
        raw = np.asarray(jax.lax.bitcast_convert_type(x, jnp.uint8)).reshape(-1)
        base = int(shard_transfer.checksum(x)[0])
        for i in range(raw.size):
            for delta in (1, 128, 255):
                changed = raw.copy()
                changed[i] = (int(changed[i]) + delta) % 256
                y = jax.lax.bitcast_convert_type(
                    jnp.asarray(changed.reshape(x.shape + ((x.dtype.itemsize,) if
                                                            x.dtype.itemsize > 1 else ()))),
                    dtype)
                assert int(shard_transfer.checksum(y)[0]) != base, (dtype, i, delta)


def test_flat_checksum_changes_with_any_one_byte():
    """A packed bucket's checksum (32-bit words, then 1-3 trailing bytes) changes with every
    single-byte change, in the words and in the tail."""
    import jax.numpy as jnp

    raw = np.random.default_rng(2).integers(0, 256, 19).astype(np.uint8)
    base = int(shard_transfer.flat_checksum(jnp.asarray(raw))[0])
    for i in range(raw.size):
        for delta in (1, 128, 255):
            changed = raw.copy()
            changed[i] = (int(changed[i]) + delta) % 256
            assert int(shard_transfer.flat_checksum(jnp.asarray(changed))[0]) != base, (i, delta)


def test_checksum_of_a_mask_sees_every_element():
    """Bools (which bitcast refuses) are summed by value: each flipped element changes it."""
    import jax.numpy as jnp

    mask = jnp.asarray(np.random.default_rng(1).integers(0, 2, 40).astype(bool))
    base = int(shard_transfer.checksum(mask)[0])
    for i in range(mask.size):
        assert int(shard_transfer.checksum(mask.at[i].set(~mask[i]))[0]) != base, i


def test_two_processes_receive_exactly_what_they_lack(two_processes):
    """2 real processes: each case's generator layout receives the
    trainer's values bit for bit by both paths (buckets packed and pieces sent as they are), shard to shard with bytes on the wire equal to
    the need (`need_bytes`, computed element by element), the staged hop with at least as many
    (twice as many for f4 -> d2, whose replica is built on the sender and crosses whole)."""
    results = two_processes
    for i, (p, out, err) in enumerate(results):
        assert p.returncode == 0 and "shards-ok" in out, f"process {i}: {err[-3000:]}"
    staged_f4_d2 = [line for line in results[0][1].splitlines() if line.startswith(CASES[0])]
    _, staged, shards, need = staged_f4_d2[0].split()
    assert int(staged) == 2 * int(need) == 2 * int(shards)


if __name__ == "__main__":
    _two_process_worker(sys.argv[1], int(sys.argv[2]))
