"""A layout: devices + mesh shape + logical axis rules, and sharded parameter init.

`make_layout("0-3:d2t2", model=cfg)` builds a `Layout` whose mesh has axes
("pipeline", "data", "fsdp", "expert", "tensor") over devices 0..3. Everything that shards an array (parameters,
batches, activations inside jit) asks the layout, so one object answers "where does this live".

Divisibility: a logical dimension is only sharded over mesh axes whose total size divides it;
otherwise that dimension is replicated. XLA could pad uneven shards, but padded parameter shards
break bitwise resharding, waste memory on every device and make the memory model lie, so a
replicated dimension is the honest fallback (e.g. a 272-entry vocabulary on t8 = 34 per shard is
fine, but hidden 64 on f128 would replicate). Attention heads are the exception: a t that does
not divide the head counts is an error (`Strategy.check_model`), because the attention reshape
needs whole heads per shard.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxrlhf.models.config import ModelConfig
from jaxrlhf.parallel import submesh
from jaxrlhf.parallel.reshard import transfer
from jaxrlhf.parallel.strategy import MESH_AXIS_NAMES, Strategy, parse_strategy
from jaxrlhf.parallel import rules as rule_presets


class Platform(enum.Enum):
    """The backend a mesh's devices belong to (the names of jax's `Device.platform`)."""

    CPU = "cpu"
    GPU = "gpu"
    TPU = "tpu"


@dataclasses.dataclass(frozen=True)
class Layout:
    """One named device mesh plus the logical->mesh rules used on it. Hashable.

    `micro_batches` matters only with a pipeline (strategy.pipeline > 1): how many micro-batches
    a call on this layout streams through the stages (the allocation's `@N`).
    """

    strategy: Strategy
    mesh: Mesh
    rules: rule_presets.Rules
    micro_batches: int = 1

    @property
    def pipeline(self) -> int:
        """Pipeline stages (1 = no pipeline)."""
        return self.strategy.pipeline

    @property
    def dp_size(self) -> int:
        """Ways the batch dimension is split (data × fsdp × expert)."""
        return self.strategy.dp_size

    @property
    def devices(self) -> tuple[jax.Device, ...]:
        return tuple(self.mesh.devices.flat)

    @property
    def num_devices(self) -> int:
        return self.mesh.devices.size

    @property
    def platform(self) -> Platform:
        return Platform(self.mesh.devices.flat[0].platform)

    def __str__(self) -> str:
        return str(self.strategy)

    def spec(self, logical_axes: Sequence[str | None], shape: Sequence[int] | None = None
             ) -> PartitionSpec:
        """PartitionSpec for logical axis names; with `shape`, non-dividing dims replicate."""
        rule_of = dict(reversed(self.rules))  # first rule for a name wins, as in flax
        entries = []
        for i, name in enumerate(logical_axes):
            axes = () if name is None else rule_presets.mesh_axes_of(rule_of.get(name))
            axes = tuple(a for a in axes if self.mesh.shape[a] > 1)
            ways = math.prod(self.mesh.shape[a] for a in axes)
            if shape is not None and shape[i] % ways:
                axes = ()
            entries.append(None if not axes else axes[0] if len(axes) == 1 else axes)
        return PartitionSpec(*entries)

    def sharding(self, logical_axes: Sequence[str | None], shape: Sequence[int] | None = None,
                 memory_kind: str | None = None) -> NamedSharding:
        """NamedSharding on this mesh for an array with the given logical axis names."""
        return NamedSharding(self.mesh, self.spec(logical_axes, shape), memory_kind=memory_kind)

    def param_shardings(self, boxed_params, memory_kind: str | None = None):
        """Shardings for a boxed (`nn.LogicallyPartitioned`) parameter tree.

        Args:
          boxed_params: params as returned by `init` / `abstract_params` (arrays or
            ShapeDtypeStructs inside `LogicallyPartitioned` boxes). Unboxed leaves replicate.
          memory_kind: e.g. "pinned_host" for an offloaded copy; None = device memory.

        Returns:
          A pytree of NamedSharding with the structure of the *unboxed* parameters.
        """
        is_box = lambda x: isinstance(x, nn.LogicallyPartitioned)

        def one(leaf):
            if is_box(leaf):
                return self.sharding(leaf.names, leaf.value.shape, memory_kind)
            return self.replicated(memory_kind)

        return jax.tree_util.tree_map(one, boxed_params, is_leaf=is_box)

    def batch_sharding(self, ndim: int) -> NamedSharding:
        """Dim 0 split over ("data", "fsdp", "expert"), the rest replicated."""
        return self.sharding(("batch",) + (None,) * (ndim - 1))

    def replicated(self, memory_kind: str | None = None) -> NamedSharding:
        return NamedSharding(self.mesh, PartitionSpec(), memory_kind=memory_kind)

    @contextlib.contextmanager
    def activation_context(self) -> Iterator[None]:
        """Mesh + logical rules in scope, so `nn.with_logical_constraint` binds while tracing."""
        with jax.set_mesh(self.mesh), nn.logical_axis_rules(self.rules):
            yield


def _rules_for_model(rules: rule_presets.Rules, mesh: Mesh, model: ModelConfig
                     ) -> rule_presets.Rules:
    """Replicates logical names whose model dimension the rule's mesh axes do not divide.

    This keeps activation constraints (which see no shapes at the rule level) consistent with
    the parameter shardings chosen by `Layout.spec(shape=...)`.
    """
    dims = {
        "vocab": model.vocab_size, "act_vocab": model.vocab_size,
        "embed": model.hidden_size, "act_embed": model.hidden_size,
        "heads": model.num_heads, "act_heads": model.num_heads,
        "kv_heads": model.num_kv_heads, "act_kv_heads": model.num_kv_heads,
        "mlp": model.intermediate_size, "act_mlp": model.intermediate_size,
        "head_dim": model.head_dim, "layers": model.num_layers,
    }
    if model.moe is not None:
        dims["experts"] = model.moe.num_experts
        dims["expert_mlp"] = model.moe.expert_intermediate_size
    fixed = []
    for name, target in rules:
        ways = math.prod(mesh.shape[a] for a in rule_presets.mesh_axes_of(target))
        if name in dims and dims[name] % ways:
            target = None
        fixed.append((name, target))
    return tuple(fixed)


def make_layout(
    spec: str | Strategy,
    *,
    model: ModelConfig | None = None,
    devices: Sequence[jax.Device] | None = None,
    rules: rule_presets.Rules = rule_presets.DEFAULT,
    micro_batches: int | None = None,
) -> Layout:
    """Builds a Layout from a strategy string such as "0-7:d2f2t2" or "0-7:d2p2t2".

    Args:
      spec: strategy string or parsed Strategy; without a device range it spans all devices.
      model: when given, t must divide the head counts and non-dividing dims replicate.
      devices: the cluster's devices (default `jax.devices()`), indexed host by host.
      rules: logical->mesh rule preset from `jaxrlhf/parallel/rules.py`.
      micro_batches: with a pipeline, the micro-batches a call streams through its stages
        (default: as many as there are stages).
    """
    strategy = parse_strategy(spec) if isinstance(spec, str) else spec
    all_devices = submesh.cluster_devices(devices)
    device_range = strategy.check_devices(len(all_devices))
    submesh.check_submesh(submesh.cluster_shape(all_devices), device_range)
    strategy = dataclasses.replace(strategy, devices=device_range)
    mesh = Mesh(
        submesh.mesh_devices(all_devices, device_range, strategy.mesh_shape), MESH_AXIS_NAMES
    )
    if model is not None:
        strategy.check_model(model)
        rules = _rules_for_model(rules, mesh, model)
    micro_batches = strategy.pipeline if micro_batches is None else micro_batches
    if micro_batches < 1:
        raise ValueError(f"micro_batches must be >= 1, got {micro_batches}")
    return Layout(strategy=strategy, mesh=mesh, rules=rules, micro_batches=micro_batches)


def check_batch_divisible(layout: Layout, batch: int, what: str) -> None:
    """Raises unless `batch` (e.g. "train micro-batch") splits evenly over data × fsdp ×
    expert."""
    if batch % layout.dp_size:
        raise ValueError(
            f"{what} size {batch} is not divisible by data×fsdp×expert={layout.dp_size} "
            f"of layout {layout}"
        )


def init_params(model_config: ModelConfig, layout: Layout, rng: jax.Array,
                select: Callable[[Any], Any] = lambda params: params):
    """Initialises parameters directly sharded on `layout`, never whole on one device.

    Shapes come from `jax.eval_shape`, shardings from the layout, and the init itself runs
    under `jax.jit(out_shardings=...)` so each device only materialises its own shards.
    `select` keeps a part of the tree (LoRA's adapters beside loaded weights); XLA then never
    computes the rest.

    Returns:
      The unboxed parameter pytree of sharded `jax.Array`s.
    """
    from jaxrlhf.models.transformer import Transformer  # heavy import only when initialising

    model = Transformer(model_config)

    def init_boxed(key):
        tokens_bt = jnp.zeros((1, 1), jnp.int32)
        return model.init(key, tokens_bt, tokens_bt, tokens_bt + 1)["params"]

    # Deliberately outside `activation_context()`: with a mesh in scope flax's DenseGeneral
    # constrains its flat [in, out] kernel with the 3-name logical spec and fails; placement is
    # fully decided by `out_shardings` anyway.
    shardings = select(layout.param_shardings(jax.eval_shape(init_boxed, rng)))
    init = jax.jit(lambda key: select(nn.unbox(init_boxed(key))), out_shardings=shardings)
    return init(transfer(rng, layout.replicated()))  # device_put refuses keys multi-process
