"""The base of every engine call kind: one jitted function on one layout, compiled per bucket.

`Generator`, `InferenceFn` and `TrainStep` differ in what they compute and how they pad their
inputs to a bucket; what they share lives here: the layout, the `CompileCache` that compiles
each (shape bucket) key once and counts it, and lowering under the layout's activation context
(so the model's logical sharding constraints resolve against this layout's mesh).
"""

from __future__ import annotations

from collections.abc import Hashable

import jax

from jaxrlhf.engine.buckets import CompileCache
from jaxrlhf.parallel.layout import Layout


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
