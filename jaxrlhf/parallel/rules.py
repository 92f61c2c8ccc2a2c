"""Logical -> mesh axis rule presets.

A rule maps one logical axis name (see `jaxrlhf.models.transformer.LOGICAL_AXES`) to a mesh axis
name, a tuple of mesh axis names (sharded over their product), or None (replicated). Flax reads
them through `nn.logical_axis_rules`; the first rule for a name wins.

Mesh axes are ("pipeline", "data", "fsdp", "expert", "tensor"):
  * "pipeline" splits the stacked layers into stages (and a pipelined call's per-stage
    activations, logical name "stages"; see parallel/pipeline.py);
  * "data" replicates parameters and splits the batch;
  * "fsdp" splits the batch *and* the parameters' embed dimension (ZeRO-3 style, gathered per
    layer by XLA);
  * "expert" splits the batch *and* each sparse layer's experts (expert parallelism: tokens
    reach their experts by all-to-all, see models/expert_parallel.py);
  * "tensor" splits heads, MLP, each expert's hidden width and vocabulary (Megatron style).
"""

from __future__ import annotations

Rule = tuple[str, "str | tuple[str, ...] | None"]
Rules = tuple[Rule, ...]

DEFAULT: Rules = (
    # activations
    ("batch", ("data", "fsdp", "expert")),
    ("length", None),
    ("act_embed", None),
    ("act_heads", "tensor"),
    ("act_kv_heads", "tensor"),
    ("act_mlp", "tensor"),
    ("act_vocab", "tensor"),
    ("stages", "pipeline"),
    # parameters
    ("vocab", "tensor"),
    ("embed", "fsdp"),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("mlp", "tensor"),
    ("head_dim", None),
    ("layers", "pipeline"),
    # mixture-of-experts blocks (models/moe.py): 1/e of the experts on each expert rank, 1/t
    # of each expert's hidden width on each tensor rank (models/expert_parallel.py)
    ("experts", "expert"),
    ("experts_router", None),
    ("expert_mlp", "tensor"),
)

# Everything replicated but the batch: the layout of a pure data-parallel call.
REPLICATED_PARAMS: Rules = tuple(
    (name, target if name == "batch" else None) for name, target in DEFAULT
)


def mesh_axes_of(target: str | tuple[str, ...] | None) -> tuple[str, ...]:
    """The mesh axes a rule target names, as a tuple (empty when replicated)."""
    match target:
        case None:
            return ()
        case str():
            return (target,)
        case tuple():
            return target
    raise TypeError(f"bad rule target {target!r}")
