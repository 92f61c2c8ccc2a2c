"""`python -m jaxrlhf.generate` end to end on a tiny exported HF Llama, against HF greedy."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import tokenizers
import torch

from hf_fixtures import make_tiny_hf_model

N_NEW = 8
PROMPT = "w5 w17 w42 w9"


def _write_word_tokenizer(directory, vocab_size):
    """A whitespace word-level tokenizer: [PAD]=0, [BOS]=1, [EOS]=2 (LlamaConfig's ids), then
    w3..w{vocab-1}; unknown words map to [PAD]."""
    vocab = {"[PAD]": 0, "[BOS]": 1, "[EOS]": 2}
    vocab.update({f"w{i}": i for i in range(3, vocab_size)})
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[PAD]"))
    backend.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    # Llama convention: the post-processor places BOS (transformers and jaxrlhf both follow it).
    backend.post_processor = tokenizers.processors.TemplateProcessing(
        single="[BOS] $A", special_tokens=[("[BOS]", 1)])
    backend.add_special_tokens(["[PAD]", "[BOS]", "[EOS]"])
    backend.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "[BOS]", "eos_token": "[EOS]", "pad_token": "[PAD]"})
    )
    return backend


def greedy_tokens_and_hf(path, hf_model, layout: str, new_tokens: int = 16,
                         prompt: str = PROMPT) -> tuple[list[int], list[int]]:
    """`python -m jaxrlhf.generate`'s greedy tokens on the HF directory `path` (its word
    tokenizer written here) on `layout`, and transformers' `generate` on `hf_model`; both ignore
    EOS. Asserts transformers' path is not degenerate (more than 6 distinct tokens)."""
    backend = _write_word_tokenizer(path, hf_model.config.vocab_size)
    cmd = [sys.executable, "-m", "jaxrlhf.generate", f"--model={path}", f"--prompt={prompt}",
           f"--max-new-tokens={new_tokens}", "--temperature=0", "--ignore_eos",
           f"--layout={layout}", "--json"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "JAX_PLATFORMS": "cpu"},
                          cwd=os.path.dirname(os.path.dirname(__file__)))
    assert proc.returncode == 0, proc.stderr[-3000:]
    prompt_ids = backend.encode(prompt).ids
    hf_model.generation_config.eos_token_id = None
    with torch.no_grad():
        hf_out = hf_model.generate(torch.tensor([prompt_ids]),
                                   attention_mask=torch.ones(1, len(prompt_ids)),
                                   max_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    hf_tokens = hf_out[0, len(prompt_ids):].tolist()
    assert len(set(hf_tokens)) > 6, "fixture: greedy path is degenerate"
    return json.loads(proc.stdout)["token_ids"], hf_tokens


@pytest.mark.entry
def test_cli_json_greedy_matches_hf(tmp_path):
    path, hf_model = make_tiny_hf_model(tmp_path, "llama")
    backend = _write_word_tokenizer(path, hf_model.config.vocab_size)
    cmd = [
        sys.executable, "-m", "jaxrlhf.generate", f"--model={path}", f"--prompt={PROMPT}",
        "--max-new-tokens", str(N_NEW), "--temperature=0", "--ignore_eos", "--layout=0-1:t2",
        "--json",
    ]
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300,
                          cwd=os.path.dirname(os.path.dirname(__file__)))
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout)  # exactly one JSON object on stdout
    assert len(result["token_ids"]) == len(result["logprobs"]) == N_NEW
    prompt_ids = backend.encode(PROMPT).ids  # the post-processor puts BOS first
    assert prompt_ids[0] == 1
    assert result["prompt_token_ids"] == prompt_ids

    hf_model.generation_config.eos_token_id = None  # --ignore_eos
    with torch.no_grad():
        hf_out = hf_model.generate(
            torch.tensor([prompt_ids]), attention_mask=torch.ones(1, len(prompt_ids)),
            max_new_tokens=N_NEW, do_sample=False, pad_token_id=0, output_scores=True,
            return_dict_in_generate=True,
        )
    hf_tokens = hf_out.sequences[0, len(prompt_ids):].tolist()
    assert result["token_ids"] == hf_tokens
    hf_logprobs = [
        torch.log_softmax(scores[0], -1)[token].item()
        for scores, token in zip(hf_out.scores, hf_tokens)
    ]
    np.testing.assert_allclose(result["logprobs"], hf_logprobs, atol=1e-5, rtol=0)
    assert result["text"] == backend.decode(hf_tokens, skip_special_tokens=True)


@pytest.mark.entry
@pytest.mark.parametrize("case", ["no_tokenizer", "bad_layout", "no_chat_template"])
def test_cli_bad_input_is_one_line_naming_the_flag(tmp_path, case):
    """A directory, layout or --chat that cannot work: `error: --FLAG...: problem` in one line,
    exit code 2, no traceback."""
    path, hf_model = make_tiny_hf_model(tmp_path, "llama")
    if case != "no_tokenizer":
        _write_word_tokenizer(path, hf_model.config.vocab_size)
    flag = {"no_tokenizer": [], "bad_layout": ["--layout=0-1:t3"],
            "no_chat_template": ["--chat"]}[case]
    expected = {"no_tokenizer": f"error: --model={path}: no tokenizer.json in {path}",
                "bad_layout": "error: --layout=0-1:t3: ",
                "no_chat_template": f"error: --chat: {path} has no chat_template"}[case]
    proc = subprocess.run(
        [sys.executable, "-m", "jaxrlhf.generate", f"--model={path}", f"--prompt={PROMPT}", *flag],
        capture_output=True, text=True, env={**os.environ, "JAX_PLATFORMS": "cpu"}, timeout=300,
        cwd=os.path.dirname(os.path.dirname(__file__)))
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(expected), proc.stderr[-3000:]
