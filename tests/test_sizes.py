"""Registered released-model sizes have the published parameter counts (jax.eval_shape)."""

import pytest

from jaxrlhf.models.sizes import get_size, param_count

# Totals of the released safetensors (tied embeddings counted once).
PUBLISHED = {
    "qwen2.5-0.5b": 494_032_768,
    "qwen2.5-1.5b": 1_543_714_304,
    "llama-3.2-1b": 1_235_814_400,
    "llama-3.2-3b": 3_212_749_824,
    "llama-3.1-8b": 8_030_261_248,
}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_param_count_matches_published(name):
    assert param_count(get_size(name)) == PUBLISHED[name]
