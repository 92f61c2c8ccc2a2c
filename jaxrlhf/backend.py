"""Process-level backend settings that must be made before JAX starts a backend."""

import ctypes
import os
import pathlib
import re
import sys

from jaxrlhf.kernels.native import host_folder

# XLA:CPU aborts the process when one virtual device's thread reaches a collective more than
# 40 s (its default) after the others. On an oversubscribed host (8 virtual devices on 2 busy
# cores) that is load, not a deadlock: the test suite lost a worker to it in this session's
# CI run. Still a deadline, only a longer one; cross-process waits have their own.
COLLECTIVE_TERMINATE_S = 600


def _add_flag(name: str, value) -> None:
    """Appends --name=value to XLA_FLAGS unless the user set that flag already."""
    flags = os.environ.get("XLA_FLAGS", "")
    if name not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --{name}={value}".strip()


def use_cpu_devices(count: int) -> None:
    """Gives the CPU backend `count` virtual devices (no effect on GPU/TPU devices), its
    client two threads per device (`cpu_client_threads`: with one, programs deadlock) and a
    host allocator that keeps freed memory for the next run (`keep_freed_host_memory`).

    XLA reads the flags when the CPU backend starts, so entry points call this first; an
    XLA_FLAGS value or a thread count the user set explicitly wins.
    """
    _add_flag("xla_force_host_platform_device_count", count)
    _add_flag("xla_cpu_collective_call_terminate_timeout_seconds", COLLECTIVE_TERMINATE_S)
    give_cpu_client_threads()
    keep_freed_host_memory()


ENV_CACHE_DIR = "JAX_COMPILATION_CACHE_DIR"  # JAX's own: the directory, where a user set it
ENV_CACHE_MIN_SECONDS = "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"
# Executables that compiled faster than this are not written to the cache. JAX's default (1 s)
# keeps a set that depends on the load: of the main job's 123 executables on 2 busy cores it
# kept 10 to 15 in three runs (cold and warm), and a restart then reached its first PPO step
# in 31-36 s, against 21-31 s with all 123 kept (`benchmarks/restart_compiles.py`, alternated
# rounds). Kept whole, the set is the program's: a restart compiles nothing.
CACHE_MIN_COMPILE_SECONDS = 0.0
# JAX's monitoring events of its compilation cache: a compile that asked it, one it answered
# (loaded), one it did not (the executable compiled and written).
CACHE_REQUEST_EVENT = "/jax/compilation_cache/compile_requests_use_cache"
CACHE_HIT_EVENT = "/jax/compilation_cache/cache_hits"
CACHE_WRITE_EVENT = "/jax/compilation_cache/cache_misses"


def use_compilation_cache(cache_dir: pathlib.Path | None) -> pathlib.Path | None:
    """Makes JAX keep every executable it compiles in `cache_dir` (its persistent compilation
    cache) and load it from there when a later process compiles the same program: a rerun or
    a restart after preemption compiles only what it has not compiled before. None: off.
    Returns the directory in use.

    Executables go to a folder of `cache_dir` named for this host's instruction set
    (`kernels.native.host_folder`: readable by its owner only), which must take files. A
    JAX_COMPILATION_CACHE_DIR the user set in the environment wins, as an XLA_FLAGS value does
    (a launcher's shared cache, the test suite's own). Takes effect at the next compile: JAX
    decides at a process's first compile whether it uses a cache, so its cache is reset (a
    notebook may have compiled before).

    Raises:
      OSError: the directory cannot be made or written to.
    """
    import jax
    from jax.experimental.compilation_cache import compilation_cache

    if os.environ.get(ENV_CACHE_DIR):
        return pathlib.Path(os.environ[ENV_CACHE_DIR])
    if cache_dir is not None:
        cache_dir = host_folder(cache_dir)
        if not os.access(cache_dir, os.W_OK | os.X_OK):
            raise PermissionError(f"{cache_dir}: not writable")
    if ENV_CACHE_MIN_SECONDS not in os.environ:
        jax.config.update("jax_persistent_cache_min_compile_time_secs", CACHE_MIN_COMPILE_SECONDS)
    jax.config.update("jax_compilation_cache_dir", None if cache_dir is None else str(cache_dir))
    compilation_cache.reset_cache()
    return cache_dir


# glibc's mallopt parameters (malloc.h).
_M_TRIM_THRESHOLD, _M_MMAP_MAX, _M_ARENA_MAX = -1, -4, -8


def keep_freed_host_memory() -> bool:
    """Makes glibc's malloc keep the memory a program frees for the next one (Linux; unless
    GLIBC_TUNABLES sets malloc tunables). Returns whether it did.

    XLA:CPU allocates each run's buffers with malloc (W-cpu's train step: 0.8 GB in one block).
    glibc serves a block that large with a fresh mmap (above 32 MiB always, and from a worker
    thread's arena whatever the threshold) and unmaps it when freed, so every run paged its
    buffers in anew: 200,000 zeroed-page faults per W-cpu train step, 14% of its CPU seconds
    (11% of a ref inference's) spent in the kernel. One arena (every thread allocates from the
    main heap), no mmap and no trimming of the heap's top keep those pages mapped and reused;
    the process then holds its peak instead of giving it back between runs. The cost is host
    memory: small allocations that split a freed block now and then make the heap grow by
    another block (W-cpu d1, train step and ref inference alternated: one regrowth in 14
    steps, RSS 1.6 -> 2.5 GB at the 6th, then flat; glibc's default peaked at 1.8 GB). Made
    before JAX starts its threads: an arena a thread already has stays its own.
    """
    if not sys.platform.startswith("linux") or "glibc.malloc" in os.environ.get(
            "GLIBC_TUNABLES", ""):
        return False
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):  # not glibc
        return False
    return all(mallopt(param, value) == 1 for param, value in (
        (_M_ARENA_MAX, 1), (_M_MMAP_MAX, 0), (_M_TRIM_THRESHOLD, 2**31 - 1)))


ENV_CPU_CLIENT_THREADS = "PJRT_NPROC"  # read by XLA:CPU when the client starts


def cpu_client_threads(local_devices: int, cores: int) -> int:
    """Threads for the XLA:CPU client of a process that holds `local_devices` devices.

    XLA:CPU sizes its client pool max(cores, local devices): just enough for one program's
    parts on every local device at once, which its scheduler counts on (one multi-device
    program runs at a time, each part blocking a thread until its collectives complete).
    But launching a program on a device that already has 32 computations in flight
    (`max_inflight_computations`, a pacing limit) blocks a pool thread until one of them
    finishes, and they need pool threads to run. Seen in the 2-process test (4 devices per
    process on 2 busy cores, the host dispatching far ahead of its devices), gdb of process 1:
    3 pool threads ran 3 parts of a program, waiting in a gloo all-reduce for the 4th part,
    the 4th thread waited in `Semaphore::ScopedAcquire` launching the next program on a full
    device, and the main thread waited in `Execute` for that launch, so nothing ran again;
    process 0 waited for process 1 at the next cross-process transfer (`reshard._cross`)
    until the socket closed. One more thread per device is room for the launches that one
    dispatch can block while a program on every local device runs (XLA sizes its intra-op
    pool from the same number). One process deadlocks the same way: the main job (ppo_tiny, 8
    devices, two copies at once on 2 cores as the test suite runs it) hung in 1 run of 14, gdb:
    6 pool threads in an in-process AllReduce rendezvous, the other 2 in
    `Semaphore::ScopedAcquire` launching the next program, the main thread in BlockUntilReady.
    """
    return max(cores, 2 * local_devices)


def give_cpu_client_threads() -> None:
    """Sets the client's pool size (PJRT_NPROC) from XLA_FLAGS' device count unless the user
    did (PJRT_NPROC or NPROC): `use_cpu_devices` and `distributed.initialize` call it."""
    if os.environ.get(ENV_CPU_CLIENT_THREADS) or os.environ.get("NPROC"):
        return
    match = re.search(r"--xla_force_host_platform_device_count=(\d+)",
                      os.environ.get("XLA_FLAGS", ""))
    local_devices = int(match.group(1)) if match else 1
    os.environ[ENV_CPU_CLIENT_THREADS] = str(
        cpu_client_threads(local_devices, len(os.sched_getaffinity(0))))

