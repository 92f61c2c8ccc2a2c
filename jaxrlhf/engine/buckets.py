"""Static-shape bucketing and compile accounting shared by every call kind.

XLA compiles one executable per input shape, so variable lengths are rounded up to a small set
of bucket lengths and the batch is padded to them. Each call kind keeps one `CompileCache`: the
ahead-of-time compiled executable per (shape key, layout), so that a recompile happens only when
the bucket or the layout changes, and every compile is counted (principle 6: recompiles are
counted and reported).
"""

from __future__ import annotations

import bisect
import dataclasses
import time
import weakref
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


def power_of_two_buckets(max_len: int, min_len: int = 16) -> tuple[int, ...]:
    """min_len * 2^k below `max_len`, then `max_len` itself: (16, 32, 64, 100) for 100."""
    if min_len < 1 or max_len < 1:
        raise ValueError(f"bucket bounds must be positive, got min={min_len} max={max_len}")
    buckets = [min(min_len, max_len)]
    while buckets[-1] * 2 < max_len:
        buckets.append(buckets[-1] * 2)
    if buckets[-1] < max_len:
        buckets.append(max_len)
    return tuple(buckets)


def response_widths(max_new_tokens: int, count: int = 8) -> tuple[int, ...]:
    """The widths a generated batch's response part is cut to (the first one its longest
    response fits): `count` equal steps up to `max_new_tokens`, each a multiple of 8, so the
    calls after generation compile for at most `count` shapes. (16, 32, ..., 128) for 128;
    (8,) for 8.

    Why: every later call of the step (inference, train steps) computes on all P + N columns;
    with long-tailed response lengths most of them are padding.
    """
    step = -(-max_new_tokens // count)
    step = -(-step // 8) * 8
    return tuple(range(step, max_new_tokens, step)) + (max_new_tokens,)


def bucket_length(n: int, buckets: Sequence[int]) -> int:
    """The smallest bucket >= n.

    Args:
      n: the actual length (>= 0).
      buckets: sorted ascending bucket lengths.

    Raises:
      ValueError: if n exceeds the largest bucket.
    """
    i = bisect.bisect_left(buckets, n)
    if i == len(buckets):
        raise ValueError(f"length {n} exceeds the largest bucket {buckets[-1]}")
    return buckets[i]


def pad_axis(x: np.ndarray | jax.Array, length: int, *, axis: int, value: Any = 0,
             left: bool = False):
    """Pads `x` along `axis` to `length` with `value` (on the left when `left`).

    Works on numpy (host-side batch building) and on jax arrays (inside jit).
    """
    extra = length - x.shape[axis]
    if extra < 0:
        raise ValueError(f"axis {axis} has size {x.shape[axis]} > target {length}")
    if extra == 0:  # already a bucket: no op, and no scalar upload for a device array
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (extra, 0) if left else (0, extra)
    xp = np if isinstance(x, np.ndarray) else jnp
    return xp.pad(x, widths, constant_values=value)


def shape_key(tree) -> tuple:
    """A hashable key of a pytree's structure, leaf shapes and dtypes."""
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    return (treedef, tuple((tuple(np.shape(x)), str(jnp.result_type(x))) for x in leaves))


@dataclasses.dataclass(eq=False)  # identity hash: lives in a WeakSet
class CompileCache:
    """Compiled executables of one call kind, keyed by (shape bucket, layout).

    `get(key, lower)` returns the cached executable for `key` or calls `lower()` (which must
    return a `jax.stages.Lowered`), compiles it, and counts the compile and its wall time.

    Attributes:
      name: the call kind, for reports ("generate", "inference/logprobs", ...).
      compiles: number of executables compiled so far.
      compile_seconds: total wall time spent lowering + compiling.
    """

    name: str
    compiles: int = 0
    compile_seconds: float = 0.0
    _executables: dict = dataclasses.field(default_factory=dict, repr=False)

    def __post_init__(self):
        _LIVE_CACHES.add(self)

    def get(self, key: Hashable, lower: Callable[[], jax.stages.Lowered]) -> jax.stages.Compiled:
        executable = self._executables.get(key)
        if executable is None:
            start = time.perf_counter()
            executable = lower().compile()
            self.compile_seconds += time.perf_counter() - start
            self.compiles += 1
            self._executables[key] = executable
        return executable

    def __len__(self) -> int:
        return len(self._executables)

    def executables(self) -> list[jax.stages.Compiled]:
        """The executables compiled so far, in compile order (e.g. for `memory_analysis()`)."""
        return list(self._executables.values())


# Weak, so that dropping a call kind also frees its executables.
_LIVE_CACHES: weakref.WeakSet[CompileCache] = weakref.WeakSet()


def compile_report() -> dict[str, dict[str, float]]:
    """{cache name: {"compiles": n, "seconds": s}} summed over the live CompileCaches."""
    report: dict[str, dict[str, float]] = {}
    for cache in list(_LIVE_CACHES):
        entry = report.setdefault(cache.name, {"compiles": 0, "seconds": 0.0})
        entry["compiles"] += cache.compiles
        entry["seconds"] += cache.compile_seconds
    return report
