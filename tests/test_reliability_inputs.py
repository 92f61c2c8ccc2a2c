"""Checked too late or not at all (issue: Reliability III): each of these compiled, then died
or ran wrong; now each is one line `FIELD: problem` from the checks, before anything compiles
(`run.check.check_config`; `python -m jaxrlhf.generate` for its prompt; the real command once,
for the exit code and the line on stderr).
"""

import json
import os
import pathlib
import subprocess
import sys

import jax
import numpy as np
import pytest
import tokenizers
from safetensors.numpy import save_file

from jaxrlhf.generate import check_length
from jaxrlhf.run.check import check_config
from jaxrlhf.schema import ConfigError, base_config

REPO = pathlib.Path(__file__).resolve().parent.parent


def _rows(path: pathlib.Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _write(path: pathlib.Path, text: str) -> pathlib.Path:
    path.write_text(text)
    return path


def _hf_dir(path: pathlib.Path, *, config: str | None = None, truncated: bool = False,
            positions: int = 64) -> pathlib.Path:
    """A Llama directory for the byte tokenizer (272 ids): config.json and real weights."""
    path.mkdir()
    (path / "config.json").write_text(config if config is not None else json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 272,
        "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1,
        "num_attention_heads": 2, "num_key_value_heads": 1, "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0, "max_position_embeddings": positions, "hidden_act": "silu",
        "tie_word_embeddings": True}))
    save_file({"model.embed_tokens.weight": np.zeros((272, 16), np.float32),
               "model.norm.weight": np.ones(16, np.float32)}, str(path / "model.safetensors"))
    if truncated:
        data = (path / "model.safetensors").read_bytes()
        (path / "model.safetensors").write_bytes(data[: len(data) // 2])
    return path


# (id, overrides as {dotted key: value} or a function of tmp_path, expected message)
CASES = [
    ("rows_without_answers", lambda tmp: {"data.train_path": _rows(tmp / "train.jsonl", [
        {"prompt": "12>", "answer": "21"}] + [{"prompt": f"{i}>"} for i in range(7)]),
        "rollout.batch_size": 8},
     "data.train_path: 7 of 8 prompt rows of {tmp}/train.jsonl have no answer (row 1 first), "
     "which reward.function='exact_match' scores against"),
    ("new_tokens_past_positions", {"rollout.max_new_tokens": 100000},
     "rollout.max_new_tokens=100000: with rollout.max_prompt_len=16 a sequence has 100016 "
     "tokens, more than the 512 positions of models.actor (max_position_embeddings)"),
    ("new_tokens_just_past_positions", {"rollout.max_new_tokens": 600}, "600: with "),
    ("infinite_temperature", {"rollout.temperature": float("inf")},
     "rollout.temperature=inf: must be a finite number"),
    ("nan_learning_rate", {"optimizer.actor.lr": float("nan")},
     "optimizer.actor.lr=nan: must be a finite number"),
    ("negative_seed", {"seed": -1}, "seed=-1: must be >= 0"),
    ("seed_past_32_bits", {"seed": 2**32}, "seed=4294967296: must be < 4294967296"),
    ("reward_module_syntax_error", lambda tmp: {"reward.function": str(_write(
        tmp / "bad.py", "def score(prompt, completion, answer)\n    return 1.0\n")) + ":score"},
     "reward.function: reward '{tmp}/bad.py:score': {tmp}/bad.py:1: SyntaxError: expected ':'"),
    ("reward_module_fails_at_import", lambda tmp: {"reward.function": str(_write(
        tmp / "boom.py", "import json\nTABLE = json.loads('{{')\n")) + ":score"},
     "reward.function: reward '{tmp}/boom.py:score': importing {tmp}/boom.py failed at "),
    ("reward_function_of_wrong_arity", lambda tmp: {"reward.function": str(_write(
        tmp / "two.py", "def score(prompt, completion):\n    return 1.0\n")) + ":score"},
     "reward.function: reward '{tmp}/two.py:score': score(prompt, completion) cannot be called "
     "as score(prompt, completion, answer)"),
    ("strategy_ignored_by_split", {"placement.kind": "split", "placement.strategy": "d2t4"},
     "placement.strategy='d2t4': placement.kind=split ignores it (colocate reads it"),
    ("mfc_twice_in_allocation", {"placement.kind": "manual", "placement.allocation":
                                 "actor_gen=0-3:d4,actor_gen=4-7:d4,ref_inf=0-7:d8,"
                                 "critic_inf=0-7:d8,actor_train=0-7:d8,critic_train=0-7:d8"},
     "placement.allocation names 'actor_gen' more than once (one entry per MFC)"),
    ("allocation_without_manual", {"placement.allocation": "actor_gen=0-7:d8"},
     "placement.allocation='actor_gen=0-7:d8': placement.kind=colocate ignores it"),
    ("cluster_without_auto", {"placement.cluster": "meshes/cpu_8.py"},
     "placement.cluster='meshes/cpu_8.py': placement.kind=colocate ignores it"),
    ("micro_batches_beside_a_token_budget", {"micro_batches": 4, "micro_batch_tokens": 256},
     "micro_batches=4: micro_batch_tokens=256 > 0 splits micro-batches by tokens instead"),
    ("periodic_evaluation_of_sft", {"algorithm": "sft", "eval.every": 5},
     "eval.every=5: sft evaluates before and after training only"),
    ("samples_of_dpo", {"algorithm": "dpo", "eval.samples": 4},
     "eval.samples=4: dpo evaluates before and after training only"),
    ("ref_size_without_path", {"models.ref.size": "small"},
     "models.ref.size='small': without models.ref.path the reference is a copy of the actor"),
    ("truncated_safetensors", lambda tmp: {"models.actor.path": str(_hf_dir(
        tmp / "cut", truncated=True))},
     "models.actor.path: {tmp}/cut/model.safetensors: not a readable safetensors file"),
    ("malformed_config_json", lambda tmp: {"models.actor.path": str(_hf_dir(
        tmp / "bad", config='{"model_type": "llama",'))},
     "models: {tmp}/bad/config.json: not valid JSON (line 1, column 24"),
]


def configured(overrides: dict) -> object:
    """base_config() with `{dotted key: value}` set."""
    config = base_config()
    for key, value in overrides.items():
        *parents, leaf = key.split(".")
        node = config
        for part in parents:
            node = node[part]
        node[leaf] = value
    return config


@pytest.mark.parametrize("overrides,expected", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_late_input_errors_are_one_line_before_compiling(overrides, expected, tmp_path):
    overrides = overrides(tmp_path) if callable(overrides) else overrides
    config = configured(overrides)
    compiles = []
    listener = lambda event, *_, **__: compiles.append(event)
    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        with pytest.raises(ConfigError) as info:
            check_config(config, str(tmp_path / "work"))
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    message = str(info.value)
    assert expected.format(tmp=tmp_path) in message and "\n" not in message, message
    assert not [e for e in compiles if e in ("/jax/core/compile/backend_compile_duration",
                                             "/jax/compilation_cache/cache_retrieval_time_sec")
                ], "a check compiled something"


def _byte_level_tokenizer(directory: pathlib.Path) -> None:
    """A tokenizer.json of one token per character 'a' (id 3), BOS 1 first, EOS 2."""
    vocab = {"[PAD]": 0, "[BOS]": 1, "[EOS]": 2, "a": 3}
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[PAD]"))
    backend.pre_tokenizer = tokenizers.pre_tokenizers.Split("", "isolated")
    backend.post_processor = tokenizers.processors.TemplateProcessing(
        single="[BOS] $A", special_tokens=[("[BOS]", 1)])
    backend.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "[BOS]", "eos_token": "[EOS]", "pad_token": "[PAD]"}))


def test_generate_refuses_a_prompt_and_new_tokens_past_the_positions(tmp_path):
    with pytest.raises(ConfigError, match=r"^--prompt: 601 tokens, but the model has 600 "):
        check_length(601, 1, 600)
    with pytest.raises(ConfigError, match=r"^--max_new_tokens=100: with the 501-token prompt "
                       r"that is 601 tokens, more than the model's 600 positions .* at most 99"):
        check_length(501, 100, 600)
    check_length(500, 100, 600)

    model = _hf_dir(tmp_path / "m", positions=64)
    _byte_level_tokenizer(model)
    result = subprocess.run(
        [sys.executable, "-m", "jaxrlhf.generate", f"--model={model}", "--prompt=" + "a" * 59,
         "--max_new_tokens=8"], cwd=REPO, capture_output=True, text=True, timeout=300,
        env={**os.environ, "PYTHONPATH": str(REPO)})
    assert result.returncode == 2, result.stderr[-3000:]
    assert result.stderr == ("error: --max_new_tokens=8: with the 60-token prompt that is 68 "
                             "tokens, more than the model's 64 positions "
                             "(max_position_embeddings); at most 4 new tokens fit\n")
