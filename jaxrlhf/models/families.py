"""The Hugging Face model families, one `Family` each: the seam that the config conversion
(models/hf_config.py), the checkpoint reader and writer (models/hf_io.py) and the named sizes
(models/sizes.py) ask about a family, so that a new family is one more entry here.

A family says what its attention block is (q/k/v bias, per-head q/k norms), its HF defaults,
the options it refuses, how its config.json spells a mixture of experts (`read_moe`,
`write_moe`) and where its checkpoints keep the expert tensors (`ExpertNames`).
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable, Mapping
from typing import Any

from jaxrlhf.models.moe import MoeConfig


class HfFamily(enum.Enum):
    """A Hugging Face model family; the value is its `model_type`."""

    LLAMA = "llama"
    QWEN2 = "qwen2"
    QWEN3 = "qwen3"
    QWEN3_MOE = "qwen3_moe"
    MIXTRAL = "mixtral"


@dataclasses.dataclass(frozen=True)
class ExpertNames:
    """Where a sparse layer's tensors lie in the Hub's per-expert layout: layer i's router is
    `model.layers.{i}.{block}.{router}.weight` [E, D], expert n's projections
    `model.layers.{i}.{block}.experts.{n}.{gate|up|down}.weight` (HF Linear [out, in])."""

    block: str
    router: str = "gate"
    gate: str = "gate_proj"
    up: str = "up_proj"
    down: str = "down_proj"

    def projection(self, ours: str) -> str:
        """Our stacked parameter name (gate_proj, up_proj, down_proj) -> the Hub's."""
        return {"gate_proj": self.gate, "up_proj": self.up, "down_proj": self.down}[ours]


Config = Mapping[str, Any]


def _no_moe(cfg: Config) -> MoeConfig | None:
    del cfg
    return None


def _qwen3_moe(cfg: Config) -> MoeConfig:
    """Qwen3-MoE: layer i is sparse unless listed in `mlp_only_layers` or
    (i + 1) % decoder_sparse_step != 0 (transformers' Qwen3MoeDecoderLayer)."""
    experts = int(cfg.get("num_experts", cfg.get("num_local_experts", 128)))
    step = int(cfg.get("decoder_sparse_step", 1))
    only_mlp = set(cfg.get("mlp_only_layers") or [])
    layers = int(cfg["num_hidden_layers"])
    dense = tuple(i for i in range(layers)
                  if i in only_mlp or experts == 0 or (i + 1) % step != 0)
    return MoeConfig(
        num_experts=experts, top_k=int(cfg.get("num_experts_per_tok", 8)),
        expert_intermediate_size=int(cfg.get("moe_intermediate_size", 768)),
        norm_topk_prob=bool(cfg.get("norm_topk_prob", False)), dense_layers=dense,
        aux_loss_coef=float(cfg.get("router_aux_loss_coef", 0.001)),
    )


def _mixtral(cfg: Config) -> MoeConfig:
    """Mixtral: every layer sparse, top-k renormalised, experts as wide as `intermediate_size`."""
    return MoeConfig(
        num_experts=int(cfg.get("num_local_experts", 8)),
        top_k=int(cfg.get("num_experts_per_tok", 2)),
        expert_intermediate_size=int(cfg["intermediate_size"]), norm_topk_prob=True,
        aux_loss_coef=float(cfg.get("router_aux_loss_coef", 0.001)),
    )


def _write_qwen3_moe(moe: MoeConfig) -> dict[str, Any]:
    # decoder_sparse_step 1 with the dense layers listed says exactly which layers are sparse.
    return dict(num_experts=moe.num_experts, num_experts_per_tok=moe.top_k,
                moe_intermediate_size=moe.expert_intermediate_size,
                norm_topk_prob=moe.norm_topk_prob, decoder_sparse_step=1,
                mlp_only_layers=list(moe.dense_layers), router_aux_loss_coef=moe.aux_loss_coef)


def _write_mixtral(moe: MoeConfig) -> dict[str, Any]:
    return dict(num_local_experts=moe.num_experts, num_experts_per_tok=moe.top_k,
                router_aux_loss_coef=moe.aux_loss_coef, router_jitter_noise=0.0)


def _check_mixtral(moe: MoeConfig | None) -> str | None:
    if moe is None:
        return None
    if not moe.norm_topk_prob:
        return "Mixtral renormalises the top-k probabilities (norm_topk_prob)"
    if moe.mixed:
        return "Mixtral has no dense layers"
    return None


@dataclasses.dataclass(frozen=True)
class Family:
    """What the rest of models/ asks about one HF family."""

    kind: HfFamily
    arch_prefix: str  # "Qwen3Moe" -> Qwen3MoeForCausalLM
    default_max_positions: int  # transformers' default where config.json omits it
    qkv_bias: bool  # q/k/v biased, o_proj not (Qwen2)
    qk_norm: bool  # per-head RMSNorm of queries and keys before RoPE (Qwen3)
    read_moe: Callable[[Config], MoeConfig | None] = _no_moe
    write_moe: Callable[[MoeConfig], dict[str, Any]] | None = None
    experts: ExpertNames | None = None  # None: the family has no experts
    # Why a MoeConfig this family cannot write is refused (None: it can).
    moe_problem: Callable[[MoeConfig | None], str | None] = lambda moe: None
    # config.json keys whose truthy value the model does not implement -> why.
    refused: tuple[tuple[str, str], ...] = ()
    sliding_window_keys: tuple[str, ...] = ()  # keys whose truthy value means sliding windows

    @property
    def sparse(self) -> bool:
        return self.experts is not None


_O_PROJ_BIAS = "attention_bias=True adds a bias to o_proj too, which the model lacks"

FAMILIES: dict[HfFamily, Family] = {
    HfFamily.LLAMA: Family(
        HfFamily.LLAMA, "Llama", 2048, qkv_bias=False, qk_norm=False,
        refused=(("attention_bias", f"Llama {_O_PROJ_BIAS}"),
                 ("mlp_bias", "Llama mlp_bias=True is not supported"))),
    HfFamily.QWEN2: Family(
        HfFamily.QWEN2, "Qwen2", 32768, qkv_bias=True, qk_norm=False,
        sliding_window_keys=("use_sliding_window",)),
    HfFamily.QWEN3: Family(
        HfFamily.QWEN3, "Qwen3", 32768, qkv_bias=False, qk_norm=True,
        refused=(("attention_bias", f"Qwen3 {_O_PROJ_BIAS}"),),
        sliding_window_keys=("use_sliding_window",)),
    HfFamily.QWEN3_MOE: Family(
        HfFamily.QWEN3_MOE, "Qwen3Moe", 32768, qkv_bias=False, qk_norm=True,
        read_moe=_qwen3_moe, write_moe=_write_qwen3_moe, experts=ExpertNames("mlp"),
        refused=(("attention_bias", f"Qwen3-MoE {_O_PROJ_BIAS}"),),
        sliding_window_keys=("use_sliding_window",)),
    HfFamily.MIXTRAL: Family(
        HfFamily.MIXTRAL, "Mixtral", 131072, qkv_bias=False, qk_norm=False,
        read_moe=_mixtral, write_moe=_write_mixtral,
        experts=ExpertNames("block_sparse_moe", gate="w1", up="w3", down="w2"),
        moe_problem=_check_mixtral,
        refused=(("router_jitter_noise", "Mixtral router_jitter_noise > 0 is not supported"),),
        sliding_window_keys=("sliding_window",)),
}
