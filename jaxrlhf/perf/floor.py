"""The machine's FLOP floor: a matmul peak probe measured in-process, at the workload dtype.

The floor of a piece of work is its model FLOPs divided by the peak FLOP/s its devices reach on
a large, square, jitted matmul measured in the same process (so the same XLA flags, thread pool
and neighbouring load apply to both). The probe is sharded over the devices it is asked about
(batch-parallel, no communication), takes the best of a few repeats (noise only slows a run
down), and is cached per (devices, dtype).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec


def _timed_best(fn, *args, repeats: int) -> float:
    """Best wall seconds of `repeats` calls of `fn(*args)` (after one warm-up call)."""
    jax.block_until_ready(fn(*args))
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        best = min(best, time.perf_counter() - start)
    return best


def probe_call(devices: Sequence[jax.Device], dtype, size: int | None = None
               ) -> tuple[Callable[[], jax.Array], float]:
    """(a call of the compiled matmul probe on `devices` at `dtype`, its FLOPs).

    Args:
      devices: the devices it spreads over (batch-parallel, no communication).
      dtype: the workload's compute dtype.
      size: matrix side; default 2048 on CPU (a 1024 matmul is too short to reach the peak
        on a few cores), 8192 on accelerators.
    """
    if size is None:
        size = 2048 if devices[0].platform == "cpu" else 8192
    mesh = Mesh(np.array(devices), ("d",))
    rows = NamedSharding(mesh, PartitionSpec("d"))
    dtype = jnp.dtype(dtype)
    # [size, size] @ [size, size], the rows of the left side split over the devices and the
    # right side replicated: 2·size³ FLOPs with no communication, plain 2-D dots per device.
    run = jax.jit(lambda a, b: a @ b, out_shardings=rows)
    key_a, key_b = jax.random.split(jax.random.key(0))
    a = jax.device_put(jax.random.normal(key_a, (size, size), dtype), rows)
    b = jax.device_put(jax.random.normal(key_b, (size, size), dtype),
                       NamedSharding(mesh, PartitionSpec()))
    return (lambda: run(a, b)), 2.0 * size**3


@functools.lru_cache(maxsize=None)
def _probe(device_ids: tuple[int, ...], dtype_name: str, size: int | None, repeats: int
           ) -> float:
    call, flops = probe_call([d for d in jax.devices() if d.id in device_ids], dtype_name, size)
    return flops / _timed_best(call, repeats=repeats)


def matmul_peak(devices: Sequence[jax.Device], dtype, *, size: int | None = None,
                repeats: int = 3) -> float:
    """Measured matmul FLOP/s of `devices` together at `dtype` (cached per devices and dtype).

    Args:
      devices: the devices whose combined peak is wanted (e.g. one MFC's mesh).
      dtype: the workload's compute dtype.
      size: matrix side; default 2048 on CPU (a 1024 matmul is too short to reach the peak
        on a few cores), 8192 on accelerators.
      repeats: timed calls; the best counts.
    """
    ids = tuple(sorted(d.id for d in devices))
    return _probe(ids, jnp.dtype(dtype).name, size, repeats)


def machine_peak(dtype, *, again: bool = False, **kwargs) -> float:
    """The best of the all-device probe and the one-device probe (`again`: measured anew,
    not the cached figure; a benchmark probes before and after its runs and keeps the best).

    On the CPU backend, virtual devices share the host's cores, and one device's program
    already spreads a matmul over every core (intra-op threads); either probe can be the
    faster. The machine's peak is the better of the two, and every device subset's peak is
    bounded by it.
    """
    if again:
        _probe.cache_clear()
    devices = jax.devices()
    return max(matmul_peak(devices, dtype, **kwargs), matmul_peak(devices[:1], dtype, **kwargs))


def machine_probe(dtype, size: int | None = None) -> tuple[Callable[[], jax.Array], float]:
    """`probe_call` of the faster of the all-device and the one-device probe (best of three
    calls each; `machine_peak` says why either can win): the probe a benchmark times again
    beside its calls (`perf.rounds`)."""
    devices = jax.devices()
    probes = [probe_call(devices, dtype, size), probe_call(devices[:1], dtype, size)]
    return max(probes, key=lambda p: p[1] / _timed_best(p[0], repeats=3))
