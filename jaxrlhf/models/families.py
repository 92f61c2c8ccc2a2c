"""The Hugging Face model families, one `Family` each: the seam that the config conversion
(models/hf_config.py), the checkpoint reader and writer (models/hf_io.py) and the named sizes
(models/sizes.py) ask about a family, so that a new family is one more entry here.

A family says what its attention block is (q/k/v bias, per-head q/k norms), its HF defaults,
the options it refuses, how its config.json spells a mixture of experts (`read_moe`,
`write_moe`) and where its checkpoints keep the expert tensors (`ExpertNames`), and how it
spells what only some families have (`read_layers`, `write_layers`: sliding windows, Gemma's
block, RoPE per layer type, softcapping).
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable, Mapping
from typing import Any

from jaxrlhf.models.config import Activation, ModelConfig, RopeKind
from jaxrlhf.models.moe import MoeConfig


class HfFamily(enum.Enum):
    """A Hugging Face model family; the value is its `model_type`."""

    LLAMA = "llama"
    QWEN2 = "qwen2"
    QWEN3 = "qwen3"
    QWEN3_MOE = "qwen3_moe"
    MIXTRAL = "mixtral"
    MISTRAL = "mistral"
    GEMMA3 = "gemma3_text"  # Gemma3ForCausalLM (the text model; "gemma3" is the multimodal one)


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


def _no_layers(cfg: Config) -> dict[str, Any]:
    del cfg
    return {}


def _write_no_layers(config: ModelConfig) -> dict[str, Any]:
    del config
    return {}


def _mistral_layers(cfg: Config) -> dict[str, Any]:
    """Mistral: every layer sliding when `sliding_window` is set (null: none)."""
    window = cfg.get("sliding_window")
    if window is None:
        return {}
    return dict(sliding_window=int(window),
                sliding_layers=tuple(range(int(cfg["num_hidden_layers"]))))


def _write_mistral_layers(config: ModelConfig) -> dict[str, Any]:
    return dict(sliding_window=config.sliding_window)


GEMMA3_GLOBAL_THETA, GEMMA3_LOCAL_THETA = 1_000_000.0, 10_000.0  # transformers' defaults


def _gemma3_layer_types(cfg: Config) -> list[str]:
    """`layer_types`, or from `sliding_window_pattern` (older configs; default 6): layer i is
    global iff (i + 1) % pattern == 0 (transformers' Gemma3TextConfig)."""
    if cfg.get("layer_types"):
        return list(cfg["layer_types"])
    pattern = int(cfg.get("sliding_window_pattern", 6))
    return ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
            for i in range(int(cfg["num_hidden_layers"]))]


def gemma3_rope(cfg: Config) -> tuple[Config, float]:
    """(the global layers' RoPE keys in the one-type spelling `hf_config` reads, the local
    layers' base) from either spelling: transformers 5's `rope_parameters` per layer type, or
    `rope_theta` + `rope_scaling` (global) and `rope_local_base_freq` (local)."""
    params = cfg.get("rope_parameters") or {}
    if "full_attention" in params or "sliding_attention" in params:
        local = params.get("sliding_attention") or {}
        if local.get("rope_type", "default") != "default":
            raise ValueError(f"Gemma 3 local-layer RoPE {local} is not supported (only default)")
        full = dict(params.get("full_attention") or {})
        full.setdefault("rope_theta", GEMMA3_GLOBAL_THETA)
        return ({"rope_parameters": full},
                float(local.get("rope_theta", GEMMA3_LOCAL_THETA)))
    scaling = dict(cfg.get("rope_scaling") or {})
    scaling["rope_theta"] = cfg.get("rope_theta", GEMMA3_GLOBAL_THETA)
    return ({"rope_parameters": scaling},
            float(cfg.get("rope_local_base_freq", GEMMA3_LOCAL_THETA)))


def _gemma3_layers(cfg: Config) -> dict[str, Any]:
    """Gemma 3: local (sliding) and global layers, the local ones' RoPE base, Gemma's block,
    the attention scale and the softcaps."""
    types = _gemma3_layer_types(cfg)
    unknown = set(types) - {"sliding_attention", "full_attention"}
    if unknown or len(types) != int(cfg["num_hidden_layers"]):
        raise ValueError(f"Gemma 3 layer_types {types} are not one of sliding_attention, "
                         f"full_attention per layer")
    window = cfg.get("sliding_window")
    sliding = tuple(i for i, t in enumerate(types) if t == "sliding_attention")
    cap = lambda key: None if cfg.get(key) is None else float(cfg[key])
    _, local_theta = gemma3_rope(cfg)
    return dict(
        gemma_block=True,
        sliding_window=None if window is None or not sliding else int(window),
        sliding_layers=() if window is None else sliding,
        rope_local_theta=local_theta,
        query_pre_attn_scalar=float(cfg["query_pre_attn_scalar"]),
        final_softcap=cap("final_logit_softcapping"),
    )


def _int_if_whole(x: float) -> float | int:
    """transformers' Gemma3TextConfig types query_pre_attn_scalar int (strictly checked)."""
    return int(x) if float(x).is_integer() else x


def _write_gemma3_layers(config: ModelConfig) -> dict[str, Any]:
    """Both RoPE spellings (they agree), `layer_types`, and the Gemma-only keys."""
    types = ["sliding_attention" if i in config.sliding_layers else "full_attention"
             for i in range(config.num_layers)]
    local_theta = config.rope_local_theta or config.rope_theta
    full = {"rope_type": "default", "rope_theta": config.rope_theta}
    s = config.rope_scaling
    if s is not None:
        full.update(rope_type=s.kind.value, factor=s.factor)
    return dict(
        hidden_activation=config.activation.value, layer_types=types,
        sliding_window=config.sliding_window, rope_local_base_freq=local_theta,
        rope_scaling=None if s is None else {k: v for k, v in full.items() if k != "rope_theta"},
        rope_parameters={"full_attention": full,
                         "sliding_attention": {"rope_type": "default", "rope_theta": local_theta}},
        query_pre_attn_scalar=_int_if_whole(config.query_pre_attn_scalar or config.head_dim),
        attn_logit_softcapping=None,
        final_logit_softcapping=config.final_softcap,
        attention_bias=False, use_bidirectional_attention=False,
    )


def _check_gemma3(config: ModelConfig) -> str | None:
    if not config.gemma_block:
        return "Gemma 3 has Gemma's block (gemma_block)"
    if config.attn_softcap is not None:
        return "transformers' Gemma 3 applies no attention softcapping"
    if config.rope_scaling is not None and config.rope_scaling.kind is not RopeKind.LINEAR:
        return "Gemma 3's global layers take linear RoPE scaling only"
    return None


def _check_plain(config: ModelConfig) -> str | None:
    """What only Gemma 3 writes: its block, a local RoPE base, an attention scale, softcaps."""
    if (config.gemma_block or config.rope_local_theta is not None
            or config.query_pre_attn_scalar is not None or config.attn_softcap is not None
            or config.final_softcap is not None):
        return "it has no Gemma block, local RoPE base, query_pre_attn_scalar or softcapping"
    return None


def _check_mistral(config: ModelConfig) -> str | None:
    if config.sliding_window is not None and config.layers_differ:
        return "Mistral's window applies to every layer or none"
    return _check_plain(config)


def _check_windowless(config: ModelConfig) -> str | None:
    if config.sliding_window is not None:
        return "it has no sliding-window attention"
    return _check_plain(config)


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
    # ModelConfig fields beyond the common ones, from config.json (windows, Gemma's block).
    read_layers: Callable[[Config], dict[str, Any]] = _no_layers
    write_layers: Callable[[ModelConfig], dict[str, Any]] = _write_no_layers
    # Why a ModelConfig this family cannot write (windows, block, RoPE) is refused (None: it can).
    layers_problem: Callable[[ModelConfig], str | None] = _check_windowless
    activation: Activation = Activation.SILU
    activation_keys: tuple[str, ...] = ("hidden_act",)  # config.json keys naming it, in order
    # transformers' values of keys a config.json may omit, where our readers' defaults differ.
    hf_defaults: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    scalar_arch: str | None = None  # the ForSequenceClassification name, where not the prefix's

    @property
    def sparse(self) -> bool:
        return self.experts is not None

    @property
    def has_windows(self) -> bool:
        """Its config.json's sliding windows are read (`read_layers`), not refused."""
        return self.read_layers is not _no_layers


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
    HfFamily.MISTRAL: Family(
        HfFamily.MISTRAL, "Mistral", 131072, qkv_bias=False, qk_norm=False,
        read_layers=_mistral_layers, write_layers=_write_mistral_layers,
        layers_problem=_check_mistral,
        hf_defaults=dict(sliding_window=4096, num_key_value_heads=8)),
    HfFamily.GEMMA3: Family(
        HfFamily.GEMMA3, "Gemma3", 131072, qkv_bias=False, qk_norm=True,
        refused=(("attention_bias", "Gemma 3 attention_bias=True is not supported"),
                 ("use_bidirectional_attention",
                  "Gemma 3 use_bidirectional_attention=True is not supported (causal only)"),
                 # transformers' Gemma3Attention never passes it on (Gemma 2's does): the
                 # readers would disagree on what the checkpoint computes.
                 ("attn_logit_softcapping", "Gemma 3 attn_logit_softcapping is not applied by "
                  "transformers' Gemma3ForCausalLM; a checkpoint setting it is refused")),
        read_layers=_gemma3_layers, write_layers=_write_gemma3_layers,
        layers_problem=_check_gemma3, activation=Activation.GELU_TANH,
        activation_keys=("hidden_activation", "hidden_act"),
        hf_defaults=dict(tie_word_embeddings=True, head_dim=256, num_key_value_heads=4,
                         sliding_window=4096, query_pre_attn_scalar=256),
        scalar_arch="Gemma3TextForSequenceClassification"),
}
