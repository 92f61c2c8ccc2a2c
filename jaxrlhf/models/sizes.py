"""Named model sizes: tiny ones for tests and CPU runs, and ReaL's LLaMA-3 sizes (Table 1).

`param_count` evaluates the parameter tree abstractly (`jax.eval_shape`), so it costs no memory
even for 70B.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from jaxrlhf.models.config import Activation, HeadKind, ModelConfig, RopeKind, RopeScaling
from jaxrlhf.models.moe import MoeConfig

_LLAMA3 = dict(
    vocab_size=128256, max_position_embeddings=8192, rope_theta=500000.0,
    rope_scaling=RopeScaling(), rms_norm_eps=1e-5,
)

# Llama-3.1/3.2: 128k context with the llama3 RoPE scaling (factor 8 for 3.1, 32 for 3.2).
_LLAMA31 = dict(_LLAMA3, max_position_embeddings=131072, rope_scaling=RopeScaling(factor=8.0))
_LLAMA32 = dict(_LLAMA3, max_position_embeddings=131072, rope_scaling=RopeScaling(factor=32.0))
# Qwen2.5: q/k/v bias, 151936-row vocabulary, theta 1e6.
_QWEN2 = dict(vocab_size=151936, max_position_embeddings=32768, rope_theta=1000000.0,
              rms_norm_eps=1e-6, qkv_bias=True)
# Qwen3: no q/k/v bias but per-head q/k RMSNorm, 40960 context; head_dim is 128 at every size
# (an override where hidden/heads differs, as HF's config.json import leaves it).
_QWEN3 = dict(vocab_size=151936, max_position_embeddings=40960, rope_theta=1000000.0,
              rms_norm_eps=1e-6, qk_norm=True)

# Qwen3-MoE: Qwen3's attention (head_dim 128), 128 experts, 8 a token, top-k renormalised,
# every layer sparse (`intermediate_size` is then unused).
_QWEN3_MOE = dict(_QWEN3, head_dim_override=128)
# Mixtral: Llama attention with a 32000-row vocabulary, 8 experts, 2 a token, in every layer.
_MIXTRAL = dict(vocab_size=32000, max_position_embeddings=32768, rope_theta=1000000.0,
                rms_norm_eps=1e-5)
# Mistral-7B-v0.1: Llama's block, a 4096-slot sliding window in every layer, theta 1e4.
_MISTRAL = dict(vocab_size=32000, max_position_embeddings=32768, rope_theta=10000.0,
                rms_norm_eps=1e-5, sliding_window=4096)
# Gemma 3 (google/gemma-3-*): GeGLU, Gemma's block, q/k norms, head_dim 256 (= its
# query_pre_attn_scalar), tied embeddings; every sixth layer global (5, 11, ...), the others
# local with a base of 1e4, the global ones 1e6 (linear x8 from 4B up).
_GEMMA3 = dict(head_dim_override=256, rope_theta=1000000.0, rope_local_theta=10000.0,
               rms_norm_eps=1e-6, qk_norm=True, tie_word_embeddings=True,
               activation=Activation.GELU_TANH, gemma_block=True, query_pre_attn_scalar=256.0)


def _gemma3_local(num_layers: int) -> tuple[int, ...]:
    """Gemma 3's local layers: all but every sixth (sliding_window_pattern 6)."""
    return tuple(i for i in range(num_layers) if (i + 1) % 6)


SIZES: dict[str, ModelConfig] = {
    # ~0.2M parameters, byte vocabulary: the CPU default that learns in minutes.
    "tiny": ModelConfig(
        vocab_size=272, hidden_size=64, intermediate_size=256, num_layers=2, num_heads=4,
        num_kv_heads=2, max_position_embeddings=512, rope_theta=10000.0,
    ),
    "small": ModelConfig(
        vocab_size=272, hidden_size=256, intermediate_size=1024, num_layers=4, num_heads=8,
        num_kv_heads=4, max_position_embeddings=1024, rope_theta=10000.0,
    ),
    # W-cpu of the speed benchmark (configs/grpo_bench_cpu.py): ~4M parameters, head dim 64.
    "bench": ModelConfig(
        vocab_size=272, hidden_size=256, intermediate_size=1024, num_layers=4, num_heads=4,
        num_kv_heads=2, max_position_embeddings=1024, rope_theta=10000.0,
    ),
    # `tiny` with a Qwen3-MoE block in both layers: 8 experts of width 128, 2 a token (the
    # dense MLP's 256 active), q/k norms (configs/grpo_moe_tiny.py).
    "tiny-moe": ModelConfig(
        vocab_size=272, hidden_size=64, intermediate_size=256, num_layers=2, num_heads=4,
        num_kv_heads=2, max_position_embeddings=512, rope_theta=10000.0, qk_norm=True,
        moe=MoeConfig(num_experts=8, top_k=2, expert_intermediate_size=128, norm_topk_prob=True,
                      aux_loss_coef=0.01, z_loss_coef=0.001),
    ),
    # `tiny` in Gemma 3's shape (configs/grpo_gemma_tiny.py): layer 0 local with a 4-slot
    # window, layer 1 global; Gemma's block, GeGLU, q/k norms; untied (see the config).
    "tiny-gemma3": ModelConfig(
        vocab_size=272, hidden_size=64, intermediate_size=256, num_layers=2, num_heads=4,
        num_kv_heads=2, max_position_embeddings=512, sliding_window=4, sliding_layers=(0,),
        **dict(_GEMMA3, head_dim_override=None, query_pre_attn_scalar=16.0,
               tie_word_embeddings=False),
    ),
    "llama3-7b": ModelConfig(
        hidden_size=4096, intermediate_size=14336, num_layers=32, num_heads=32, num_kv_heads=8,
        **_LLAMA3,
    ),
    "llama3-13b": ModelConfig(
        hidden_size=5120, intermediate_size=13824, num_layers=40, num_heads=40, num_kv_heads=40,
        **_LLAMA3,
    ),
    "llama3-34b": ModelConfig(
        hidden_size=8192, intermediate_size=22016, num_layers=48, num_heads=64, num_kv_heads=8,
        **_LLAMA3,
    ),
    "llama3-70b": ModelConfig(
        hidden_size=8192, intermediate_size=28672, num_layers=80, num_heads=64, num_kv_heads=8,
        **_LLAMA3,
    ),
    # Released checkpoints (shapes from their HF config.json; counts checked in
    # tests/unit/test_sizes.py against the published safetensors totals).
    "qwen2.5-0.5b": ModelConfig(
        hidden_size=896, intermediate_size=4864, num_layers=24, num_heads=14, num_kv_heads=2,
        tie_word_embeddings=True, **_QWEN2,
    ),
    "qwen2.5-1.5b": ModelConfig(
        hidden_size=1536, intermediate_size=8960, num_layers=28, num_heads=12, num_kv_heads=2,
        tie_word_embeddings=True, **_QWEN2,
    ),
    "qwen3-0.6b": ModelConfig(
        hidden_size=1024, intermediate_size=3072, num_layers=28, num_heads=16, num_kv_heads=8,
        head_dim_override=128, tie_word_embeddings=True, **_QWEN3,
    ),
    "qwen3-1.7b": ModelConfig(
        hidden_size=2048, intermediate_size=6144, num_layers=28, num_heads=16, num_kv_heads=8,
        tie_word_embeddings=True, **_QWEN3,
    ),
    "qwen3-4b": ModelConfig(
        hidden_size=2560, intermediate_size=9728, num_layers=36, num_heads=32, num_kv_heads=8,
        head_dim_override=128, tie_word_embeddings=True, **_QWEN3,
    ),
    "qwen3-8b": ModelConfig(
        hidden_size=4096, intermediate_size=12288, num_layers=36, num_heads=32, num_kv_heads=8,
        **_QWEN3,
    ),
    "llama-3.2-1b": ModelConfig(
        hidden_size=2048, intermediate_size=8192, num_layers=16, num_heads=32, num_kv_heads=8,
        tie_word_embeddings=True, **_LLAMA32,
    ),
    "llama-3.2-3b": ModelConfig(
        hidden_size=3072, intermediate_size=8192, num_layers=28, num_heads=24, num_kv_heads=8,
        tie_word_embeddings=True, **_LLAMA32,
    ),
    "llama-3.1-8b": ModelConfig(
        hidden_size=4096, intermediate_size=14336, num_layers=32, num_heads=32, num_kv_heads=8,
        **_LLAMA31,
    ),
    "mistral-7b": ModelConfig(
        hidden_size=4096, intermediate_size=14336, num_layers=32, num_heads=32, num_kv_heads=8,
        sliding_layers=tuple(range(32)), **_MISTRAL,
    ),
    "gemma3-1b": ModelConfig(
        vocab_size=262144, hidden_size=1152, intermediate_size=6912, num_layers=26,
        num_heads=4, num_kv_heads=1, max_position_embeddings=32768, sliding_window=512,
        sliding_layers=_gemma3_local(26), **_GEMMA3,
    ),
    # The language model of the 4B (its vision tower is not ours).
    "gemma3-4b": ModelConfig(
        vocab_size=262208, hidden_size=2560, intermediate_size=10240, num_layers=34,
        num_heads=8, num_kv_heads=4, max_position_embeddings=131072, sliding_window=1024,
        sliding_layers=_gemma3_local(34), rope_scaling=RopeScaling(8.0, kind=RopeKind.LINEAR),
        **_GEMMA3,
    ),
    # Mixtures of experts: all experts count in the parameters, the top-k in `matmul_params`.
    "qwen3-30b-a3b": ModelConfig(
        hidden_size=2048, intermediate_size=6144, num_layers=48, num_heads=32, num_kv_heads=4,
        moe=MoeConfig(num_experts=128, top_k=8, expert_intermediate_size=768,
                      aux_loss_coef=0.001), **_QWEN3_MOE,
    ),
    "qwen3-235b-a22b": ModelConfig(
        hidden_size=4096, intermediate_size=12288, num_layers=94, num_heads=64, num_kv_heads=4,
        moe=MoeConfig(num_experts=128, top_k=8, expert_intermediate_size=1536,
                      aux_loss_coef=0.001), **_QWEN3_MOE,
    ),
    "mixtral-8x7b": ModelConfig(
        hidden_size=4096, intermediate_size=14336, num_layers=32, num_heads=32, num_kv_heads=8,
        moe=MoeConfig(num_experts=8, top_k=2, expert_intermediate_size=14336,
                      aux_loss_coef=0.02), **_MIXTRAL,
    ),
}


def get_size(name: str, **overrides) -> ModelConfig:
    """The registered config `name`, with field overrides (e.g. head=HeadKind.SCALAR)."""
    if name not in SIZES:
        raise ValueError(f"unknown model size {name!r}; known: {', '.join(SIZES)}")
    return SIZES[name].replace(**overrides)


@functools.lru_cache(maxsize=64)
def abstract_params(config: ModelConfig):
    """The (boxed, logically annotated) parameter tree as ShapeDtypeStructs, without memory.

    Cached: configs are frozen and the tree is immutable, and a run asks for it many times.
    """
    from jaxrlhf.models.transformer import Transformer  # local: keep this module import-light

    # Every array is made inside the trace: a concrete one (jnp.zeros) would compile a
    # program, and config checks that ask for shapes must compile nothing.
    tokens = jax.ShapeDtypeStruct((1, 1), jnp.int32)
    return jax.eval_shape(
        lambda t: Transformer(config).init(jax.random.key(0), t, t, t + 1), tokens
    )["params"]


def param_count(config: ModelConfig) -> int:
    leaves = jax.tree_util.tree_leaves(abstract_params(config))
    return sum(math.prod(leaf.shape) for leaf in leaves)


def param_count_without_output_embedding(config: ModelConfig) -> int:
    """ReaL's identifier count (Table 1): all parameters but the LM head."""
    lm_head = 0 if config.tie_word_embeddings else config.vocab_size * config.hidden_size
    return param_count(config) - lm_head


def matmul_params(config: ModelConfig) -> int:
    """Parameters that take part in a matmul per token: all but the embedding lookup table (a
    gather) and the norm scales; a tied LM head counts once, as a matmul. A sparse layer counts
    its router and the top_k experts a token runs through, not all of them."""
    c = config
    attention = (
        c.hidden_size * (c.num_heads + 2 * c.num_kv_heads) * c.head_dim  # q, k, v
        + c.num_heads * c.head_dim * c.hidden_size  # o
    )
    dense_mlp = 3 * c.hidden_size * c.intermediate_size  # gate, up, down
    if c.moe is None:
        mlp = c.num_layers * dense_mlp
    else:
        m = c.moe
        sparse = c.hidden_size * m.num_experts + m.top_k * 3 * c.hidden_size * (
            m.expert_intermediate_size)
        mlp = len(m.dense_layers) * dense_mlp + (c.num_layers - len(m.dense_layers)) * sparse
    head = c.hidden_size * (c.vocab_size if c.head is HeadKind.LM else 1)
    return c.num_layers * attention + mlp + head


def stored_param_count(config: ModelConfig) -> int:
    """Parameters a checkpoint of `config` holds: `param_count` less the zero slots of a mixed
    dense/sparse model (the experts of its dense layers, the dense MLP of its sparse ones;
    models/moe.py)."""
    c, m = config, config.moe
    if m is None or not m.mixed:
        return param_count(c)
    dense, sparse = len(m.dense_layers), c.num_layers - len(m.dense_layers)
    experts = m.num_experts * (1 + 3 * m.expert_intermediate_size) * c.hidden_size
    return param_count(c) - dense * experts - sparse * 3 * c.hidden_size * c.intermediate_size
