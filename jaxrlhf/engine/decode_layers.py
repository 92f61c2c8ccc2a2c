"""The decoder layers one by one, each on its own parameters and its own KV cache: the layer
stack of a token loop on XLA:CPU (`engine.generate.decode_model`).

The scanned stack keeps every layer's weights and cache stacked on a leading [L, ...] axis and
slices layer l out of the stacks in each of its iterations. Inside a token loop those slices
run once per token and layer, and XLA:CPU copies each of them: a dot cannot read a dynamic
slice in place, so every token copied all the weights once more (as many bytes as the dots
read), and each layer's keys and values once or twice more (transposed for the attention
dots). W-cpu's generation (d4t2) spent about 40% of its op time in these copies.

Here the weights are sliced out once, before the token loop (`split_params`; the loop then
only reads them), the cache is cut into one `DecodeKV` per layer (keys in tiles of slots, values [b, k, S, d];
`models.decode_kv`, `split_cache`), and the layers are unrolled (`LayerByLayer`): layer l
writes its new keys and values into its own cache in place and attends over it as it lies
(`attention.cached_query_attention`: two batched matrix products whose operands XLA:CPU's dots
read in place).

W-cpu generation, scanned -> layer by layer (same tokens, log-probs within 1e-6): d4t2 0.75 ->
0.63 s, d2t2 0.69 -> 0.66 s (`benchmarks/engine_calls.py --calls=generate --layouts=0-7:d4t2,
0-3:d2t2`, medians of 3 runs alternating old and new code, load 3); d1 0.99 -> 0.84 s. The
price: one more copy of the layer weights per device during a generate call (counted by
`plan.memory` on XLA:CPU clusters).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from jaxrlhf.models.decode_kv import DecodeKV
from jaxrlhf.models.transformer import KVCache, LayerFn, LayerInputs


def split_layers(layers) -> tuple:
    """Each layer's own parameter tree, sliced out of the [L, ...] stacks (as is if split)."""
    if isinstance(layers, tuple):
        return layers
    num_layers = jax.tree.leaves(layers)[0].shape[0]
    return tuple(jax.tree.map(lambda p, i=i: p[i], layers) for i in range(num_layers))


def split_params(params) -> dict:
    """The model's parameters with "layers" split (`split_layers`) once, before a token loop:
    what `LayerByLayer` runs fastest on."""
    return {**params, "layers": split_layers(params["layers"])}


def split_cache(cache: KVCache) -> tuple[DecodeKV, ...]:
    """One `DecodeKV` per layer, from the stacked [L, b, S, k, d] cache: one transposing copy,
    before a token loop."""
    return tuple(DecodeKV.from_stacked(k, v) for k, v in zip(cache.k_lbskd, cache.v_lbskd))


def layer_caches(cache: KVCache) -> tuple[KVCache, ...]:
    """One [1, b, S, k, d] `KVCache` per layer, from the stacked cache: the layout every
    attention implementation reads (cuDNN, the Pallas kernels), where `split_cache`'s tiles are
    XLA's. Each layer writes its slot of its own array in place and attends over it whole."""
    return tuple(KVCache(cache.k_lbskd[i:i + 1], cache.v_lbskd[i:i + 1])
                 for i in range(cache.k_lbskd.shape[0]))


_SEGMENTS = 4
# Shorter segments save less attention than their loops (one more each) cost to compile: the
# main job (8 new tokens) took 1-1.6 s longer with 4 segments of 2 tokens.
_MIN_SEGMENT = 16


def segment_ends(n_new: int) -> tuple[int, ...]:
    """Response lengths at which the token loop's caches grow: `_SEGMENTS` equal parts of
    `n_new`, fewer where parts would be shorter than `_MIN_SEGMENT` tokens.

    Why: a one-token step attends over its whole cache array (a static shape), written or not.
    With the cache cut to the prompt plus the current segment's end, a step reads on average
    P + 5/8 N slots instead of P + N; each growth is one copy of the caches. W-cpu at d2
    (P 32, N 64): the attention multiply-reduces were about 35% of the decode op time.
    """
    count = max(1, min(_SEGMENTS, n_new // _MIN_SEGMENT))
    size = -(-n_new // count)
    return tuple(range(size, n_new, size)) + (n_new,)


def grow_cache(caches: tuple[DecodeKV, ...], length: int) -> tuple[DecodeKV, ...]:
    """Each layer's cache zero-padded to `length` slots."""
    return tuple(c.resized(length) for c in caches)


def stack_cache(caches: tuple[DecodeKV, ...] | tuple[KVCache, ...]) -> KVCache:
    """The stacked [L, b, S, k, d] KVCache of per-layer ones (`split_cache` or `layer_caches`
    undone)."""
    if isinstance(caches[0], KVCache):
        return KVCache(*(jnp.concatenate(parts) for parts in zip(*caches)))
    keys, values = zip(*(c.stacked() for c in caches))
    return KVCache(jnp.stack(keys), jnp.stack(values))


@dataclasses.dataclass(frozen=True)
class LayerByLayer:
    """A `LayerStack` that runs the layers unrolled, in order.

    Takes the parameters stacked (the model's own tree) or split (`split_params`), and the
    cache stacked (layer l writes index l of it; prefill) or split (`split_cache` or
    `layer_caches`; each layer writes and reads its own array; the token loop), and returns the
    cache in the form it was given.
    """

    def __call__(self, layer_fn: LayerFn, params_l, x_btd: jax.Array, cache, inputs: LayerInputs,
                 cache_index, unroll: bool) -> tuple[jax.Array, Any]:
        params_l = split_layers(params_l)
        if isinstance(cache, tuple) and not isinstance(cache, KVCache):  # split per layer
            # A DecodeKV is the layer's alone (no index); a [1, ...] KVCache is index 0 of its own.
            index = None if isinstance(cache[0], DecodeKV) else 0
            caches = []
            for layer, (params, layer_cache) in enumerate(zip(params_l, cache, strict=True)):
                x_btd, layer_cache = layer_fn(params, (x_btd, layer_cache), index, inputs,
                                              cache_index, layer_id=layer)
                caches.append(layer_cache)
            return x_btd, tuple(caches)
        for layer, params in enumerate(params_l):
            x_btd, cache = layer_fn(params, (x_btd, cache), layer, inputs, cache_index)
        return x_btd, cache
