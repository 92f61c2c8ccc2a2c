"""Tiny random Hugging Face Llama / Qwen2 / Qwen3 / Qwen3-MoE / Mixtral / Mistral / Gemma 3 models
built in-process (nothing is downloaded).

Reusable by any HF comparison test:

    path, hf_model = make_tiny_hf_model(tmp_path, "llama")
    tokens_bt, mask_bt = padded_batch(vocab_size, lengths=[6, 3, 8], seq_len=8,
                                      left_pad=[True, False, True])
    ref_btv = hf_logits(hf_model, tokens_bt, mask_bt)

Models are fp32 on CPU with eager attention so the reference is exact. Every parameter
(norm scales and q/k/v biases included) is randomised at a scale that gives O(1) activations,
so a wrong transpose, bias or norm shows up in the logits.
"""

from __future__ import annotations

import copy
import pathlib
from collections.abc import Sequence

import numpy as np
import torch
import transformers

# Llama: GQA, untied, Llama-3 RoPE scaling with a short original context so that the head_dim
# 16 frequencies fall in all three bands (kept, smoothed, divided by `factor`).
_LLAMA = dict(
    vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
    rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False,
    rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                      original_max_position_embeddings=32),
)
# Qwen2: q/k/v bias, tied embeddings, GQA with a different group size.
_QWEN2 = dict(
    vocab_size=112, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
    num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=256,
    rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=True,
)
# Qwen3: per-head q/k RMSNorm, no q/k/v bias, head_dim set apart from hidden/heads, untied.
_QWEN3 = dict(
    vocab_size=104, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=24, max_position_embeddings=256,
    rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=False,
)
# Qwen3-MoE: Qwen3's attention, 8 experts of width 32, 2 a token; the dense width (used by
# `mlp_only_layers` / `decoder_sparse_step` layers) differs from the experts'.
_QWEN3_MOE = dict(_QWEN3, num_hidden_layers=3, moe_intermediate_size=32, num_experts=8,
                  num_experts_per_tok=2, norm_topk_prob=True)
# Mixtral: Llama's attention (GQA, untied), 4 experts of `intermediate_size`, top-2.
_MIXTRAL = dict(
    vocab_size=96, hidden_size=64, intermediate_size=48, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
    rms_norm_eps=1e-5, rope_theta=1000000.0, tie_word_embeddings=False, num_local_experts=4,
    num_experts_per_tok=2,
)
# Mistral: Llama's block with a sliding window (3 slots) shorter than the test sequences.
_MISTRAL = dict(
    vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
    rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False, sliding_window=3,
)
# Gemma 3 (text): local layers 0 and 2 with a 3-slot window and their own RoPE base, global
# layer 1 with linear RoPE scaling; head_dim 24 apart from hidden/heads, query_pre_attn_scalar
# apart from head_dim, the final softcap low enough to bite (transformers' Gemma 3 applies no
# attention softcap: attn_logit_softcapping stays null). Untied: random tied embeddings make
# greedy decoding repeat the last token (the tied head is tested with Qwen2).
_GEMMA3 = dict(
    vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
    num_attention_heads=4, num_key_value_heads=2, head_dim=24, max_position_embeddings=256,
    rms_norm_eps=1e-6, rope_theta=1000000.0, rope_local_base_freq=100.0,
    rope_scaling=dict(rope_type="linear", factor=4.0), sliding_window=3,
    layer_types=["sliding_attention", "full_attention", "sliding_attention"],
    query_pre_attn_scalar=16, final_logit_softcapping=4.0,
    hidden_activation="gelu_pytorch_tanh", tie_word_embeddings=False,
)
FAMILIES = {"llama": (transformers.LlamaConfig, _LLAMA), "qwen2": (transformers.Qwen2Config, _QWEN2),
            "qwen3": (transformers.Qwen3Config, _QWEN3),
            "qwen3_moe": (transformers.Qwen3MoeConfig, _QWEN3_MOE),
            "mixtral": (transformers.MixtralConfig, _MIXTRAL),
            "mistral": (transformers.MistralConfig, _MISTRAL),
            "gemma3": (transformers.Gemma3TextConfig, _GEMMA3)}


def tiny_hf_config(family: str, *, num_labels: int | None = None, **overrides):
    """A transformers config for a tiny model of `family` ("llama" | "qwen2" | "qwen3")."""
    config_cls, base = FAMILIES[family]
    kwargs = {**base, **overrides}
    if num_labels is not None:
        kwargs.update(num_labels=num_labels, pad_token_id=0)
    return config_cls(**kwargs)


def randomize_(model: torch.nn.Module, seed: int) -> None:
    """Overwrites every parameter with random values at O(1)-activation scales."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float32)
            if name.endswith("norm.weight") and isinstance(model.config,
                                                           transformers.Gemma3TextConfig):
                p.copy_(0.2 * noise)  # Gemma's norms scale by (1 + w)
            elif name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * noise)
            elif name.endswith("bias"):
                p.copy_(0.5 * noise)
            elif "embed_tokens" in name:
                p.copy_(0.5 * noise)
            else:  # Linear [out, in], or experts stacked [experts, out, in]
                p.copy_(noise / np.sqrt(p.shape[-1]))


def make_tiny_hf_model(
    tmp_path: pathlib.Path,
    family: str = "llama",
    *,
    seq_cls: bool = False,
    save_dtype: torch.dtype = torch.float32,
    max_shard_size: str | None = None,
    seed: int = 0,
    **overrides,
):
    """Builds, randomises and saves a tiny HF model; returns (checkpoint dir, fp32 eval model).

    Args:
      tmp_path: parent directory; the checkpoint goes to `tmp_path / f"hf_{family}..."`.
      family: "llama", "qwen2", "qwen3", "qwen3_moe" or "mixtral" (experts saved in the Hub's
        per-expert layout, as transformers writes them whatever it holds in memory).
      seq_cls: a one-label *ForSequenceClassification (critic/reward layout) instead of a
        causal LM.
      save_dtype: dtype of the saved safetensors (e.g. torch.bfloat16); the returned model is
        fp32 with exactly the saved values (so bf16 checkpoints compare exactly too).
      max_shard_size: e.g. "60KB" to force a sharded checkpoint with an index file.
      seed: parameter seed.
      **overrides: config fields, e.g. tie_word_embeddings=False.
    """
    config = tiny_hf_config(family, num_labels=1 if seq_cls else None, **overrides)
    model_cls = (transformers.AutoModelForSequenceClassification if seq_cls
                 else transformers.AutoModelForCausalLM)
    torch.manual_seed(seed)
    model = model_cls.from_config(config, attn_implementation="eager", dtype=torch.float32)
    randomize_(model, seed)
    with torch.no_grad():  # parameters only: casting the whole model would round RoPE buffers
        for p in model.parameters():
            p.copy_(p.to(save_dtype).to(torch.float32))
    suffix = f"_{'cls' if seq_cls else 'lm'}_{str(save_dtype).removeprefix('torch.')}"
    path = tmp_path / f"hf_{family}{suffix}"
    kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    copy.deepcopy(model).to(save_dtype).save_pretrained(path, **kwargs)
    return path, model.eval()


def padded_batch(
    vocab_size: int, lengths: Sequence[int], seq_len: int, *, left_pad: Sequence[bool],
    seed: int = 0,
) -> tuple[np.ndarray, np.ndarray]:
    """Random tokens with per-row padding.

    Returns:
      tokens_bt int32 [batch, seq_len] (pads hold token 0), mask_bt int32 [batch, seq_len]
      with 1 on the `lengths[b]` valid tokens, at the end of the row when `left_pad[b]`.
    """
    rng = np.random.default_rng(seed)
    tokens_bt = rng.integers(1, vocab_size, (len(lengths), seq_len)).astype(np.int32)
    mask_bt = np.zeros((len(lengths), seq_len), np.int32)
    for b, (n, left) in enumerate(zip(lengths, left_pad)):
        if left:
            mask_bt[b, seq_len - n:] = 1
        else:
            mask_bt[b, :n] = 1
    return tokens_bt * mask_bt, mask_bt


def positions_from_mask(mask_bt: np.ndarray) -> np.ndarray:
    """RoPE positions as HF generation builds them: cumsum(mask) - 1, pads set to 1."""
    positions_bt = np.cumsum(mask_bt, axis=-1) - 1
    return np.where(mask_bt == 0, 1, positions_bt).astype(np.int32)


def _torch_inputs(tokens_bt: np.ndarray, mask_bt: np.ndarray) -> dict:
    return dict(
        input_ids=torch.from_numpy(np.asarray(tokens_bt, np.int64)),
        attention_mask=torch.from_numpy(np.asarray(mask_bt, np.int64)),
        position_ids=torch.from_numpy(positions_from_mask(mask_bt).astype(np.int64)),
    )


def hf_logits(model, tokens_bt: np.ndarray, mask_bt: np.ndarray) -> np.ndarray:
    """float32 [batch, len, vocab] logits of a HF causal LM (padding rows are garbage)."""
    with torch.no_grad():
        return model(**_torch_inputs(tokens_bt, mask_bt)).logits.float().numpy()


def hf_token_scores(model, tokens_bt: np.ndarray, mask_bt: np.ndarray) -> np.ndarray:
    """float32 [batch, len]: a one-label sequence classifier's score at every token."""
    with torch.no_grad():
        hidden_btd = model.model(**_torch_inputs(tokens_bt, mask_bt)).last_hidden_state
        return model.score(hidden_btd)[..., 0].float().numpy()
