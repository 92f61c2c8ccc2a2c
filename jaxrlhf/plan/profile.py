"""A model in numbers: parameter counts, per-device shard sizes, FLOPs and KV bytes per token.

A mixture-of-experts model (`ModelConfig.moe`) holds all E experts of every sparse layer (its
parameters, and so its optimizer state and gradients, count them all), but a token runs through
its router and top_k of them: its FLOPs and the rows of the experts' grouped matmuls follow k,
not E (`active_params`, `expert_matmul_params`).

Shard sizes come from the real parameter tree (`models.sizes.abstract_params`, evaluated
abstractly) and the real logical -> mesh rules (`jaxrlhf.parallel.rules.DEFAULT`), with the same
divisibility fallback as `parallel.layout.Layout.spec`: a dimension that the mesh axes do not
divide stays replicated. So the planner's parameter bytes per device are exactly what the
runtime allocates.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import flax.linen as nn
import jax
import numpy as np

from jaxrlhf.models import lora
from jaxrlhf.models.config import HeadKind, ModelConfig
from jaxrlhf.models.sizes import abstract_params, matmul_params
from jaxrlhf.models.transformer import decode_lengths
from jaxrlhf.parallel import rules as rule_presets


@dataclasses.dataclass(frozen=True)
class Leaf:
    """One parameter array: its shape, logical axis names and element size."""

    path: str
    shape: tuple[int, ...]
    names: tuple[str | None, ...]
    itemsize: int

    @property
    def size(self) -> int:
        return math.prod(self.shape)


def _leaves(config: ModelConfig) -> tuple[Leaf, ...]:
    is_box = lambda x: isinstance(x, nn.LogicallyPartitioned)
    found = []
    for path, box in jax.tree_util.tree_leaves_with_path(abstract_params(config), is_leaf=is_box):
        value, names = (box.value, box.names) if is_box(box) else (box, (None,) * box.ndim)
        found.append(Leaf(jax.tree_util.keystr(path), tuple(value.shape), tuple(names),
                          np.dtype(value.dtype).itemsize))
    return tuple(found)


@dataclasses.dataclass(frozen=True)
class ModelProfile:
    """Derived sizes of one ModelConfig (build with `profile_of`, which caches)."""

    config: ModelConfig
    leaves: tuple[Leaf, ...]

    @functools.cached_property
    def num_params(self) -> int:
        return sum(leaf.size for leaf in self.leaves)

    @functools.cached_property
    def param_bytes(self) -> int:
        return sum(leaf.size * leaf.itemsize for leaf in self.leaves)

    @property
    def param_itemsize(self) -> int:
        return np.dtype(self.config.param_dtype).itemsize

    @property
    def act_itemsize(self) -> int:
        return np.dtype(self.config.dtype).itemsize

    @functools.cached_property
    def matmul_params(self) -> int:
        """Parameters that take part in a matmul per token: all but the embedding lookup table
        (a gather) and the norm scales; the tied LM head counts once as a matmul."""
        return matmul_params(self.config)

    @functools.cached_property
    def active_params(self) -> int:
        """Parameters one token uses: all of them but the experts its router does not choose,
        (E - top_k) per sparse layer (Qwen3-30B-A3B: 3.35B of 30.5B; Mixtral 8x7B: 12.9B of
        46.7B)."""
        m = self.config.moe
        if m is None:
            return self.num_params
        sparse = len(m.sparse_layers(self.config.num_layers))
        return self.num_params - sparse * (m.num_experts - m.top_k) * self._expert_size

    @property
    def _expert_size(self) -> int:
        """Elements of one expert: gate and up [D, F], down [F, D]."""
        return 3 * self.config.hidden_size * self.config.moe.expert_intermediate_size

    @functools.cached_property
    def expert_matmul_params(self) -> int:
        """Of `matmul_params`, those of the sparse blocks a token runs: the router [D, E] and
        its top_k experts, over the sparse layers; 0 for a dense model."""
        m = self.config.moe
        if m is None:
            return 0
        sparse = len(m.sparse_layers(self.config.num_layers))
        return sparse * (self.config.hidden_size * m.num_experts + m.top_k * self._expert_size)

    @functools.cached_property
    def router_params(self) -> int:
        """Of `expert_matmul_params`, the routers' [D, E] of the sparse layers."""
        m = self.config.moe
        if m is None:
            return 0
        return len(m.sparse_layers(self.config.num_layers)) * self.config.hidden_size * (
            m.num_experts)

    def expert_tensor_ways(self, tensor: int) -> int:
        """How many ways the tensor axis cuts each expert's weights (the "expert_mlp" rule:
        t, their width F split as a dense MLP's; 1 where t does not divide F, and every
        tensor rank then runs whole experts over the same tokens); 1 for a dense model."""
        experts = [leaf for leaf in self.leaves if _is_expert(leaf)]
        if not experts:
            return 1
        return self._ways(experts[0], {"tensor": tensor})

    def expert_shard_bytes(self, tensor: int, fsdp: int, pipeline: int = 1,
                           expert: int = 1) -> int:
        """Of `shard_bytes`, the experts' weights (gate, up and down of every sparse layer)."""
        key = ("experts", tensor, fsdp, pipeline, expert)
        if key not in self._shards:
            experts = [leaf for leaf in self.leaves if _is_expert(leaf)]
            self._shards[key] = self._count_shard(tensor, fsdp, pipeline, expert, experts)
        return self._shards[key][1]

    @property
    def attn_dim(self) -> int:
        return self.config.num_heads * self.config.head_dim

    @property
    def kv_dim(self) -> int:
        return self.config.num_kv_heads * self.config.head_dim

    @property
    def out_dim(self) -> int:
        """Width of the head's output: the vocabulary, or 1 for a scalar head."""
        return self.config.vocab_size if self.config.head is HeadKind.LM else 1

    def forward_flops_per_token(self, context: int) -> float:
        """Matmul FLOPs of one token's forward pass attending over `context` slots.

        The runtime's attention is two dense einsums over every slot (a causal or padding mask
        zeroes scores but skips no work), so all `context` slots count, not context/2.
        """
        attention = 2 * 2 * self.config.num_layers * self.attn_dim * context  # QK^T and PV
        return 2.0 * self.matmul_params + attention

    def kv_bytes_per_token(self) -> int:
        """Keys and values of one token, all layers (cache dtype = compute dtype)."""
        return 2 * self.config.num_layers * self.kv_dim * self.act_itemsize

    def kv_cache_bytes(self, slots: int, windowed: bool) -> int:
        """Keys and values of one row's cache of `slots` slots, all layers; `windowed`: a
        sliding layer's holds at most its window, a ring (`transformer.decode_lengths`: the
        rollout engine's state), else every slot."""
        layer_slots = (decode_lengths(self.config, slots) if windowed
                       else (slots,) * self.config.num_layers)
        return 2 * sum(layer_slots) * self.kv_dim * self.act_itemsize

    def shard_elements(self, tensor: int, fsdp: int, pipeline: int = 1, expert: int = 1) -> int:
        """Parameter elements one device holds under tensor × fsdp (× pipeline × expert: the
        experts' E dimension) sharding (data replicates)."""
        return self._shard(tensor, fsdp, pipeline, expert)[0]

    def shard_bytes(self, tensor: int, fsdp: int, pipeline: int = 1, expert: int = 1) -> int:
        """Parameter bytes one device holds under tensor × fsdp (× pipeline × expert)
        sharding."""
        return self._shard(tensor, fsdp, pipeline, expert)[1]

    def trained_shard_elements(self, tensor: int, fsdp: int, pipeline: int = 1,
                               expert: int = 1) -> int:
        """Elements per device of the parameters a train step updates, which alone have
        gradients and optimizer state: every parameter, or with LoRA the adapters."""
        if self.config.lora is None:
            return self.shard_elements(tensor, fsdp, pipeline, expert)
        key = ("trained", tensor, fsdp, pipeline, expert)
        if key not in self._shards:
            adapters = [leaf for leaf in self.leaves if leaf.path.endswith(_ADAPTER_PATHS)]
            self._shards[key] = self._count_shard(tensor, fsdp, pipeline, expert, adapters)
        return self._shards[key][0]

    def layer_shard_bytes(self, tensor: int) -> int:
        """Bytes of one decoder layer's parameters after an fsdp all-gather (tensor-sharded)."""
        key = ("layer", tensor)
        if key not in self._shards:
            layers = [leaf for leaf in self.leaves if _is_layer(leaf)]
            sizes = {"data": 1, "fsdp": 1, "tensor": tensor, "pipeline": 1, "expert": 1}
            total = sum(leaf.size * leaf.itemsize // self._ways(leaf, sizes) for leaf in layers)
            self._shards[key] = (0, total // self.config.num_layers)
        return self._shards[key][1]

    def largest_layer_leaf_bytes(self, tensor: int, fsdp: int, pipeline: int = 1,
                                 expert: int = 1) -> int:
        """Bytes per device of the largest leaf of the stacked decoder layers (a dense MLP's
        projection stack [L, D, I] as the layout shards it; 0 without a stack)."""
        key = ("largest layer leaf", tensor, fsdp, pipeline, expert)
        if key not in self._shards:
            sizes = [self._count_shard(tensor, fsdp, pipeline, expert, [leaf])[1]
                     for leaf in self.leaves if _is_layer(leaf)]
            self._shards[key] = (0, max(sizes, default=0))
        return self._shards[key][1]

    @functools.cached_property
    def _shards(self) -> dict[tuple[int, ...], tuple[int, int]]:
        return {}

    def leaf_shard_bytes(self, tensor: int, fsdp: int, pipeline: int = 1,
                         expert: int = 1) -> tuple[int, ...]:
        """Bytes one device holds of each leaf, in `leaves` order (`shard_bytes` leaf by leaf)."""
        key = ("by leaf", tensor, fsdp, pipeline, expert)
        if key not in self._shards:
            self._shards[key] = (0, tuple(self._count_shard(tensor, fsdp, pipeline, expert,
                                                            [leaf])[1] for leaf in self.leaves))
        return self._shards[key][1]

    def _shard(self, tensor: int, fsdp: int, pipeline: int, expert: int) -> tuple[int, int]:
        """(elements, bytes) per device; memoised per instance (the search asks millions)."""
        key = (tensor, fsdp, pipeline, expert)
        if key not in self._shards:
            self._shards[key] = self._count_shard(tensor, fsdp, pipeline, expert)
        return self._shards[key]

    def _count_shard(self, tensor: int, fsdp: int, pipeline: int, expert: int = 1,
                     leaves: list[Leaf] | None = None) -> tuple[int, int]:
        """Of `leaves` (default: all). A pipeline stage holds its share of the stacked layers; the embedding, final norm
        and head stay whole on every stage (the SPMD pipeline replicates what is not stacked),
        which is the worst device of ReaL's layout too (stage 0 holds the embedding, the last
        the head)."""
        sizes = {"data": 1, "fsdp": fsdp, "tensor": tensor, "pipeline": pipeline,
                 "expert": expert}
        elements = nbytes = 0
        for leaf in self.leaves if leaves is None else leaves:
            ways = self._ways(leaf, sizes)
            if pipeline > 1 and _is_layer(leaf) and not self._pipelined_by_rules(leaf, sizes):
                ways *= pipeline  # the rules predate the pipeline axis: stages split the stack
            n = leaf.size // ways
            elements += n
            nbytes += n * leaf.itemsize
        return elements, nbytes

    @staticmethod
    def _rule_of() -> dict:
        return dict(reversed(rule_presets.DEFAULT))  # first rule for a name wins

    @classmethod
    def _pipelined_by_rules(cls, leaf: Leaf, sizes: dict[str, int]) -> bool:
        target = cls._rule_of().get(leaf.names[0])
        return "pipeline" in rule_presets.mesh_axes_of(target)

    @classmethod
    def _ways(cls, leaf: Leaf, sizes: dict[str, int]) -> int:
        """How many shards a leaf is cut into; mirrors `Layout.spec(shape=...)`."""
        rule_of = cls._rule_of()
        ways = 1
        for dim, name in zip(leaf.shape, leaf.names):
            axes = () if name is None else rule_presets.mesh_axes_of(rule_of.get(name))
            n = math.prod(sizes.get(a, 1) for a in axes)
            if n > 1 and dim % n == 0:
                ways *= n
        return ways


_ADAPTER_PATHS = tuple(f"['{name}']" for name in lora.ADAPTER_NAMES)  # Leaf.path endings


def _is_expert(leaf: Leaf) -> bool:
    """An experts' projection stack of a sparse block (logical axes ..., "experts", ...)."""
    return "experts" in leaf.names


def _is_layer(leaf: Leaf) -> bool:
    """A leaf of the scanned decoder-layer stack (its leading axis is `layers`)."""
    return bool(leaf.names) and leaf.names[0] == "layers"


@functools.lru_cache(maxsize=None)
def profile_of(config: ModelConfig) -> ModelProfile:
    """The (cached) profile of a model config."""
    return ModelProfile(config, _leaves(config))
