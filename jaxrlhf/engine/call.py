"""The base of every engine call kind: one jitted function on one layout, compiled per bucket.

`Generator`, `InferenceFn` and `TrainStep` differ in what they compute and how they pad their
inputs to a bucket; what they share lives here: the layout, the `CompileCache` that compiles
each (shape bucket) key once and counts it, and lowering under the layout's activation context
(so the model's logical sharding constraints resolve against this layout's mesh).

Every call kind can also be lowered without running: `lower_for` takes host arrays of a batch
and abstract parameters (`abstract`) and returns the lowered programs the call would compile
for that batch. That is how `python -m jaxrlhf.plan --compile` compiles a plan for devices this
process only has a description of (a TPU slice, a GPU cluster): nothing is placed on them.
"""

from __future__ import annotations

from collections.abc import Hashable

import jax
import numpy as np

from jaxrlhf.engine.buckets import CompileCache
from jaxrlhf.parallel.layout import Layout


def abstract(tree, shardings):
    """`tree`'s leaves (arrays, host arrays, or abstract values) as `jax.ShapeDtypeStruct`s
    placed as `shardings` (a matching tree) says: arguments to lower a call with, for devices
    nothing is written to."""
    return jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=s), tree, shardings)


class BucketedCall:
    """One call kind of one model on one layout; subclasses implement `_jit_for` and `__call__`.

    Attributes:
      layout: where the call runs.
      compile_cache: the executables compiled so far, one per shape key.
    """

    def __init__(self, name: str, layout: Layout):
        self.layout = layout
        self.compile_cache = CompileCache(name)

    @property
    def compiles(self) -> int:
        """Executables compiled so far (principle 6: recompiles are counted)."""
        return self.compile_cache.compiles

    def _jit_for(self, *args) -> jax.stages.Wrapped:
        """The jitted function for these (example) arguments."""
        raise NotImplementedError

    def _lower(self, *args) -> jax.stages.Lowered:
        with self.layout.activation_context():
            return self._jit_for(*args).lower(*args)

    def _executable(self, key: Hashable, *args) -> jax.stages.Compiled:
        """The executable for shape key `key`, compiled from `args` on first use."""
        return self.compile_cache.get(key, lambda: self._lower(*args))
