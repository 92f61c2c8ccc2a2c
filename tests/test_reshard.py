"""reshard / offload / onload: exact, device to device, chunked, freeing, with byte accounting.

Everything that moves runs under `_no_host_bounce()`: implicit transfers are disallowed, and so
are *explicit* host<->device transfers, so a path that gathers through numpy raises.
"""

import contextlib
import itertools
import sys
from collections import Counter

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrlhf.models.sizes import abstract_params, get_size
from jaxrlhf.parallel import make_layout
from tests.processes import run_processes
from jaxrlhf.parallel.reshard import (
    ReshardStats, Route, chunks, choose_route, host_memory_kind, offload_to_host, onload, reshard,
    transfer,
)

SPECS = ["0-7:d8", "0-7:f8", "0-7:d2f2t2", "0-3:t4", "4-7:d2t2", "0-1:t2", "0-7:t2f4"]
# num_kv_heads=4 so that t4 divides both head counts.
TINY = get_size("tiny", dtype=jnp.float32, num_kv_heads=4)

# A tree with one leaf per kind of logical layout the model uses.
TREE_AXES = {
    "embedding": ("vocab", "embed"),
    "q_kernel": ("layers", "embed", "heads", "head_dim"),
    "down_kernel": ("layers", "mlp", "embed"),
    "norm": ("embed",),
}
TREE_SHAPES = {"embedding": (16, 8), "q_kernel": (2, 8, 4, 2), "down_kernel": (2, 16, 8),
               "norm": (8,)}


@contextlib.contextmanager
def _no_host_bounce():
    with (
        jax.transfer_guard("disallow"),
        jax.transfer_guard_host_to_device("disallow_explicit"),
        jax.transfer_guard_device_to_host("disallow_explicit"),
    ):
        yield


def _numpy_tree():
    return {
        name: np.random.default_rng(i).standard_normal(shape).astype(np.float32)
        for i, (name, shape) in enumerate(TREE_SHAPES.items())
    }


def _tree_shardings(layout):
    return {name: layout.sharding(TREE_AXES[name], TREE_SHAPES[name]) for name in TREE_AXES}


def _assert_exact(tree, expected):
    for a, b in zip(jax.tree.leaves(tree), jax.tree.leaves(expected)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_plain_device_put_bounces_through_host():
    """Why reshard exists: this JAX gathers through numpy when shard boundaries change."""
    src = make_layout("0-3:t4").sharding(("vocab", "embed"))
    dst = make_layout("4-7:f4").sharding(("vocab", "embed"))
    x = jax.device_put(np.ones((16, 8), np.float32), src)
    with _no_host_bounce(), pytest.raises(Exception, match="Disallowed host-to-device"):
        jax.device_put(x, dst)
    with _no_host_bounce():
        moved, _ = reshard(x, dst)
    assert moved.sharding == dst


def test_every_ordered_pair_round_trips_exactly():
    layouts = [make_layout(spec, model=TINY) for spec in SPECS]
    expected = _numpy_tree()
    shardings = [_tree_shardings(layout) for layout in layouts]
    sources = [jax.device_put(expected, s) for s in shardings]  # host upload: test setup only
    routes = Counter()
    with _no_host_bounce():
        for i, j in itertools.permutations(range(len(layouts)), 2):
            for x, dst in zip(jax.tree.leaves(sources[i]), jax.tree.leaves(shardings[j])):
                routes[choose_route(x.sharding, dst, x.shape)] += 1
            there, _ = reshard(sources[i], shardings[j])
            back, _ = reshard(there, shardings[i])
            assert jax.tree.map(lambda x: x.sharding, there) == shardings[j], (SPECS[i], SPECS[j])
            assert jax.tree.map(lambda x: x.sharding, back) == shardings[i]
            _assert_exact(there, expected)
            _assert_exact(back, expected)
    # The pairs cover every route that moves data.
    assert set(routes) >= {Route.COPY, Route.COLLECTIVE, Route.GATHER_THEN_COPY,
                           Route.COPY_THEN_SCATTER}


@pytest.fixture(scope="module")
def tiny_params():
    """Tiny-model-shaped params on 0-7:d2f2t2, and the numpy values they must keep.

    Random values uploaded from numpy (setup, outside the guard) rather than `init_params`:
    these tests are about moving, and an init compile costs more than all of them.
    """
    abstract = abstract_params(TINY)
    rng = np.random.default_rng(0)
    expected = jax.tree.map(
        lambda x: rng.standard_normal(x.shape).astype(np.float32), nn.unbox(abstract)
    )
    shardings = make_layout("0-7:d2f2t2", model=TINY).param_shardings(abstract)
    return jax.device_put(expected, shardings), expected


def test_model_params_through_overlapping_and_disjoint_layouts(tiny_params):
    params, expected = tiny_params
    abstract = abstract_params(TINY)
    chain = ["0-3:t4", "4-7:d2t2", "0-1:t2", "0-7:t2f4", "0-7:d2f2t2"]
    current = params
    with _no_host_bounce():
        for spec in chain:
            dst = make_layout(spec, model=TINY).param_shardings(abstract)
            current, stats = reshard(current, dst, chunk_bytes=64 << 10)
            assert jax.tree.map(lambda x: x.sharding, current) == dst
            _assert_exact(current, expected)
    assert stats.bytes_moved == sum(x.nbytes for x in jax.tree.leaves(params))


def test_offload_and_onload_exact(tiny_params):
    params, expected = tiny_params
    on_device = params
    target = make_layout("0-3:t4", model=TINY).param_shardings(abstract_params(TINY))
    kind = host_memory_kind()
    assert kind == "pinned_host"  # CPU devices expose it on this JAX
    with _no_host_bounce():
        on_host, stats = offload_to_host(on_device, free_source=False)
        assert {x.sharding.memory_kind for x in jax.tree.leaves(on_host)} == {kind}
        assert jax.tree.map(lambda x: x.sharding.spec, on_host) == jax.tree.map(
            lambda x: x.sharding.spec, on_device)
        assert stats.bytes_moved == sum(x.nbytes for x in jax.tree.leaves(params))
        back, _ = onload(on_host, free_source=False)
        elsewhere, _ = onload(on_host, target)
    assert {x.sharding.memory_kind for x in jax.tree.leaves(back)} == {"device"}
    assert jax.tree.map(lambda x: x.sharding, elsewhere) == target
    assert all(x.is_deleted() for x in jax.tree.leaves(on_host))  # onload frees by default
    _assert_exact(back, expected)
    _assert_exact(elsewhere, expected)


def test_free_source_deletes_only_after_copy():
    expected = _numpy_tree()
    src = jax.device_put(expected, _tree_shardings(make_layout("0-7:f8")))
    kept = jax.device_put(expected, _tree_shardings(make_layout("0-3:t4")))
    with _no_host_bounce():
        copy, _ = reshard(kept, _tree_shardings(make_layout("4-7:d2t2")))
        moved, _ = reshard(src, _tree_shardings(make_layout("0-1:t2")), free_source=True,
                           chunk_bytes=1)
    assert all(x.is_deleted() for x in jax.tree.leaves(src))
    assert not any(x.is_deleted() for x in jax.tree.leaves(kept))
    _assert_exact(moved, expected)
    _assert_exact(copy, expected)
    _assert_exact(kept, expected)


def test_bytes_accounting_skips_unchanged_leaves():
    expected = _numpy_tree()
    layout = make_layout("0-7:d2f2t2")
    src = jax.device_put(expected, _tree_shardings(layout))
    dst = dict(_tree_shardings(layout), norm=make_layout("0-1:t2").replicated())
    with _no_host_bounce():
        moved, stats = reshard(src, dst, free_source=True)
    assert isinstance(stats, ReshardStats) and stats.seconds > 0
    assert stats.bytes_moved == expected["norm"].nbytes
    assert moved["embedding"] is src["embedding"] and not src["embedding"].is_deleted()
    assert src["norm"].is_deleted()
    _assert_exact(moved, expected)


def test_single_device_source():
    x = jax.device_put(jnp.arange(32.0).reshape(4, 8), jax.devices()[3])
    dst = make_layout("0-7:d2f2t2").sharding(("vocab", "embed"))
    with _no_host_bounce():
        moved, stats = reshard(x, dst)
    assert moved.sharding == dst and stats.bytes_moved == x.nbytes
    np.testing.assert_array_equal(np.asarray(moved), np.arange(32.0).reshape(4, 8))


def test_chunks_bound_bytes():
    assert chunks([10, 10, 10, 25, 5], 20) == [[0, 1], [2], [3], [4]]
    assert chunks([5, 5, 5], 100) == [[0, 1, 2]]
    assert chunks([], 100) == []


def test_transfer_uploads_host_and_moves_device_leaves_without_blocking():
    src, dst = make_layout("0-3:d4"), make_layout("4-7:f2t2")
    x = np.arange(32, dtype=np.float32).reshape(8, 4)
    tree = {"host": x, "device": jax.device_put(x, src.batch_sharding(2))}
    shardings = {"host": dst.sharding(("batch", None)), "device": dst.sharding((None, "vocab"))}
    with jax.transfer_guard("disallow"):
        placed = transfer(tree, shardings)
    for name in tree:
        assert placed[name].sharding.is_equivalent_to(shardings[name], 2)
        np.testing.assert_array_equal(jax.device_get(placed[name]), x)
    assert transfer(placed, shardings)["device"] is placed["device"]  # already there: untouched


# --- multi-process: one source process, two destination processes ------------------------------


def _three_process_worker(address: str, process_id: int) -> None:
    """One of 3 processes × 2 CPU devices: leaves on process 0 (two device orders) move to
    `spanning`, i.e. one block on each process; every process checks its shards."""
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from jaxrlhf import distributed
    from jaxrlhf.backend import use_cpu_devices

    cfg = distributed.from_flags(address, 3, process_id, heartbeat_timeout_s=5, wait_timeout_s=20)
    use_cpu_devices(2)
    distributed.initialize(cfg)
    from jaxrlhf.parallel.reshard import spanning

    devices = jax.devices()
    # Two source device orders x two destination processes: four (source, destination)
    # device-list pairs in one hop, which a single batched device_put mismatched (see _send).
    srcs = [NamedSharding(Mesh(np.asarray(devices[:2]), ("d",)), PartitionSpec("d")),
            NamedSharding(Mesh(np.asarray(devices[1::-1]), ("d",)), PartitionSpec("d"))]
    want = {f"w{i}": np.arange(8 * (i + 1), dtype=np.float32).reshape(4, 2 * (i + 1))
            for i in range(4)}
    tree = {name: jax.make_array_from_callback(value.shape, srcs[i % 2],
                                               lambda index, v=value: v[index], dtype=value.dtype)
            for i, (name, value) in enumerate(want.items())}
    moved, _ = reshard(tree, {name: spanning(x.sharding) for name, x in tree.items()})
    for name, x in moved.items():
        assert len(x.addressable_shards) == 2
        for shard in x.addressable_shards:
            np.testing.assert_array_equal(np.asarray(shard.data), want[name][shard.index])
    print("reshard-ok", flush=True)


def test_cross_hop_from_one_process_to_two_arrives_everywhere():
    """3 real processes (no model, nothing compiled; ~10 s, mostly JAX start-ups): a hop from
    process 0 onto blocks of processes 1 and 2 delivers every shard. Before `_send`, one
    batched device_put hung here (the 3-process checkpoint save of async RL)."""
    for i, (p, out, err) in enumerate(run_processes(__file__, 3)):
        assert p.returncode == 0 and "reshard-ok" in out, f"process {i}: {err[-2000:]}"


if __name__ == "__main__":
    _three_process_worker(sys.argv[1], int(sys.argv[2]))


def test_same_devices_in_another_mesh_order():
    """Two meshes over the same devices in different orders (a TPU slice's meshes follow the
    torus, one per shape): a program keeps one device order, so the collective runs on the
    source's order and a copy puts each shard on its device; bit for bit."""
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    devices = np.asarray(jax.devices()[:8])
    src = NamedSharding(Mesh(devices.reshape(2, 4), ("a", "b")), PartitionSpec("a", "b"))
    swapped = devices.reshape(2, 2, 2).transpose(1, 0, 2).reshape(4, 2)
    dst = NamedSharding(Mesh(swapped, ("a", "b")), PartitionSpec("a"))  # new shard shapes
    x = jax.device_put(jnp.arange(16 * 8, dtype=jnp.float32).reshape(16, 8), src)
    assert choose_route(src, dst, x.shape) is Route.COLLECTIVE
    (moved,), _ = reshard([x], [dst])
    assert moved.sharding == dst
    np.testing.assert_array_equal(np.asarray(moved), np.asarray(x))
    for shard in moved.addressable_shards:
        np.testing.assert_array_equal(np.asarray(shard.data), np.asarray(x)[shard.index])
