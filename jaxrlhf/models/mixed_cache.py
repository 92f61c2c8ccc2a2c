"""The stacked KV cache of a model whose layers differ in their window (Gemma 3: five sliding
layers to one global), and the layer loop that decodes on it (`PeriodScan`).

Where a token loop keeps the cache stacked on a leading layer axis (the rollout engine's
stacked state: TPU, fsdp; `engine.decoding.decodes_layer_by_layer`), one [L, b, S, k, d]
array would hold every slot of every layer, the sliding layers' too. `MixedKVCache` holds two
stacks instead, each in model order: the sliding layers' rings [L_s, b, R, k, d],
R = min(S, window) (slot s at position s % R, `models.decode_kv`), and the global layers'
[L_g, b, S, k, d]. gemma3-4b (29 sliding layers of a 1,024-slot window, 5 global) at 32k
slots, bf16: 0.79 GB a row, where one stack of every slot took 4.56 GB (5.8 times).

A scan over the layers indexes its stack with a traced layer index, so its body must know
statically which of the two stacks a layer reads and writes. `PeriodScan` scans over periods
of the layer pattern instead (`period`: Gemma 3's 6 layers, 5 sliding then 1 global): its body
unrolls one period, whose layer j is of a static kind and writes index
i * (that kind's layers per period) + (j's rank among them) of its kind's stack, i the traced
period. The layers after the last whole period (gemma3-4b's 34 = 5 x 6 + 4) run after the
scan, indexed by the scan's count (traced, as in its body: by constants, XLA:TPU laid the
sliding stack out for their slices alone and copied it whole to that layout and back on every
token). Both stacks ride in the loop's carry: each layer writes its new slots into its stack
in place and reads its own slice of it, as the plain layer scan does with its one stack
(`transformer._write_cache`), and slices its weights out of the [L, ...] stacks as that scan
does. The rollout engine's token loop compiled for v5p (libtpu, d4; gemma3-4b bf16, one row
of 256 + 32,512 slots a chip; memory_analysis per chip): the cache 756 MiB where one stack
took 4,352; temporaries 158 MiB where the plain scan's took 75, and 158 again at 8k slots
(the scan's 11): constant in the slots, so no cache is copied (the extra, not traced down, is
less than one layer's weights, 180 MiB). A prefill runs many slots into each layer at once,
which a ring shorter than them cannot take: it fills a `MixedKVCache` whose sliding stack holds every slot
(`engine.decoding.fresh_cache`), whose rows' latest slots then go into the rings
(`engine.rollout.state.write_prompts`); `generate`'s static batch decodes on such a cache.
Given one stacked `KVCache` or none (as any `LayerStack`), the loop indexes it by the model
layer.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from jaxrlhf.models.config import ModelConfig
from jaxrlhf.models.transformer import KVCache, LayerFn, LayerInputs


def splits_cache(config: ModelConfig) -> bool:
    """Whether the stacked decode cache of `config` is a `MixedKVCache`: its layers differ in
    their window. A model with experts keeps one stack: it decodes on the plain layer scan,
    which records each token's experts (`engine.decoding.config_records_routes`)."""
    return config.layers_differ and config.moe is None


class MixedKVCache(NamedTuple):
    """The sliding layers' rings and the global layers' caches, each stacked in model order.

    Attributes:
      sliding: KVCache [L_s, b, R, k, d], R = min(S, window): layer `sliding_layers[i]`'s at i.
      full: KVCache [L_g, b, S, k, d]: the i-th global layer's at i.
    """

    sliding: KVCache
    full: KVCache

    @staticmethod
    def zeros(config: ModelConfig, batch: int, length: int, rings: bool = True
              ) -> "MixedKVCache":
        """Zeros of a cache of `length` slots S; without `rings` the sliding layers' hold every
        slot too (a prefill's, which writes many slots at once: `engine.decoding.prefill`)."""
        def stack(layers: int, slots: int) -> KVCache:
            shape = (layers, batch, slots, config.num_kv_heads, config.head_dim)
            return KVCache(jnp.zeros(shape, config.dtype), jnp.zeros(shape, config.dtype))
        sliding = len(config.sliding_layers)
        return MixedKVCache(stack(sliding, min(length, config.sliding_window) if rings else length),
                            stack(config.num_layers - sliding, length))

    @property
    def length(self) -> int:
        """S, the slots of the global layers' caches."""
        return self.full.k_lbskd.shape[2]

    def map(self, fn) -> "MixedKVCache":
        """`fn` applied to each of the four arrays."""
        return MixedKVCache(KVCache(*map(fn, self.sliding)), KVCache(*map(fn, self.full)))


def period(kinds: tuple[bool, ...]) -> int:
    """The shortest p whose pattern repeats through the layers (layer i's kind is layer
    i % p's): 6 for Gemma 3's five sliding layers to one global, `len(kinds)` where none
    shorter does."""
    return next(p for p in range(1, len(kinds) + 1)
                if all(kinds[i] == kinds[i % p] for i in range(len(kinds))))


@dataclasses.dataclass(frozen=True)
class PeriodScan:
    """A `LayerStack` that scans over periods of the layer pattern (module docstring): the
    stacked token loop of a model whose layers differ (`splits_cache`).

    Attributes:
      sliding: each model layer's kind (True: sliding), from `of`.
    """

    sliding: tuple[bool, ...]

    @staticmethod
    def of(config: ModelConfig) -> "PeriodScan":
        return PeriodScan(tuple(i in config.sliding_layers for i in range(config.num_layers)))

    def _stack_index(self, j: int, period_index: jax.Array) -> tuple[bool, jax.Array]:
        """(kind, index into its kind's stack) of layer j of period `period_index` (traced)."""
        kind = self.sliding[j]
        rank = sum(k == kind for k in self.sliding[:j])
        per_period = sum(k == kind for k in self.sliding[:period(self.sliding)])
        return kind, period_index * per_period + rank

    def __call__(self, layer_fn: LayerFn, params_l, x_btd: jax.Array, cache, inputs: LayerInputs,
                 cache_index, unroll: bool) -> tuple[jax.Array, Any]:
        """As `transformer.LayerStack`; `cache` a `MixedKVCache`, a stacked KVCache or None,
        returned updated in the form given."""
        p = period(self.sliding)
        whole = len(self.sliding) // p

        def run(x_btd, cache, layer, kind_index):
            params = jax.tree.map(
                lambda w: jax.lax.dynamic_index_in_dim(w, layer, keepdims=False), params_l)
            if not isinstance(cache, MixedKVCache):  # one stack, or none: the model layer
                return layer_fn(params, (x_btd, cache), layer, inputs, cache_index,
                                layer_id=layer)
            kind, index = kind_index
            stack = cache.sliding if kind else cache.full
            x_btd, stack = layer_fn(params, (x_btd, stack), index, inputs, cache_index,
                                    layer_id=layer)
            return x_btd, cache._replace(**{"sliding" if kind else "full": stack})

        def layers_of_period(x_btd, cache, i, count: int):
            """The first `count` layers of period i (traced)."""
            for j in range(count):
                x_btd, cache = run(x_btd, cache, i * p + j, self._stack_index(j, i))
            return x_btd, cache

        def body(carry, _):
            x_btd, cache, i = carry
            return (*layers_of_period(x_btd, cache, i, p), i + 1), None

        (x_btd, cache, i), _ = jax.lax.scan(body, (x_btd, cache, jnp.zeros((), jnp.int32)),
                                            length=whole, unroll=whole if unroll else 1)
        # The layers after the last whole period: indexed by the scan's count, traced (the
        # module docstring says why).
        return layers_of_period(x_btd, cache, i, len(self.sliding) - whole * p)
