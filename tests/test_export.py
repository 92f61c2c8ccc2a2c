"""`jaxrlhf.export`: a checkpoint's actor and critic as HF models that transformers loads and
that compute what jaxrlhf computes (fp32, ≤1e-4)."""

import json
import subprocess
import sys

import jax
import numpy as np
import pytest
import torch
import transformers
from tokenizers import Tokenizer, models, pre_tokenizers

from jaxrlhf.schema import base_config
from hf_fixtures import hf_logits, hf_token_scores, padded_batch, positions_from_mask
from jaxrlhf import export
from jaxrlhf.checkpoint import Checkpointer, CheckpointConfig, CHECKPOINT_DIR
from jaxrlhf.mfc import Role
from jaxrlhf.models.transformer import Transformer
from jaxrlhf.parallel.layout import make_layout
from test_checkpoint import ACTOR, CRITIC, host_state, random_params, trained_state

ATOL = 1e-4
LENGTHS, LEFT_PAD, SEQ_LEN = [7, 4, 10, 1], [True, False, True, False], 10


def _ours(config, params, tokens_bt, mask_bt) -> np.ndarray:
    fwd = jax.jit(lambda p, t, pos, seg: Transformer(config).apply({"params": p}, t, pos, seg)[0])
    return np.asarray(fwd(params, tokens_bt, positions_from_mask(mask_bt), mask_bt))


def _write_run(workdir, config) -> dict:
    """A run's checkpoint 7 (saved under a d8 plan); returns the saved parameters."""
    layout = make_layout("0-7:d8", model=ACTOR)
    states = {Role.ACTOR: trained_state(ACTOR, layout, 0),
              Role.CRITIC: trained_state(CRITIC, layout, 1),
              Role.REF: random_params(ACTOR, layout, 2)}
    ckpts = Checkpointer(workdir / CHECKPOINT_DIR, CheckpointConfig(1, 2, async_save=False))
    ckpts.save(states, host_state(7, config, trained=("actor", "critic"), frozen=("ref",)))
    ckpts.close()
    return {Role.ACTOR: states[Role.ACTOR].params, Role.CRITIC: states[Role.CRITIC].params}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("run")
    return workdir, _write_run(workdir, base_config())


def test_exported_actor_gives_jaxrlhf_logits_in_transformers(run, tmp_path):
    workdir, saved = run
    result = export.export(workdir, tmp_path / "actor")
    assert result.step == 7 and result.tokenizer_dir is None  # the byte tokenizer's are written
    hf_config = json.loads((tmp_path / "actor/config.json").read_text())
    assert hf_config["architectures"] == ["LlamaForCausalLM"]
    assert (hf_config["bos_token_id"], hf_config["eos_token_id"], hf_config["pad_token_id"]) == (
        257, 258, 256)
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "actor", attn_implementation="eager", dtype=torch.float32).eval()
    tokens_bt, mask_bt = padded_batch(ACTOR.vocab_size, LENGTHS, SEQ_LEN, left_pad=LEFT_PAD)
    ours_btv = _ours(ACTOR, saved[Role.ACTOR], tokens_bt, mask_bt)
    valid = mask_bt.astype(bool)
    assert np.abs(ours_btv[valid]).max() > 1.0  # logits of real size, not of a blank model
    np.testing.assert_allclose(hf_logits(hf, tokens_bt, mask_bt)[valid], ours_btv[valid],
                               atol=ATOL, rtol=0)


def test_exported_critic_gives_jaxrlhf_values_in_transformers(run, tmp_path):
    workdir, saved = run
    export.export(workdir, tmp_path / "critic", Role.CRITIC)
    hf = transformers.AutoModelForSequenceClassification.from_pretrained(
        tmp_path / "critic", attn_implementation="eager", dtype=torch.float32).eval()
    assert hf.config.num_labels == 1
    tokens_bt, mask_bt = padded_batch(CRITIC.vocab_size, LENGTHS, SEQ_LEN, left_pad=LEFT_PAD)
    values_bt = _ours(CRITIC, saved[Role.CRITIC], tokens_bt, mask_bt)
    valid = mask_bt.astype(bool)
    assert np.abs(values_bt[valid]).max() > 0.1  # the value head is not the zero init
    np.testing.assert_allclose(hf_token_scores(hf, tokens_bt, mask_bt)[valid], values_bt[valid],
                               atol=ATOL, rtol=0)


def test_export_cli_and_errors(run, tmp_path):
    workdir, _ = run
    out = subprocess.run(
        [sys.executable, "-m", "jaxrlhf.export", f"--workdir={workdir}",
         f"--out={tmp_path / 'ref'}", "--role=ref", "--step=7"],
        capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "the byte tokenizer, written as tokenizer.json" in out.stdout
    assert json.loads(out.stdout.strip().splitlines()[-1]) == {
        "out": str(tmp_path / "ref"), "role": "ref", "step": 7, "tokenizer": None}
    assert (tmp_path / "ref/model.safetensors").stat().st_size > 0
    with pytest.raises(ValueError, match="has no cost_critic model; it has actor, critic, ref"):
        export.export(workdir, tmp_path / "x", Role.COST_CRITIC)
    with pytest.raises(FileNotFoundError, match="no checkpoint 3 .* \\[7\\]"):
        export.export(workdir, tmp_path / "x", step=3)
    with pytest.raises(FileNotFoundError, match="no checkpoints in"):
        export.export(tmp_path, tmp_path / "x")


def test_a_byte_tokenizer_export_serves_with_its_tokenizer_and_generation_config(run, tmp_path):
    """transformers' AutoTokenizer reads the exported byte tokenizer (data/byte_hf.py) and
    encodes as ours, text spelling special tokens included; generation stops on its EOS."""
    from tests.unit.test_byte_hf import STRINGS

    from jaxrlhf.data.tokenizer import ByteTokenizer, encode_prompt

    workdir, _ = run
    export.export(workdir, tmp_path / "actor")
    hf_tok, ours = transformers.AutoTokenizer.from_pretrained(tmp_path / "actor"), ByteTokenizer()
    for text in STRINGS:
        assert hf_tok(text)["input_ids"] == encode_prompt(ours, text), text
        assert hf_tok(text, add_special_tokens=False)["input_ids"] == ours.encode(text), text
        assert hf_tok.decode(ours.encode(text)) == text
    assert (hf_tok.bos_token_id, hf_tok.eos_token_id, hf_tok.pad_token_id) == (257, 258, 256)
    generation = transformers.GenerationConfig.from_pretrained(tmp_path / "actor")
    assert (generation.eos_token_id, generation.bos_token_id, generation.pad_token_id) == (
        258, 257, 256)


def test_generation_config_keeps_the_models_sampling_defaults(tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"do_sample": True, "temperature": 0.6, "top_p": 0.95, "eos_token_id": 7}))

    class Chat:  # a chat model's tokenizer: two stop ids, no BOS
        stop_ids, pad_id, bos_id = (5, 9), 0, None

    assert export.generation_config(Chat, str(tmp_path)) == {
        "do_sample": True, "temperature": 0.6, "top_p": 0.95, "eos_token_id": [5, 9],
        "pad_token_id": 0}
    assert export.generation_config(Chat, "") == {"eos_token_id": [5, 9], "pad_token_id": 0}


def test_export_copies_an_hf_tokenizer(tmp_path):
    tok_dir = tmp_path / "tok"
    tok_dir.mkdir()
    words = ["<pad>", "<s>", "</s>"] + [str(d) for d in range(10)] + ["a", "b"]
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<pad>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.save(str(tok_dir / "tokenizer.json"))
    (tok_dir / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>",
         "tokenizer_class": "PreTrainedTokenizerFast"}))
    config = base_config()
    config.tokenizer = str(tok_dir)
    workdir = tmp_path / "run"
    _write_run(workdir, config)

    result = export.export(workdir, tmp_path / "actor")
    assert result.tokenizer_dir == str(tok_dir)
    hf_config = json.loads((tmp_path / "actor/config.json").read_text())
    assert (hf_config["bos_token_id"], hf_config["eos_token_id"], hf_config["pad_token_id"]) == (
        1, 2, 0)
    hf_tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "actor")
    assert hf_tok("a 3 b", add_special_tokens=False)["input_ids"] == [13, 6, 14]
    assert hf_tok.eos_token_id == 2
    assert json.loads((tmp_path / "actor/generation_config.json").read_text()) == {
        "eos_token_id": 2, "pad_token_id": 0, "bos_token_id": 1}


def test_an_export_to_an_out_another_export_is_writing_is_refused(run, tmp_path):
    """Two exports to one --out at once both exited 0, the later silently replacing the
    other's; now the second is refused while the first holds --out (issue 46)."""
    workdir, _ = run
    out = tmp_path / "hf"
    with export.out_lock(out):  # an export in progress
        with pytest.raises(FileExistsError, match=r"--out=.*/hf: another export is writing it "
                                                  r"\(pid \d+ on "):
            export.export(workdir, out)
        proc = subprocess.run([sys.executable, "-m", "jaxrlhf.export", f"--workdir={workdir}",
                               f"--out={out}", "--overwrite"], capture_output=True, text=True,
                              timeout=300)
        assert proc.returncode == 2 and proc.stderr.startswith(
            f"error: --out={out}: another export is writing it"), proc.stderr[-2000:]
    assert not out.exists() and not list(tmp_path.iterdir())  # nothing written, no lock left
    assert export.export(workdir, out).step == 7  # free again
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]
