"""The generate call kind: sampling rules vs HF warpers, greedy vs HF `generate`, log-probs vs
inference, EOS handling, bucketing/compile counts, and sharded == single-device."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from transformers.generation import logits_process as hf_lp

from hf_fixtures import make_tiny_hf_model, padded_batch
from jaxrlhf.engine import sampling
from jaxrlhf.engine.decode_layers import LayerByLayer
from jaxrlhf.engine.generate import GenerateConfig, decode_model, make_generate_fn
from jaxrlhf.engine.inference import (
    InferenceBatch, InferenceConfig, InferenceKind, make_inference_fn,
)
from jaxrlhf.models import hf_io
from jaxrlhf.models.sizes import abstract_params
from jaxrlhf.models.transformer import Transformer
from jaxrlhf.parallel import make_layout

PAD = 0
# HF comparison: 32 greedy tokens after left-padded prompts of four lengths.
HF_NEW, HF_LENGTHS, HF_WIDTH = 32, [7, 3, 10, 5], 10
# Seeds/options with a varied greedy path (tied tiny Qwen2s just repeat one token); kv_heads=4
# lets the Llama split over t4.
HF_MODELS = {"llama": dict(seed=3, num_key_value_heads=4),
             "qwen2": dict(seed=2, tie_word_embeddings=False)}
# Sampling runs: 12 tokens at T=0.7 with top-k and top-p on.
N_NEW = 12
SAMPLE_LENGTHS, SAMPLE_WIDTH = [3, 9, 6, 1], 9
SAMPLE = dict(temperature=0.7, top_k=50, top_p=0.9)


class _Model:
    """A tiny random HF model loaded into our parameters on one device."""

    def __init__(self, tmp_path, family):
        path, self.hf_model = make_tiny_hf_model(tmp_path, family, **HF_MODELS[family])
        config = hf_io.load_hf_config(path, dtype=jnp.float32)
        self.layout = make_layout("0:d1", model=config)
        self.config, self.params = hf_io.load_hf(
            path, dtype=jnp.float32,
            shardings=self.layout.param_shardings(abstract_params(config)),
        )

    def generator(self, layout=None, **overrides):
        gen_config = GenerateConfig(**{"pad_token_id": PAD, **overrides})
        return make_generate_fn(self.config, gen_config, layout or self.layout)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return _Model(tmp_path_factory.mktemp("llama"), "llama")


def _hf_prompts(vocab_size):
    tokens_bt, mask_bt = padded_batch(vocab_size, HF_LENGTHS, HF_WIDTH,
                                      left_pad=[True] * len(HF_LENGTHS))
    return tokens_bt, mask_bt.astype(bool)


def _sample_prompts(vocab_size):
    tokens_bt, mask_bt = padded_batch(vocab_size, SAMPLE_LENGTHS, SAMPLE_WIDTH, seed=1,
                                      left_pad=[True] * len(SAMPLE_LENGTHS))
    return tokens_bt, mask_bt.astype(bool)


# ---- sampling rules against the HF warpers ----------------------------------------------


@pytest.mark.parametrize("k", [1, 5, 40])
def test_top_k_mask_matches_hf(k):
    logits = np.random.default_rng(k).normal(size=(3, 64)).astype(np.float32)
    want = hf_lp.TopKLogitsWarper(k)(None, torch.tensor(logits)).numpy()
    np.testing.assert_array_equal(np.asarray(sampling.top_k_mask(jnp.asarray(logits), k)), want)


@pytest.mark.parametrize("p", [1e-6, 0.3, 0.9])
def test_top_p_mask_matches_hf(p):
    logits = 3.0 * np.random.default_rng(7).normal(size=(4, 64)).astype(np.float32)
    want = hf_lp.TopPLogitsWarper(p)(None, torch.tensor(logits)).numpy()
    got = np.asarray(sampling.top_p_mask(jnp.asarray(logits), p))
    np.testing.assert_array_equal(np.isfinite(got), np.isfinite(want))
    np.testing.assert_array_equal(got[np.isfinite(got)], want[np.isfinite(want)])


def test_sample_draws_only_from_the_nucleus():
    logits_bv = jnp.asarray(np.random.default_rng(3).normal(size=(512, 32)), jnp.float32)
    params = sampling.SamplingParams(temperature=0.8, top_k=6, top_p=0.5)
    keys_b = jax.random.split(jax.random.key(0), 512)
    tokens_b = np.asarray(sampling.sample(logits_bv, keys_b, params))
    allowed_bv = np.isfinite(np.asarray(sampling.truncate(logits_bv, params)))
    assert allowed_bv[np.arange(512), tokens_b].all()
    assert 1 < len(np.unique(tokens_b))  # genuinely random, not argmax


def test_sample_frequencies_follow_the_truncated_distribution():
    logits_v = jnp.asarray([2.0, 1.5, 1.0, 0.5, 0.0, -1.0, -2.0, -3.0])
    params = sampling.SamplingParams(temperature=0.7, top_k=6, top_p=0.9)
    draws = 20000
    keys_b = jax.random.split(jax.random.key(1), draws)
    tokens_b = np.asarray(sampling.sample(jnp.tile(logits_v, (draws, 1)), keys_b, params))
    want = np.asarray(jax.nn.softmax(sampling.truncate(logits_v[None], params)))[0]
    assert (want == 0).sum() >= 3  # top-k and top-p both cut something
    freq = np.bincount(tokens_b, minlength=8) / draws
    np.testing.assert_allclose(freq, want, atol=0.015, rtol=0)


# ---- greedy decoding against Hugging Face --------------------------------------------------


def _hf_greedy(hf_model, tokens_bt, mask_bt, eos):
    """HF greedy responses [b, HF_NEW] (pad after EOS / after every row finished)."""
    hf_model.generation_config.eos_token_id = eos
    with torch.no_grad():
        out = hf_model.generate(
            torch.from_numpy(tokens_bt.astype(np.int64)),
            attention_mask=torch.from_numpy(mask_bt.astype(np.int64)),
            max_new_tokens=HF_NEW, do_sample=False, pad_token_id=PAD,
        )
    response = out[:, tokens_bt.shape[1]:].numpy()
    return np.pad(response, ((0, 0), (0, HF_NEW - response.shape[1])), constant_values=PAD)


def _greedy_vs_hf(model: _Model):
    """(our greedy generator, its output, HF's output, eos) on the HF prompts.

    EOS is a token HF's free-running row 0 emits after step 8, so row 0 stops early.
    """
    tokens_bt, mask_bt = _hf_prompts(model.config.vocab_size)
    free = _hf_greedy(model.hf_model, tokens_bt, mask_bt, eos=None)
    assert all(len(set(row)) > 8 for row in free), "fixture: greedy path is degenerate"
    eos = next(int(t) for t in free[0, 8:] if t != PAD)
    want = _hf_greedy(model.hf_model, tokens_bt, mask_bt, eos=eos)
    generator = model.generator(max_new_tokens=HF_NEW, eos_token_id=eos, temperature=0.0)
    out = generator(model.params, tokens_bt, mask_bt, jax.random.key(0))
    lengths = np.asarray(out.response_lengths_b)
    assert lengths[0] == list(free[0]).index(eos) + 1 < HF_NEW
    return generator, out, want, eos


@pytest.fixture(scope="module")
def llama_greedy(llama):
    return _greedy_vs_hf(llama)


def test_greedy_equals_hf_generate_llama(llama_greedy):
    _, out, want, _ = llama_greedy
    np.testing.assert_array_equal(np.asarray(out.response_bn), want)


def test_greedy_equals_hf_generate_qwen2(tmp_path):
    _, out, want, _ = _greedy_vs_hf(_Model(tmp_path, "qwen2"))
    np.testing.assert_array_equal(np.asarray(out.response_bn), want)


def test_greedy_tokens_are_argmax_of_a_full_forward(llama, llama_greedy):
    """Each greedy token is the argmax of an uncached forward over the sequence so far, and its
    log-prob is that forward's log-softmax at T=1."""
    _, out, _, _ = llama_greedy
    batch = InferenceBatch.padded(np.asarray(out.sequences_bs), np.asarray(out.sequence_mask_bs))
    forward = jax.jit(lambda p, b: Transformer(llama.config).apply({"params": p}, *b)[0])
    prompt_len = out.prompt_mask_bp.shape[1]
    logits_bnv = np.asarray(forward(llama.params, batch), np.float64)[:, prompt_len - 1 : -1]
    mask = np.asarray(out.response_mask_bn)
    response = np.asarray(out.response_bn)
    np.testing.assert_array_equal(np.argmax(logits_bnv, -1)[mask], response[mask])
    logp_bnv = logits_bnv - np.log(np.exp(logits_bnv).sum(-1, keepdims=True))
    want = np.take_along_axis(logp_bnv, response[..., None], -1)[..., 0]
    np.testing.assert_allclose(np.asarray(out.logprobs_bn)[mask], want[mask], atol=1e-5, rtol=0)


def test_top_k_1_and_tiny_top_p_equal_greedy(llama, llama_greedy):
    _, greedy, _, eos = llama_greedy
    for overrides in (dict(top_k=1), dict(top_p=1e-6)):
        generator = llama.generator(max_new_tokens=HF_NEW, eos_token_id=eos, temperature=1.0,
                                    **overrides)
        out = generator(llama.params, *_hf_prompts(llama.config.vocab_size), jax.random.key(5))
        np.testing.assert_array_equal(np.asarray(out.response_bn), np.asarray(greedy.response_bn))
        np.testing.assert_allclose(np.asarray(out.logprobs_bn), np.asarray(greedy.logprobs_bn),
                                   atol=1e-6, rtol=0)


def test_compiles_once_per_prompt_bucket(llama, llama_greedy):
    """The greedy run compiled bucket 16's engine calls; a 13-token prompt reuses them, a
    17-token one compiles bucket 32's."""
    generator, first, _, _ = llama_greedy
    assert first.sequences_bs.shape == (4, 16 + HF_NEW)
    vocab = llama.config.vocab_size
    compiled = generator.compiles
    for width, bucket in ((13, 16), (17, 32)):
        tokens_bt, mask_bt = padded_batch(vocab, [width, 2, 5, 1], width, left_pad=[True] * 4)
        out = generator(llama.params, tokens_bt, mask_bt.astype(bool), jax.random.key(1))
        assert (generator.compiles > compiled) == (bucket == 32)
        assert out.sequences_bs.shape == (4, bucket + HF_NEW)


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="layer by layer is XLA:CPU's "
                    "decode; accelerators decode the stack the layout gives")
def test_a_model_trained_unrolled_decodes_layer_by_layer_on_cpu(llama, llama_greedy):
    """Scanned or not (`scan_layers=False`: a train step unrolled for speed), a model decodes
    layer by layer on XLA:CPU (`decode_model`, `engine.decode_layers`), on the same parameter
    tree, with the scanned model's greedy tokens and log-probs."""
    unrolled = llama.config.replace(scan_layers=False)
    assert llama.config.scan_layers
    for config in (llama.config, unrolled):
        assert isinstance(decode_model(config, llama.layout).layer_stack, LayerByLayer)
    _, greedy, _, eos = llama_greedy
    generator = make_generate_fn(unrolled, GenerateConfig(
        max_new_tokens=HF_NEW, eos_token_id=eos, temperature=0.0, pad_token_id=PAD), llama.layout)
    out = generator(llama.params, *_hf_prompts(llama.config.vocab_size), jax.random.key(0))
    np.testing.assert_array_equal(np.asarray(out.response_bn), np.asarray(greedy.response_bn))
    np.testing.assert_array_equal(np.asarray(out.logprobs_bn), np.asarray(greedy.logprobs_bn))


# ---- sampling: log-probs, EOS, sharding ---------------------------------------------------


@pytest.fixture(scope="module")
def forced_sample(llama):
    """Sampling that ignores EOS, on one device."""
    generator = llama.generator(max_new_tokens=N_NEW, eos_token_id=PAD, force_max_length=True,
                                **SAMPLE)
    return generator(llama.params, *_sample_prompts(llama.config.vocab_size), jax.random.key(1))


@pytest.fixture(scope="module")
def sharded_forced_sample(llama):
    """The same sampling on 8 devices (d2t4)."""
    layout8 = make_layout("0-7:d2t4", model=llama.config)
    params8 = jax.device_put(llama.params, layout8.param_shardings(abstract_params(llama.config)))
    generator = llama.generator(layout8, max_new_tokens=N_NEW, eos_token_id=PAD,
                                force_max_length=True, **SAMPLE)
    return generator(params8, *_sample_prompts(llama.config.vocab_size), jax.random.key(1))


def _early_token(row, avoid):
    """A token `row` emits within 5 steps that `avoid` never emits (nor PAD)."""
    token = next((int(t) for t in row[:5] if t != PAD and t not in avoid), None)
    assert token is not None, "fixture: no usable stop-token candidate"
    return token


@pytest.fixture(scope="module")
def eos_sample(llama, forced_sample):
    """The same sampling with two stop ids: one that row 0 emits early, one that row 2 emits
    early; row 1 emits neither."""
    forced = np.asarray(forced_sample.response_bn)
    stop_ids = (_early_token(forced[0], forced[1]), _early_token(forced[2], forced[1]))
    generator = llama.generator(max_new_tokens=N_NEW, eos_token_id=stop_ids, **SAMPLE)
    out = generator(llama.params, *_sample_prompts(llama.config.vocab_size), jax.random.key(1))
    return out, stop_ids


def test_eos_stops_rows_and_masks_the_rest(eos_sample, forced_sample):
    out, stop_ids = eos_sample
    forced = np.asarray(forced_sample.response_bn)
    stops_at = [next((i for i, t in enumerate(row) if t in stop_ids), None) for row in forced]
    want_lengths = [N_NEW if i is None else i + 1 for i in stops_at]
    assert want_lengths[0] < N_NEW and want_lengths[2] < N_NEW and want_lengths[1] == N_NEW
    lengths, mask = np.asarray(out.response_lengths_b), np.asarray(out.response_mask_bn)
    response, logprobs = np.asarray(out.response_bn), np.asarray(out.logprobs_bn)
    np.testing.assert_array_equal(lengths, want_lengths)
    np.testing.assert_array_equal(mask, np.arange(N_NEW)[None] < lengths[:, None])
    assert (response[~mask] == PAD).all() and (logprobs[~mask] == 0).all()
    assert (logprobs[mask] < 0).all()
    prompt_len = out.prompt_mask_bp.shape[1]
    np.testing.assert_array_equal(np.asarray(out.sequences_bs)[:, prompt_len:], response)


@pytest.mark.devices(8)
def test_sharded_sampling_equals_single_device(eos_sample, forced_sample, sharded_forced_sample):
    """Same keys, same tokens: the 8-device run equals the 1-device runs (forced to the end,
    and up to each row's EOS)."""
    np.testing.assert_array_equal(np.asarray(sharded_forced_sample.response_bn),
                                  np.asarray(forced_sample.response_bn))
    np.testing.assert_allclose(np.asarray(sharded_forced_sample.logprobs_bn),
                               np.asarray(forced_sample.logprobs_bn), atol=1e-5, rtol=0)
    out, _ = eos_sample
    assert sharded_forced_sample.response_bn.sharding.spec[0] in ("data", ("data", "fsdp"))
    assert len(sharded_forced_sample.response_bn.sharding.device_set) == 8
    mask = np.asarray(out.response_mask_bn)
    np.testing.assert_array_equal(np.asarray(sharded_forced_sample.response_bn)[mask],
                                  np.asarray(out.response_bn)[mask])
    np.testing.assert_allclose(np.asarray(sharded_forced_sample.logprobs_bn)[mask],
                               np.asarray(out.logprobs_bn)[mask], atol=1e-5, rtol=0)


def test_generation_logprobs_equal_inference_logprobs(llama, eos_sample):
    out, _ = eos_sample
    infer = make_inference_fn(
        llama.config, InferenceConfig(InferenceKind.LOGPROBS, temperature=SAMPLE["temperature"]),
        llama.layout,
    )
    batch = InferenceBatch.padded(np.asarray(out.sequences_bs), np.asarray(out.sequence_mask_bs))
    prompt_len = out.prompt_mask_bp.shape[1]
    recomputed = np.asarray(infer(llama.params, batch).logprobs_bt)[:, prompt_len:]
    np.testing.assert_allclose(recomputed, np.asarray(out.logprobs_bn), atol=1e-5, rtol=0)
