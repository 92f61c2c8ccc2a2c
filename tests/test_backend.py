"""Process-level backend settings (`jaxrlhf.backend`): the host allocator keeps what XLA frees."""

import resource
import sys

import jax
import jax.numpy as jnp
import pytest

from jaxrlhf import backend


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_runs_of_an_executable_reuse_its_freed_buffers():
    """A program with a 128 MiB intermediate, run again and again: once the heap holds the runs'
    buffers, most runs page in nothing new (small allocations that split a freed buffer make
    the heap grow again now and then: 4 to 9 of 12 runs paged in nothing, in 3 tries). glibc's
    default (what `use_cpu_devices` had left) mapped that buffer afresh every run: 32,768 page
    faults each."""
    # conftest's use_cpu_devices made the setting before JAX started its threads (an arena a
    # thread already has stays its own); made again here, it must still take.
    assert backend.keep_freed_host_memory()
    x, w = jnp.ones((8192, 8)), jnp.ones((8, 4096))
    run = jax.jit(lambda x, w, w2: (x @ w) @ w2)  # x @ w: [8192, 4096] f32, 128 MiB
    args = (x, w, jnp.ones((4096, 16)))
    faults = []
    for _ in range(16):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        jax.block_until_ready(run(*args))
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    pages = 8192 * 4096 * 4 // resource.getpagesize()
    assert sum(f < pages // 100 for f in faults[4:]) >= 3, faults
