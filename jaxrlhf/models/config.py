"""Model hyper-parameters as a frozen, hashable dataclass (safe as a static jit argument)."""

from __future__ import annotations

import dataclasses
import enum

import jax.numpy as jnp

from jaxrlhf.models.attention import AttentionImpl
from jaxrlhf.models.lora import LoraConfig
from jaxrlhf.models.moe import MoeConfig


class HeadKind(enum.Enum):
    """What the decoder's last hidden state is projected to."""

    LM = "lm"  # logits over the vocabulary: actor, ref
    SCALAR = "scalar"  # one value per token: critic values, reward/cost scores


class RematPolicy(enum.Enum):
    """How much of each decoder layer's activations the backward pass recomputes."""

    NONE = "none"  # keep everything
    DOTS = "dots"  # keep matmul outputs without batch dims, recompute the rest
    FULL = "full"  # keep only the layer input


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """Llama-3 frequency-dependent RoPE scaling (HF `rope_type: llama3`)."""

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """A Llama-2/Llama-3/Qwen2/Qwen3(-MoE)/Mixtral-family decoder.

    `dtype` is the compute dtype, `param_dtype` the storage dtype of parameters.
    `scan_layers=False` unrolls the layer loop but keeps the same stacked parameter tree.
    `attention` picks the attention implementation (XLA, cuDNN, Pallas); AUTO by backend.
    `lora`: low-rank adapters beside the targeted projections (models/lora.py); None: none.
    `moe`: sparse mixture-of-experts feed-forward blocks (models/moe.py); None: dense MLPs.
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim_override: int | None = None
    max_position_embeddings: int = 8192
    rope_theta: float = 500000.0
    rope_scaling: RopeScaling | None = None
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    qk_norm: bool = False  # Qwen3: RMSNorm over head_dim of each query/key head before RoPE
    head: HeadKind = HeadKind.LM
    dtype: type = jnp.bfloat16
    param_dtype: type = jnp.float32
    scan_layers: bool = True
    remat: RematPolicy = RematPolicy.NONE
    attention: AttentionImpl = AttentionImpl.AUTO  # see models/attention.py
    lora: LoraConfig | None = None
    moe: MoeConfig | None = None

    def __post_init__(self):
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even for RoPE")
        if self.moe is not None and any(i >= self.num_layers for i in self.moe.dense_layers):
            raise ValueError(f"moe.dense_layers={self.moe.dense_layers} names a layer past "
                             f"num_layers={self.num_layers}")
        mlp = ("gate_proj", "up_proj", "down_proj")
        if self.moe is not None and self.lora is not None and any(map(self.lora.adapts, mlp)):
            raise ValueError("lora.targets: a model with experts takes adapters on the attention "
                             "projections only (q_proj, k_proj, v_proj, o_proj; its experts "
                             "have none)")

    @property
    def head_dim(self) -> int:
        return self.head_dim_override or self.hidden_size // self.num_heads

    def replace(self, **changes) -> "ModelConfig":
        return dataclasses.replace(self, **changes)
