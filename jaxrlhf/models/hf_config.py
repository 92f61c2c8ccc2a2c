"""Hugging Face `config.json` <-> `ModelConfig`, for the Llama, Qwen2, Qwen3, Qwen3-MoE,
Mixtral, Mistral and Gemma 3 (text) families (each one entry of models/families.py, which says
what differs).

Supported architectures (`config.json` "architectures"/"model_type"):

  * `LlamaForCausalLM`, `Qwen2ForCausalLM`, `Qwen3ForCausalLM`, `Qwen3MoeForCausalLM`,
    `MixtralForCausalLM`, `MistralForCausalLM`, `Gemma3ForCausalLM` -> `HeadKind.LM`;
  * `{Llama,Qwen2,Qwen3,...}ForSequenceClassification` with `num_labels == 1` ->
    `HeadKind.SCALAR` (critic / reward / cost models: `score.weight` [1, hidden]).

The families differ in the attention block: Llama has no q/k/v bias, Qwen2 always has one, and
Qwen3 has none but RMS-normalises each query and key head over head_dim before RoPE (`qk_norm`);
Qwen3-MoE is Qwen3's attention with mixture-of-experts feed-forward blocks (`ModelConfig.moe`,
its dense layers from `decoder_sparse_step` and `mlp_only_layers`), Mixtral Llama's attention
with top-2 experts in every layer. Mistral is Llama's block with a sliding window in every
layer (`sliding_window`, null for none); Gemma 3 alternates sliding (local) and global layers
as `layer_types` (or the older `sliding_window_pattern`) lays them out, each type with its own
RoPE, and has Gemma's block (GeGLU, (1 + w) norms before and after attention and MLP, a scaled
embedding, q/k norms, `query_pre_attn_scalar`, softcapping; families.py `_gemma3_layers`).

Both RoPE spellings are read: the transformers<5 one (top-level `rope_theta` plus
`rope_scaling: {rope_type|type: ...}`) and the transformers>=5 one (`rope_parameters:
{rope_theta, rope_type, ...}`; Gemma 3's per layer type). Only `default`, Llama-3 (`llama3`)
and `linear` RoPE exist in the model; anything else (dynamic, yarn, longrope, partial rotary),
sliding windows outside Mistral and Gemma 3, activations other than the family's, Llama's and
Qwen3's `attention_bias` (which also biases o_proj) and `mlp_bias` are rejected with an error
rather than silently loaded into a different network.

Export writes both RoPE spellings (they agree), and both `torch_dtype` and `dtype`, so readers
on either side of transformers 5 (and vLLM/SGLang, which read the older keys) see one model.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax.numpy as jnp
import numpy as np

from jaxrlhf.models.config import HeadKind, ModelConfig, RopeKind, RopeScaling
from jaxrlhf.models import families
from jaxrlhf.models.families import FAMILIES, Family, HfFamily

__all__ = ["HfFamily", "architecture_name", "default_family", "family_of", "hf_config_to_model_config",
           "model_config_to_hf_config"]

_HEAD_SUFFIX = {HeadKind.LM: "ForCausalLM", HeadKind.SCALAR: "ForSequenceClassification"}
# HF's own defaults for keys a config.json may omit (transformers Llama/Qwen2/Qwen3Config).
_DEFAULT_RMS_EPS = 1e-6
_DEFAULT_ROPE_THETA = 10000.0


def architecture_name(family: HfFamily, head: HeadKind) -> str:
    """E.g. (QWEN2, SCALAR) -> "Qwen2ForSequenceClassification"."""
    traits = FAMILIES[family]
    if head is HeadKind.SCALAR and traits.scalar_arch is not None:
        return traits.scalar_arch
    return traits.arch_prefix + _HEAD_SUFFIX[head]


def family_of(cfg: Mapping[str, Any]) -> HfFamily:
    model_type = cfg.get("model_type")
    try:
        return HfFamily(model_type)
    except ValueError:
        supported = ", ".join(f.value for f in HfFamily)
        raise ValueError(
            f"unsupported model_type {model_type!r} (architectures "
            f"{cfg.get('architectures')}); supported model types: {supported}"
        ) from None


def _head_of(cfg: Mapping[str, Any], family: HfFamily) -> HeadKind:
    """The head implied by `architectures`; a bare base model counts as LM."""
    architectures = cfg.get("architectures") or [architecture_name(family, HeadKind.LM)]
    by_name = {architecture_name(family, h): h for h in HeadKind}
    heads = set()
    for arch in architectures:
        if arch not in by_name:
            raise ValueError(
                f"unsupported architecture {arch!r} for model_type {family.value!r}; "
                f"supported: {', '.join(by_name)}"
            )
        heads.add(by_name[arch])
    if len(heads) != 1:
        raise ValueError(f"config lists architectures with different heads: {architectures}")
    return heads.pop()


def _num_labels(cfg: Mapping[str, Any]) -> int:
    """HF omits `id2label` when it equals its default, which has two labels."""
    if "id2label" in cfg:
        return len(cfg["id2label"])
    return int(cfg.get("num_labels", 2))


def _rope(cfg: Mapping[str, Any]) -> tuple[float, RopeScaling | None]:
    """(rope_theta, Llama-3 scaling or None) from either RoPE spelling."""
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    if any(isinstance(v, Mapping) for v in params.values()):
        raise ValueError(f"per-layer-type RoPE parameters are not supported: {params}")
    theta = float(params.get("rope_theta", cfg.get("rope_theta", _DEFAULT_ROPE_THETA)))
    partial = params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        raise ValueError(f"partial_rotary_factor={partial} is not supported (only full RoPE)")
    rope_type = params.get("rope_type", params.get("type", "default"))
    match rope_type:
        case "default":
            return theta, None
        case "linear":
            return theta, RopeScaling(factor=float(params["factor"]), kind=RopeKind.LINEAR)
        case "llama3":
            return theta, RopeScaling(
                factor=float(params["factor"]),
                low_freq_factor=float(params["low_freq_factor"]),
                high_freq_factor=float(params["high_freq_factor"]),
                original_max_position_embeddings=int(
                    params.get("original_max_position_embeddings",
                               cfg.get("max_position_embeddings"))
                ),
            )
        case _:
            raise ValueError(
                f"unsupported RoPE type {rope_type!r}; supported: 'default', 'llama3', 'linear'"
            )


def _check_family_features(cfg: Mapping[str, Any], family: Family) -> None:
    """Rejects HF options the model does not implement."""
    key = next((k for k in family.activation_keys if cfg.get(k)), None)
    if key is not None and cfg[key] != family.activation.value:
        raise ValueError(f"{key}={cfg[key]!r} is not supported (only "
                         f"{family.activation.value!r} for {family.arch_prefix})")
    for key, why in family.refused:
        if cfg.get(key):
            raise ValueError(why)
    layer_types = cfg.get("layer_types") or []
    if not family.has_windows and (
        any(cfg.get(key) for key in family.sliding_window_keys)
        or any(t != "full_attention" for t in layer_types)
    ):
        raise ValueError(f"{family.arch_prefix} sliding-window attention is not supported")


def hf_config_to_model_config(
    cfg: Mapping[str, Any],
    *,
    dtype=jnp.bfloat16,
    param_dtype=jnp.float32,
    head: HeadKind | None = None,
) -> ModelConfig:
    """Converts a parsed HF `config.json` to a ModelConfig.

    Args:
      cfg: the config.json contents.
      dtype: compute dtype of the model.
      param_dtype: storage dtype of the parameters (what `load_hf` casts tensors to).
      head: force a head; None takes it from `architectures` (SequenceClassification ->
        SCALAR, otherwise LM). Forcing SCALAR on a causal LM checkpoint is how a critic or
        reward model starts from an SFT model.

    Raises:
      ValueError: for an unsupported family, architecture, RoPE type or model option.
    """
    family = family_of(cfg)
    traits = FAMILIES[family]
    cfg = {**traits.hf_defaults, **cfg}  # an explicit null stays null
    inferred_head = _head_of(cfg, family)
    if inferred_head is HeadKind.SCALAR and _num_labels(cfg) != 1:
        raise ValueError(f"a scalar head needs num_labels=1, got {_num_labels(cfg)}")
    _check_family_features(cfg, traits)
    layers = traits.read_layers(cfg)
    if family is HfFamily.GEMMA3:  # its global layers' RoPE, in the one-type spelling
        global_rope, _ = families.gemma3_rope(cfg)
        rope_theta, rope_scaling = _rope({**cfg, **global_rope, "rope_scaling": None})
    else:
        rope_theta, rope_scaling = _rope(cfg)
    num_heads = int(cfg["num_attention_heads"])
    hidden = int(cfg["hidden_size"])
    head_dim = cfg.get("head_dim") or hidden // num_heads
    return ModelConfig(
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(cfg["intermediate_size"]),
        num_layers=int(cfg["num_hidden_layers"]),
        num_heads=num_heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or num_heads),
        head_dim_override=None if head_dim == hidden // num_heads else int(head_dim),
        max_position_embeddings=int(
            cfg.get("max_position_embeddings", traits.default_max_positions)
        ),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        rms_norm_eps=float(cfg.get("rms_norm_eps", _DEFAULT_RMS_EPS)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias=traits.qkv_bias,
        qk_norm=traits.qk_norm,
        moe=traits.read_moe(cfg),
        head=inferred_head if head is None else head,
        dtype=dtype,
        param_dtype=param_dtype,
        activation=traits.activation,
        **layers,
    )


def default_family(config: ModelConfig) -> HfFamily:
    """The HF family that can express `config`: Gemma's block is Gemma 3; with experts,
    Qwen3-MoE for q/k norms and Mixtral without; else a sliding window is Mistral, q/k/v bias
    without o_proj bias is Qwen2, q/k norms are Qwen3, neither is Llama."""
    if config.gemma_block:
        return HfFamily.GEMMA3
    if config.moe is not None:
        return HfFamily.QWEN3_MOE if config.qk_norm else HfFamily.MIXTRAL
    if config.sliding_window is not None:
        return HfFamily.MISTRAL
    if config.qk_norm:
        return HfFamily.QWEN3
    return HfFamily.QWEN2 if config.qkv_bias else HfFamily.LLAMA


def _check_expressible(config: ModelConfig, family: HfFamily) -> None:
    """Raises ValueError when `family`'s attention or feed-forward block differs from
    `config`'s."""
    traits = FAMILIES[family]
    if config.qkv_bias != traits.qkv_bias:
        raise ValueError(
            f"{family.value} cannot express qkv_bias={config.qkv_bias} without an o_proj bias"
        )
    if config.qk_norm != traits.qk_norm:
        raise ValueError(f"{family.value} cannot express qk_norm={config.qk_norm}")
    if (config.moe is not None) != traits.sparse:
        raise ValueError(f"{family.value} cannot express moe={config.moe}")
    if (why := traits.moe_problem(config.moe)) is not None:
        raise ValueError(f"{family.value} cannot express moe={config.moe}: {why}")
    if config.activation is not traits.activation:
        raise ValueError(f"{family.value} cannot express activation={config.activation.value}")
    if (why := traits.layers_problem(config)) is not None:
        raise ValueError(f"{family.value} cannot express this model: {why}")


def _rope_dicts(config: ModelConfig) -> tuple[dict | None, dict]:
    """(legacy `rope_scaling`, transformers-5 `rope_parameters`)."""
    if config.rope_scaling is None:
        return None, {"rope_type": "default", "rope_theta": config.rope_theta}
    s = config.rope_scaling
    if s.kind is RopeKind.LINEAR:
        scaling = {"rope_type": "linear", "factor": s.factor}
        return scaling, {**scaling, "rope_theta": config.rope_theta}
    scaling = {
        "rope_type": "llama3", "factor": s.factor, "low_freq_factor": s.low_freq_factor,
        "high_freq_factor": s.high_freq_factor,
        "original_max_position_embeddings": s.original_max_position_embeddings,
    }
    return scaling, {**scaling, "rope_theta": config.rope_theta}


def model_config_to_hf_config(
    config: ModelConfig, *, family: HfFamily | None = None, dtype=None
) -> dict[str, Any]:
    """The HF `config.json` contents for `config` (the inverse of hf_config_to_model_config).

    Args:
      config: the model.
      family: HF family to write; None picks `default_family(config)`.
      dtype: dtype the weights are saved in (`torch_dtype`); None means `config.param_dtype`.

    Raises:
      ValueError: if the family cannot express the config (bias or q/k norm layout differs).
    """
    family = default_family(config) if family is None else family
    _check_expressible(config, family)
    rope_scaling, rope_parameters = _rope_dicts(config)
    dtype_name = np.dtype(config.param_dtype if dtype is None else dtype).name
    hf = {
        "architectures": [architecture_name(family, config.head)],
        "model_type": family.value,
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.num_kv_heads,
        "head_dim": config.head_dim,
        "hidden_act": config.activation.value,
        "max_position_embeddings": config.max_position_embeddings,
        "rms_norm_eps": config.rms_norm_eps,
        "rope_theta": config.rope_theta,
        "rope_scaling": rope_scaling,
        "rope_parameters": rope_parameters,
        "tie_word_embeddings": config.tie_word_embeddings,
        "torch_dtype": dtype_name,
        "dtype": dtype_name,
    }
    match family:
        case HfFamily.LLAMA:
            hf.update(attention_bias=False, mlp_bias=False)
        case HfFamily.QWEN2:
            hf.update(use_sliding_window=False)
        case HfFamily.QWEN3 | HfFamily.QWEN3_MOE:
            hf.update(attention_bias=False, use_sliding_window=False)
        case HfFamily.MIXTRAL:
            hf.update(sliding_window=None)
    hf.update(FAMILIES[family].write_layers(config))
    if config.moe is not None:
        hf.update(FAMILIES[family].write_moe(config.moe))
    if config.head is HeadKind.SCALAR:
        hf.update(id2label={"0": "LABEL_0"}, label2id={"LABEL_0": 0})
    return hf
