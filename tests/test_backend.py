"""Process-level backend settings (`jaxrlhf.backend`): the host allocator keeps what XLA frees."""

import pathlib
import resource
import subprocess
import sys

import pytest

from jaxrlhf import backend

REPO = pathlib.Path(__file__).resolve().parent.parent


_RUNS = """
import resource, sys
from jaxrlhf.backend import use_cpu_devices
use_cpu_devices(1)
import jax, jax.numpy as jnp
x, w = jnp.ones((8192, 8)), jnp.ones((8, 4096))
run = jax.jit(lambda x, w, w2: (x @ w) @ w2)  # x @ w: [8192, 4096] f32, 128 MiB
args = (x, w, jnp.ones((4096, 16)))
for _ in range(16):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    jax.block_until_ready(run(*args))
    print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_runs_of_an_executable_reuse_its_freed_buffers():
    """A program with a 128 MiB intermediate, run again and again: once the heap holds the runs'
    buffers, most runs page in nothing new (small allocations that split a freed buffer make
    the heap grow again now and then: 4 to 9 of 12 runs paged in nothing, in 3 tries). glibc's
    default (what `use_cpu_devices` had left) mapped that buffer afresh every run: 32,768 page
    faults each. A fresh process, as an entry point starts: `use_cpu_devices` makes the setting
    before JAX starts its threads (an arena a thread already has stays its own), and the heap
    holds no earlier test's allocations."""
    assert backend.keep_freed_host_memory()  # made again in a running process, it still takes
    out = subprocess.run([sys.executable, "-c", _RUNS], capture_output=True, text=True,
                         timeout=120, cwd=REPO, check=True).stdout.split()
    faults = [int(f) for f in out]
    pages = 8192 * 4096 * 4 // resource.getpagesize()
    assert sum(f < pages // 100 for f in faults[4:]) >= 3, faults
