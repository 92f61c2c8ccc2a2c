"""`python -m jaxrlhf.generate --json [--chat]` against transformers, per tokenizer convention.

Prompt ids must equal the transformers tokenizer's (`tok(PROMPT)` or `apply_chat_template`), and
greedy tokens/log-probs must equal `model.generate`'s on those ids.
"""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import tokenizers
import torch
import transformers

from hf_fixtures import make_tiny_hf_model
from tests.unit.test_chat import CHATML_TEMPLATE, LLAMA3_TEMPLATE

N_NEW = 5
PROMPT = "w7 w9 w11"


def _write_tokenizer(directory, vocab_size, convention):
    """Word-level tokenizer in `convention`: "llama3" (post-processor adds BOS, eot stop) or
    "qwen" (no BOS anywhere; config.json's bos_token_id names <|endoftext|>; im_end stop)."""
    if convention == "llama3":
        specials = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>",
                    "<|end_header_id|>", "<|eot_id|>"]
    else:
        specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    words = specials + ["user", "assistant", "system"]
    vocab = {t: i for i, t in enumerate(words)}
    vocab.update({f"w{i}": i for i in range(len(words), vocab_size)})
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token=specials[0]))
    backend.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    backend.add_special_tokens([tokenizers.AddedToken(s, special=True) for s in specials])
    config = json.loads((directory / "config.json").read_text())
    if convention == "llama3":
        backend.post_processor = tokenizers.processors.TemplateProcessing(
            single="<|begin_of_text|> $A", special_tokens=[("<|begin_of_text|>", 0)])
        tok_config = {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>",
                      "chat_template": LLAMA3_TEMPLATE}
        config.update(bos_token_id=0, eos_token_id=[1, 4])
        gen = {"eos_token_id": [1, 4]}
    else:
        tok_config = {"bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
                      "chat_template": CHATML_TEMPLATE}
        config.update(bos_token_id=0, eos_token_id=0)
        gen = {"eos_token_id": [2, 0]}
    backend.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(
        json.dumps({"tokenizer_class": "PreTrainedTokenizerFast", **tok_config}))
    (directory / "config.json").write_text(json.dumps(config))
    (directory / "generation_config.json").write_text(json.dumps(gen))
    # PreTrainedTokenizerFast on this directory: transformers' own reading of tokenizer.json.
    return transformers.PreTrainedTokenizerFast.from_pretrained(str(directory))


@pytest.mark.entry
@pytest.mark.parametrize("family,convention,chat", [
    # One case per family by default; the other two are slow (suite time).
    ("qwen2", "qwen", False), pytest.param("qwen2", "qwen", True, marks=pytest.mark.slow),
    ("llama", "llama3", True), pytest.param("qwen3", "qwen", False, marks=pytest.mark.slow),
    ("qwen3", "qwen", True)])
def test_generate_json_matches_transformers(tmp_path, family, convention, chat):
    path, hf_model = make_tiny_hf_model(tmp_path, family)
    hf_tok = _write_tokenizer(path, hf_model.config.vocab_size, convention)
    if chat:
        want_ids = hf_tok.apply_chat_template([{"role": "user", "content": PROMPT}],
                                              add_generation_prompt=True, tokenize=True)
        want_ids = list(want_ids["input_ids"] if hasattr(want_ids, "keys") else want_ids)
    else:
        want_ids = hf_tok(PROMPT).input_ids
    cmd = [sys.executable, "-m", "jaxrlhf.generate", f"--model={path}", f"--prompt={PROMPT}",
           "--max-new-tokens", str(N_NEW), "--temperature=0", "--ignore_eos", "--json",
           *(["--chat"] if chat else [])]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "JAX_PLATFORMS": "cpu"},
                          cwd=os.path.dirname(os.path.dirname(__file__)))
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout)
    assert result["prompt_token_ids"] == want_ids
    if convention == "qwen":
        assert want_ids[0] != 0  # config.json's bos_token_id is never prepended
    hf_model.generation_config.eos_token_id = None  # --ignore_eos
    with torch.no_grad():
        hf_out = hf_model.generate(
            torch.tensor([want_ids]), attention_mask=torch.ones(1, len(want_ids)),
            max_new_tokens=N_NEW, do_sample=False, pad_token_id=0, output_scores=True,
            return_dict_in_generate=True)
    hf_tokens = hf_out.sequences[0, len(want_ids):].tolist()
    assert result["token_ids"] == hf_tokens
    hf_logprobs = [torch.log_softmax(s[0], -1)[t].item() for s, t in zip(hf_out.scores, hf_tokens)]
    np.testing.assert_allclose(result["logprobs"], hf_logprobs, atol=1e-4, rtol=0)
