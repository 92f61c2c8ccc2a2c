"""LoRA: low-rank adapters on a frozen decoder (Hu et al., 2021), as PEFT defines them.

A targeted projection with kernel W [*in, *out] gains two parameters beside it, `lora_a`
[*in, r] and `lora_b` [r, *out], and computes

    y = x·W + (alpha / r) · (x·A)·B

`lora_b` starts at zero, so an adapted model starts as its base model. Only the adapters train:
`partition` splits a parameter tree into (adapters, the rest), the train step differentiates
and keeps optimizer state for the first part only (engine/train_step.py), and everything else
(generation, inference, resharding, checkpoints) sees one tree, in which the adapters sit
beside the kernels they adapt, so that every forward pass is the adapted model.

`merged` folds the adapters into their kernels (W + alpha/r · A·B) for export as plain Hugging
Face weights; `peft_tensors` writes them in PEFT's `adapter_model.safetensors` layout
(`lora_A.weight` [r, in], `lora_B.weight` [out, r] per HF Linear), with `peft_config`'s
adapter_config.json beside it.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Callable, Mapping

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

ADAPTER_NAMES = ("lora_a", "lora_b")


class LoraTarget(enum.Enum):
    """A projection LoRA may adapt, by its name in both our tree and HF's."""

    Q_PROJ = "q_proj"
    K_PROJ = "k_proj"
    V_PROJ = "v_proj"
    O_PROJ = "o_proj"
    GATE_PROJ = "gate_proj"
    UP_PROJ = "up_proj"
    DOWN_PROJ = "down_proj"


@dataclasses.dataclass(frozen=True)
class LoraConfig:
    """Rank r, scale alpha / r, and the projections adapted (in every layer)."""

    rank: int
    alpha: float
    targets: tuple[LoraTarget, ...]

    def __post_init__(self):
        if self.rank < 1:
            raise ValueError(f"rank={self.rank}: must be >= 1")
        if not self.targets:
            raise ValueError("targets: LoRA needs at least one projection to adapt")

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    def adapts(self, name: str) -> bool:
        return any(t.value == name for t in self.targets)


def projection_sizes(model) -> dict[LoraTarget, tuple[int, int]]:
    """(fan-in, fan-out) of every projection LoRA may adapt in `model` (a ModelConfig)."""
    d, f = model.hidden_size, model.intermediate_size
    q, kv = model.num_heads * model.head_dim, model.num_kv_heads * model.head_dim
    return {LoraTarget.Q_PROJ: (d, q), LoraTarget.K_PROJ: (d, kv), LoraTarget.V_PROJ: (d, kv),
            LoraTarget.O_PROJ: (q, d), LoraTarget.GATE_PROJ: (d, f), LoraTarget.UP_PROJ: (d, f),
            LoraTarget.DOWN_PROJ: (f, d)}


def rank_problem(lora: LoraConfig, model) -> str | None:
    """Why `lora`'s rank does not fit `model`'s projections (None when it does): A·B of an
    [in, out] projection has rank at most min(in, out), so a larger rank adds parameters and
    work that learn nothing a rank of min(in, out) would not."""
    sizes = projection_sizes(model)
    target = min(lora.targets, key=lambda t: min(sizes[t]))
    if lora.rank <= min(sizes[target]):
        return None
    fan_in, fan_out = sizes[target]
    return (f"rank={lora.rank}: more than {min(sizes[target])}, the most an adapter of "
            f"{target.value} [{fan_in}, {fan_out}] can have (rank <= min(in, out))")


def parse_targets(text: str) -> tuple[LoraTarget, ...]:
    """"q_proj,v_proj" -> (Q_PROJ, V_PROJ); an unknown name is a ValueError listing the options."""
    names = [t.strip() for t in text.split(",") if t.strip()]
    options = {t.value: t for t in LoraTarget}
    for name in names:
        if name not in options:
            raise ValueError(f"{name!r} is not one of: {', '.join(options)}")
    return tuple(dict.fromkeys(options[n] for n in names))


def _dot(x: jax.Array, w: jax.Array, contract: int) -> jax.Array:
    """x [..., *w.shape[:contract]] times w [*in, *out] -> [..., *out]."""
    lead = x.shape[:x.ndim - contract]
    in_size = math.prod(w.shape[:contract])
    y = jnp.dot(x.reshape(-1, in_size), w.reshape(in_size, -1))
    return y.reshape(*lead, *w.shape[contract:])


def adapter_delta(module: nn.Module, lora: LoraConfig, x: jax.Array,
                  kernel_shape: tuple[int, ...], kernel_axes: tuple[str, ...], contract: int,
                  dtype, param_dtype) -> jax.Array:
    """alpha/r · (x·A)·B for the projection `module` whose kernel is [*in, *out] (`contract` in
    axes), creating its `lora_a` [*in, r] and `lora_b` [r, *out] parameters.

    A is initialised like PEFT's (uniform, bound 1/sqrt(fan_in)), B at zero. The rank axis is
    replicated; the others shard like the kernel's.
    """
    in_shape, out_shape = kernel_shape[:contract], kernel_shape[contract:]
    in_axes, out_axes = kernel_axes[:contract], kernel_axes[contract:]
    bound = 1.0 / math.sqrt(math.prod(in_shape))
    uniform = lambda key, shape, dt: jax.random.uniform(key, shape, dt, -bound, bound)
    a = module.param("lora_a", nn.with_logical_partitioning(uniform, (*in_axes, None)),
                     (*in_shape, lora.rank), param_dtype)
    b = module.param("lora_b", nn.with_logical_partitioning(nn.initializers.zeros,
                                                            (None, *out_axes)),
                     (lora.rank, *out_shape), param_dtype)
    h = _dot(x.astype(dtype), a.astype(dtype), contract)
    return _dot(h, b.astype(dtype), 1) * jnp.asarray(lora.scale, dtype)


# --- parameter trees ----------------------------------------------------------------------

def _split(tree: Mapping, keep: Callable[[str], bool]) -> tuple[dict, dict]:
    """(the leaves whose key satisfies `keep`, the others), each with the nesting of `tree`;
    sub-dicts left empty are dropped."""
    inside, outside = {}, {}
    for key, value in tree.items():
        if isinstance(value, Mapping):
            a, b = _split(value, keep)
            if a:
                inside[key] = a
            if b:
                outside[key] = b
        elif keep(key):
            inside[key] = value
        else:
            outside[key] = value
    return inside, outside


def partition(params: Mapping, lora: LoraConfig | None) -> tuple[Mapping, dict]:
    """(trained, frozen) halves of a parameter tree: with LoRA the adapters and the rest;
    without it every parameter trains (the tree as it is) and nothing is frozen."""
    if lora is None:
        return params, {}
    return _split(params, lambda key: key in ADAPTER_NAMES)


def combine(a: Mapping, b: Mapping) -> Mapping:
    """The union of two trees `partition` made (keys are disjoint at the leaves); `a` itself
    when `b` is empty."""
    if not b:
        return a
    out = dict(a)
    for key, value in b.items():
        out[key] = combine(out[key], value) if key in out else value
    return out


def merged(params: Mapping, lora: LoraConfig) -> dict:
    """The tree without adapters, each adapted kernel replaced by W + alpha/r · A·B (float32
    product, cast to the kernel's dtype). Stacked layers ([L, ...] leaves) merge per layer."""

    def merge(node: Mapping) -> dict:
        if "lora_a" not in node:
            return {k: merge(v) if isinstance(v, Mapping) else v for k, v in node.items()}
        kernel, a, b = node["kernel"], node["lora_a"], node["lora_b"]
        stacked = a.ndim + b.ndim - 2 > kernel.ndim  # both carry the [L] axis
        delta = (jax.vmap(_ab) if stacked else _ab)(a.astype(jnp.float32),
                                                   b.astype(jnp.float32))
        rest = {k: v for k, v in node.items() if k not in ("kernel", *ADAPTER_NAMES)}
        return {**rest, "kernel": (kernel.astype(jnp.float32) + lora.scale * delta
                                   ).astype(kernel.dtype)}

    return merge(params)


def _ab(a: jax.Array, b: jax.Array) -> jax.Array:
    """A [*in, r] · B [r, *out] -> [*in, *out]."""
    return jnp.tensordot(a, b, axes=1)


# --- PEFT's format --------------------------------------------------------------------------

def peft_tensors(adapters: Mapping[tuple[str, ...], np.ndarray], hf_name: Callable,
                 num_layers: int) -> dict[str, np.ndarray]:
    """PEFT's adapter_model.safetensors tensors of our adapters.

    Args:
      adapters: path -> host array of every `lora_a` [L, *in, r] / `lora_b` [L, r, *out] leaf
        (stacked over layers), e.g. ("layers", "self_attn", "q_proj", "lora_a").
      hf_name: (path of the adapted kernel, layer) -> its HF tensor name, `...q_proj.weight`.
      num_layers: L.

    Returns:
      "base_model.model.<module>.lora_A.weight" [r, in] and "...lora_B.weight" [out, r] per
      layer: HF Linear weights are [out, in] with the kernel's in and out axes flattened in
      order, so A·B in our axes is (lora_B · lora_A) in HF's.
    """
    out = {}
    for path, x in adapters.items():
        kernel_path = (*path[:-1], "kernel")
        for layer in range(num_layers):
            module = hf_name(kernel_path, layer).removesuffix(".weight")
            x_l = np.asarray(x[layer])
            if path[-1] == "lora_a":  # [*in, r] -> [r, in]
                tensor = x_l.reshape(-1, x_l.shape[-1]).T
                out[f"base_model.model.{module}.lora_A.weight"] = tensor
            else:  # [r, *out] -> [out, r]
                tensor = x_l.reshape(x_l.shape[0], -1).T
                out[f"base_model.model.{module}.lora_B.weight"] = tensor
    return {k: np.ascontiguousarray(v) for k, v in out.items()}


def peft_config(lora: LoraConfig, base_model: str) -> dict:
    """PEFT's adapter_config.json for these adapters on the HF model at `base_model`."""
    return {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model,
        "r": lora.rank, "lora_alpha": lora.alpha, "lora_dropout": 0.0, "bias": "none",
        "target_modules": [t.value for t in lora.targets], "fan_in_fan_out": False,
        "use_rslora": False, "init_lora_weights": True, "inference_mode": True,
        "modules_to_save": None,
    }
