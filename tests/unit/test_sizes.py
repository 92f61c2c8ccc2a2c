"""Registered released-model sizes have the published shapes and parameter counts."""

import pytest
import torch
import transformers

from jaxrlhf.models.hf_config import hf_config_to_model_config
from jaxrlhf.models.sizes import get_size, param_count

# Totals of the released safetensors (tied embeddings counted once).
PUBLISHED = {
    "qwen2.5-0.5b": 494_032_768,
    "qwen2.5-1.5b": 1_543_714_304,
    "llama-3.2-1b": 1_235_814_400,
    "llama-3.2-3b": 3_212_749_824,
    "llama-3.1-8b": 8_030_261_248,
    "qwen3-0.6b": 596_049_920,
    "gemma3-1b": 999_885_952,
    "mistral-7b": 7_241_732_096,
}

# The architecture keys of the released Qwen3 config.json files (Qwen/Qwen3-*).
_QWEN3_COMMON = dict(
    architectures=["Qwen3ForCausalLM"], model_type="qwen3", attention_bias=False, head_dim=128,
    hidden_act="silu", max_position_embeddings=40960, num_key_value_heads=8,
    rms_norm_eps=1e-06, rope_scaling=None, rope_theta=1000000, sliding_window=None,
    use_sliding_window=False, vocab_size=151936,
)
QWEN3_CONFIGS = {
    "qwen3-0.6b": dict(hidden_size=1024, intermediate_size=3072, num_attention_heads=16,
                       num_hidden_layers=28, tie_word_embeddings=True),
    "qwen3-1.7b": dict(hidden_size=2048, intermediate_size=6144, num_attention_heads=16,
                       num_hidden_layers=28, tie_word_embeddings=True),
    "qwen3-4b": dict(hidden_size=2560, intermediate_size=9728, num_attention_heads=32,
                     num_hidden_layers=36, tie_word_embeddings=True),
    "qwen3-8b": dict(hidden_size=4096, intermediate_size=12288, num_attention_heads=32,
                     num_hidden_layers=36, tie_word_embeddings=False),
}
# Model cards' totals and non-embedding counts in billions, as printed (rounded to those digits).
QWEN3_CARDS = {"qwen3-0.6b": ("0.6", "0.44"), "qwen3-1.7b": ("1.7", "1.4"),
               "qwen3-4b": ("4.0", "3.6"), "qwen3-8b": ("8.2", "6.95")}


def _printed(count: int, figure: str) -> str:
    """`count` in billions printed with as many decimals as `figure`."""
    return f"{count / 1e9:.{len(figure.split('.')[1])}f}"


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_param_count_matches_published(name):
    assert param_count(get_size(name)) == PUBLISHED[name]


@pytest.mark.parametrize("name", sorted(QWEN3_CONFIGS))
def test_qwen3_sizes_are_the_released_configs(name):
    """Our size equals the import of the released config.json, and has exactly as many
    parameters as transformers' Qwen3ForCausalLM of that config (built without memory)."""
    hf = {**_QWEN3_COMMON, **QWEN3_CONFIGS[name]}
    config = get_size(name)
    assert hf_config_to_model_config(hf) == config
    with torch.device("meta"):
        model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**hf))
    hf_count = sum(p.numel() for p in model.parameters())  # shared tensors appear once
    assert param_count(config) == hf_count
    total, non_embedding = QWEN3_CARDS[name]
    embedding = config.vocab_size * config.hidden_size * (1 if config.tie_word_embeddings else 2)
    assert _printed(hf_count, total) == total
    assert _printed(hf_count - embedding, non_embedding) == non_embedding


# The architecture keys of released config.json files: google/gemma-3-1b-it, the text_config of
# google/gemma-3-4b-it (older spelling: sliding_window_pattern, rope_local_base_freq), and
# mistralai/Mistral-7B-v0.1.
_GEMMA3_COMMON = dict(
    architectures=["Gemma3ForCausalLM"], model_type="gemma3_text", attention_bias=False,
    attn_logit_softcapping=None, final_logit_softcapping=None, head_dim=256,
    hidden_activation="gelu_pytorch_tanh", query_pre_attn_scalar=256, rms_norm_eps=1e-06,
    rope_local_base_freq=10000, rope_theta=1000000, sliding_window_pattern=6,
)
RELEASED_CONFIGS = {
    "gemma3-1b": dict(_GEMMA3_COMMON, hidden_size=1152, intermediate_size=6912,
                      num_attention_heads=4, num_hidden_layers=26, num_key_value_heads=1,
                      max_position_embeddings=32768, rope_scaling=None, sliding_window=512,
                      vocab_size=262144),
    "gemma3-4b": dict(_GEMMA3_COMMON, hidden_size=2560, intermediate_size=10240,
                      num_attention_heads=8, num_hidden_layers=34, num_key_value_heads=4,
                      max_position_embeddings=131072, sliding_window=1024, vocab_size=262208,
                      rope_scaling={"factor": 8.0, "rope_type": "linear"}),
    "mistral-7b": dict(architectures=["MistralForCausalLM"], model_type="mistral",
                       hidden_act="silu", hidden_size=4096, intermediate_size=14336,
                       max_position_embeddings=32768, num_attention_heads=32,
                       num_hidden_layers=32, num_key_value_heads=8, rms_norm_eps=1e-05,
                       rope_theta=10000.0, sliding_window=4096, tie_word_embeddings=False,
                       vocab_size=32000),
}


@pytest.mark.parametrize("name", sorted(RELEASED_CONFIGS))
def test_window_sizes_are_the_released_configs(name):
    """Our Gemma 3 and Mistral sizes equal the import of the released config.json, and have
    exactly as many parameters as transformers' model of that config (built without memory)."""
    hf = RELEASED_CONFIGS[name]
    config = get_size(name)
    assert hf_config_to_model_config(hf) == config
    cls, config_cls = {"gemma3_text": (transformers.Gemma3ForCausalLM,
                                       transformers.Gemma3TextConfig),
                       "mistral": (transformers.MistralForCausalLM,
                                   transformers.MistralConfig)}[hf["model_type"]]
    with torch.device("meta"):
        model = cls(config_cls(**{k: v for k, v in hf.items() if k != "architectures"}))
    assert param_count(config) == sum(p.numel() for p in model.parameters())
    if hf["model_type"] == "gemma3_text":  # every sixth layer global
        assert [i for i in range(config.num_layers) if i not in config.sliding_layers] == [
            i for i, t in enumerate(model.config.layer_types) if t == "full_attention"]
