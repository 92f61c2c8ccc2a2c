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


class RopeKind(enum.Enum):
    """How `RopeScaling` changes the RoPE frequencies (HF's `rope_type`)."""

    LLAMA3 = "llama3"  # frequency-dependent: low frequencies divided by `factor`, a smooth band
    LINEAR = "linear"  # every frequency divided by `factor` (Gemma 3's global layers)


class Activation(enum.Enum):
    """The gate's nonlinearity of the gated feed-forward block (HF `hidden_act`)."""

    SILU = "silu"  # SwiGLU: Llama, Qwen, Mistral
    GELU_TANH = "gelu_pytorch_tanh"  # GeGLU with the tanh approximation: Gemma


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling: Llama-3's (HF `rope_type: llama3`) or linear (only `factor`)."""

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    kind: RopeKind = RopeKind.LLAMA3


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """A Llama-2/Llama-3/Qwen2/Qwen3(-MoE)/Mixtral/Mistral/Gemma-3-family decoder.

    `dtype` is the compute dtype, `param_dtype` the storage dtype of parameters.
    `scan_layers=False` unrolls the layer loop but keeps the same stacked parameter tree.
    `attention` picks the attention implementation (XLA, cuDNN, Pallas); AUTO by backend.
    `lora`: low-rank adapters beside the targeted projections (models/lora.py); None: none.
    `moe`: sparse mixture-of-experts feed-forward blocks (models/moe.py); None: dense MLPs.

    Sliding-window attention (Mistral, Gemma 3): the layers in `sliding_layers` attend only to
    the `sliding_window` latest slots, their own included (HF's `kv > q - window`); the others
    attend to every earlier slot. Gemma 3's local layers rotate with `rope_local_theta` and
    no scaling, its global ones with `rope_theta` and `rope_scaling`.
    Gemma's block (`gemma_block`): (1 + w) RMSNorms in fp32, the attention's and the MLP's
    outputs normed again before the residual add (post_attention_layernorm,
    post_feedforward_layernorm; the MLP's input norm is pre_feedforward_layernorm), the
    embedding times sqrt(hidden) in the compute dtype.
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
    activation: Activation = Activation.SILU
    gemma_block: bool = False
    sliding_window: int | None = None  # slots a sliding layer sees, its own included
    sliding_layers: tuple[int, ...] = ()  # the layers that attend through the window
    rope_local_theta: float | None = None  # RoPE base of the sliding layers; None: rope_theta
    query_pre_attn_scalar: float | None = None  # scores scaled by its -1/2; None: head_dim's
    attn_softcap: float | None = None  # scores -> c * tanh(scores / c) before the mask
    final_softcap: float | None = None  # logits -> c * tanh(logits / c)

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
        if bool(self.sliding_layers) != (self.sliding_window is not None):
            raise ValueError(f"sliding_window={self.sliding_window} needs the layers it applies "
                             f"to (sliding_layers={self.sliding_layers}) and they it")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"sliding_window={self.sliding_window} must be >= 1")
        if any(not 0 <= i < self.num_layers for i in self.sliding_layers):
            raise ValueError(f"sliding_layers={self.sliding_layers} names a layer outside "
                             f"0..{self.num_layers - 1}")
        mlp = ("gate_proj", "up_proj", "down_proj")
        if self.moe is not None and self.lora is not None and any(map(self.lora.adapts, mlp)):
            raise ValueError("lora.targets: a model with experts takes adapters on the attention "
                             "projections only (q_proj, k_proj, v_proj, o_proj; its experts "
                             "have none)")

    @property
    def head_dim(self) -> int:
        return self.head_dim_override or self.hidden_size // self.num_heads

    @property
    def attention_scale(self) -> float:
        """What the scores q.k are multiplied by before the softmax."""
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    @property
    def layers_differ(self) -> bool:
        """Some layers attend through the window and others do not (Gemma 3): a layer must
        know its index in the model (`transformer.DecoderLayer`)."""
        return 0 < len(self.sliding_layers) < self.num_layers

    def replace(self, **changes) -> "ModelConfig":
        return dataclasses.replace(self, **changes)
