"""Offline runs (SFT, DPO, reward modelling) are first-class: they checkpoint, resume exactly
and export, through the real offline job (`run.rl.run`) on tiny shapes.

For each algorithm, an uninterrupted run with checkpoints 2 and 4 is the reference; a run that
"died" after checkpoint 2 (checkpoint 4 gone, a record cut off mid-write) is rerun and must log
the same metrics, end with bitwise-equal model states and evaluate the same; a run stopped by
SIGTERM or Ctrl-C saves and its rerun repeats the reference; a non-finite update stops the
run (nan_policy=stop) or is discarded (=skip). The exported trained model loads in
transformers and computes what jaxrlhf computes (fp32, ≤1e-4): the actor of SFT and DPO as
`*ForCausalLM` logits, the reward model of reward modelling as `*ForSequenceClassification`
scores pooled at each sequence's last token, as the run's own held-out scorer gives them.

The runs share the test session's persistent compilation cache (tests/conftest.py).
"""

import importlib
import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys

import jax
import numpy as np
import pytest
import torch
import transformers

from hf_fixtures import hf_logits, padded_batch, positions_from_mask
from jaxrlhf import checkpoint, export
from jaxrlhf.data.encode import sequence_batch
from jaxrlhf.engine.inference import InferenceKind
from jaxrlhf.metrics import read_records
from jaxrlhf.mfc import Role
from jaxrlhf.models.transformer import Transformer
from jaxrlhf.run import build, evaluate, rl
from jaxrlhf.run.check import check_config
from jaxrlhf.schema import base_config
from test_resume import _assert_same_steps

ATOL = 1e-4
REPO = pathlib.Path(__file__).resolve().parents[1]
# The models each algorithm's checkpoints hold (TrainState items: params and opt).
ITEMS = {"sft": ("actor_params", "actor_opt"),
         "dpo": ("actor_params", "actor_opt", "ref_params"),
         "rw": ("reward_params", "reward_opt")}


def _config(algorithm: str, steps: int = 4):
    config = base_config()
    config.algorithm = algorithm
    config.steps = steps
    config.rollout.update(batch_size=8, max_prompt_len=8, max_new_tokens=6)
    config.data.task.update(num_train=48, num_eval=8, num_sft=32)
    config.data.preference_holdout = 8
    # DPO and reward modelling start from a warm-started actor, as their tiny configs do.
    # (a key set but not read is refused: the warm start's batch with a warm start only, the
    # reward model's optimizer where reward modelling trains one)
    if algorithm != "sft":
        config.warm_start.update(sft_steps=2, batch_size=8)
    config.checkpoint.update(every=2, keep=10)
    if algorithm == "rw":
        config.optimizer.reward.lr = 1e-2  # 4 steps move the zero-initialised head measurably
    return config


def _records(workdir: pathlib.Path) -> list[dict]:
    return [r for r in read_records(workdir / "metrics.jsonl")
            if not all(k == "step" or k.startswith("sft/") for k in r)]


def _item(workdir: pathlib.Path, step: int, item: str):
    import orbax.checkpoint as ocp

    return ocp.StandardCheckpointer().restore(workdir / "checkpoints" / str(step) / item)


def _assert_items_equal(a: pathlib.Path, b: pathlib.Path, step: int, items) -> None:
    for item in items:
        got, want = _item(a, step, item), _item(b, step, item)
        assert jax.tree.structure(got) == jax.tree.structure(want), item
        for x, y in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=item)


def _without_system(summary: dict) -> dict:
    return {k: v for k, v in summary.items()
            if k not in ("seconds", "workdir", "recompiles", "resumed_from")}


@pytest.fixture(scope="module", params=["sft", "dpo", "rw"])
def full_run(request, tmp_path_factory):
    """An uninterrupted 4-step run of one algorithm with checkpoints 2 and 4."""
    algorithm = request.param
    workdir = tmp_path_factory.mktemp(f"full_{algorithm}")
    summary = rl.run(check_config(_config(algorithm), str(workdir)))
    assert summary["resumed_from"] is None and not summary["interrupted"]
    assert sorted(int(p.name) for p in (workdir / "checkpoints").iterdir()
                  if p.name.isdigit()) == [2, 4]
    assert [r["step"] for r in _records(workdir)] == [0, 1, 2, 3, 4]  # 4: the evaluation
    return algorithm, workdir, summary


def test_a_killed_offline_run_resumes_exactly(full_run, tmp_path):
    algorithm, full, summary = full_run
    crashed = tmp_path / "crashed"
    shutil.copytree(full, crashed)
    shutil.rmtree(crashed / "checkpoints/4")
    with (crashed / "metrics.jsonl").open("a") as f:
        f.write('{"step": 3, "actor/loss": 0.')  # a record cut off mid-write

    resumed = rl.run(check_config(_config(algorithm), str(crashed)))
    assert resumed["resumed_from"] == 2
    assert _without_system(resumed) == _without_system(summary)  # before: from the checkpoint
    _assert_same_steps(_records(crashed), _records(full))
    _assert_items_equal(crashed, full, 4, ITEMS[algorithm])


# One handler (guards.StopRequest) takes both signals: each algorithm meets one of them in the
# default suite, the other with -m slow.
_SIGNAL_OF = {"sft": signal.SIGTERM, "dpo": signal.SIGINT, "rw": signal.SIGTERM}
_OTHER_SIGNAL = {signal.SIGTERM: signal.SIGINT, signal.SIGINT: signal.SIGTERM}


def test_sigterm_stops_an_offline_run_and_the_rerun_repeats_it(full_run, tmp_path, monkeypatch,
                                                               capfd):
    _stop_and_rerun(full_run, _SIGNAL_OF[full_run[0]], tmp_path, monkeypatch, capfd)


@pytest.mark.slow
def test_the_other_stop_signal_stops_an_offline_run_and_the_rerun_repeats_it(
        full_run, tmp_path, monkeypatch, capfd):
    _stop_and_rerun(full_run, _OTHER_SIGNAL[_SIGNAL_OF[full_run[0]]], tmp_path, monkeypatch, capfd)


def _stop_and_rerun(full_run, signum, tmp_path, monkeypatch, capfd) -> None:
    """The signal in step 1: checkpoint 2 is saved, and the rerun repeats the uninterrupted
    run."""
    algorithm, full, summary = full_run
    real_encode, calls = rl.encode, []

    def encode_then_sigterm(job, rows):  # SIGTERM (as SLURM sends) or Ctrl-C in step 1
        if job.spec.algorithm.name == algorithm:  # the run's steps, not its warm start's
            calls.append(1)
        if len(calls) == 2:
            os.kill(os.getpid(), signum)
        return real_encode(job, rows)

    monkeypatch.setattr(rl, "encode", encode_then_sigterm)
    work = tmp_path / "work"
    config = _config(algorithm)
    stopped = rl.run(check_config(config, str(work)))
    assert stopped["interrupted"] and stopped["accuracy_after"] is None
    assert f"interrupted after {algorithm} step 1: checkpoint 2 saved" in capfd.readouterr().out
    assert sorted(p.name for p in (work / "checkpoints").iterdir() if p.name.isdigit()) == ["2"]

    monkeypatch.setattr(rl, "encode", real_encode)
    resumed = rl.run(check_config(config, str(work)))
    assert resumed["resumed_from"] == 2
    assert _without_system(resumed) == _without_system(summary)
    _assert_same_steps(_records(work), _records(full))
    _assert_items_equal(work, full, 4, ITEMS[algorithm])


@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")  # the lr
def test_nan_policy_stops_an_offline_run_or_discards_its_steps(full_run, tmp_path):
    algorithm, full, _ = full_run
    work = tmp_path / "work"
    shutil.copytree(full, work)
    config = _config(algorithm, steps=6)
    # A learning rate float32 cannot hold: step 4's update leaves the trained model inf.
    config.optimizer["reward" if algorithm == "rw" else "actor"].lr = 1e39
    config.checkpoint.resume = "force"  # another optimizer makes another run
    with pytest.raises(checkpoint.NonFiniteError, match=rf"^{algorithm} step 4: .*latest "
                                                        r"checkpoint \(step 4\)"):
        rl.run(check_config(config, str(work)))
    assert sorted(p.name for p in (work / "checkpoints").iterdir() if p.name.isdigit()) == [
        "2", "4"]

    config.nan_policy = "skip"
    summary = rl.run(check_config(config, str(work)))
    assert summary["resumed_from"] == 4 and summary["skipped_steps"] == 2
    records = _records(work)
    assert [r["step"] for r in records] == list(range(7))  # 6: the evaluation
    assert [r.get("nan_skipped", 0.0) for r in records[:6]] == [0.0] * 4 + [1.0, 1.0]
    for item in ITEMS[algorithm]:  # both steps discarded whole: the state after step 3
        got, want = _item(work, 6, item), _item(full, 4, item)
        for x, y in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=item)


def _ours_bt(model, params, tokens_bt, mask_bt) -> np.ndarray:
    fwd = jax.jit(lambda p, t, pos, seg: Transformer(model).apply({"params": p}, t, pos, seg)[0])
    return np.asarray(fwd(params, tokens_bt, positions_from_mask(mask_bt), mask_bt))


def test_the_trained_model_exports_to_transformers(full_run, tmp_path):
    algorithm, full, _ = full_run
    role = Role.REWARD if algorithm == "rw" else Role.ACTOR
    result = export.export(full, tmp_path / "hf", role)
    assert result.step == 4
    job = check_config(_config(algorithm), str(tmp_path / "job"))
    model = job.spec.models[role].config
    layout = job.plan.home(job.spec.graph, role)
    restored = checkpoint.Checkpointer(full / "checkpoints", None).restore_models(
        4, {role: checkpoint.abstract_state(model, layout)})[role]
    hf_config = json.loads((tmp_path / "hf/config.json").read_text())
    if role is Role.ACTOR:
        assert hf_config["architectures"] == ["LlamaForCausalLM"]
        hf = transformers.AutoModelForCausalLM.from_pretrained(
            tmp_path / "hf", attn_implementation="eager", dtype=torch.float32).eval()
        tokens_bt, mask_bt = padded_batch(model.vocab_size, [7, 4, 10, 1], 10,
                                          left_pad=[True, False, True, False])
        ours_btv = _ours_bt(model, restored, tokens_bt, mask_bt)
        valid = mask_bt.astype(bool)
        np.testing.assert_allclose(hf_logits(hf, tokens_bt, mask_bt)[valid], ours_btv[valid],
                                   atol=ATOL, rtol=0)
        return
    assert hf_config["architectures"] == ["LlamaForSequenceClassification"]
    hf = transformers.AutoModelForSequenceClassification.from_pretrained(
        tmp_path / "hf", attn_implementation="eager", dtype=torch.float32).eval()
    # The run's held-out scorer: chosen and rejected answers of held-out pairs, each scored at
    # its last real token (EOS), left-padded prompts and right-padded responses.
    eval_pairs = job.data.eval_pairs
    prompts = [p.prompt for p in eval_pairs] * 2
    responses = [p.chosen for p in eval_pairs] + [p.rejected for p in eval_pairs]
    runtime = build.runtimes(job.spec, job.plan, {role: restored})[role]
    scorer = evaluate.make_scorer(runtime, InferenceKind.SCORES, job)
    ours_b = scorer.scores(restored, prompts, responses)
    batch = sequence_batch(prompts, responses, job.tokenizer, 8, 6)
    mask_bs = batch["seq_mask_bs"]
    # HF pools the score at each row's last token that is not its pad id.
    tokens_bs = np.where(mask_bs > 0, batch["seq_tokens_bs"], hf_config["pad_token_id"])
    with torch.no_grad():
        hf_b = hf(input_ids=torch.tensor(tokens_bs, dtype=torch.long),
                  attention_mask=torch.tensor(mask_bs, dtype=torch.long),
                  position_ids=torch.tensor(positions_from_mask(mask_bs), dtype=torch.long)
                  ).logits[:, 0].numpy()
    assert np.ptp(ours_b) > 0.1  # a trained head: scores of real spread, not the zero init
    np.testing.assert_allclose(hf_b, ours_b, atol=ATOL, rtol=0)


@pytest.mark.parametrize("name", ["sft_tiny", "dpo_tiny", "rw_tiny"])
def test_shipped_offline_config_runs_its_smoke_variant(name, tmp_path):
    """The shipped config's own job, two steps (`--config=configs/NAME.py:smoke`)."""
    config = importlib.import_module(f"jaxrlhf.configs.{name}").get_config("smoke")
    summary = rl.run(check_config(config, str(tmp_path)))
    assert summary["steps"] == 2 and not summary["interrupted"]
    assert [r["step"] for r in _records(tmp_path)] == [0, 1, 2]  # 2: the evaluation
    assert {"accuracy_before", "accuracy_after"} <= set(summary)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir() if p.name.isdigit()) == [
        "2"]


def _main(module: str, *flags: str) -> str:
    """Runs `python -m jaxrlhf.<module> FLAGS`; returns its stdout (the last line is JSON)."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run([sys.executable, "-m", f"jaxrlhf.{module}", *flags], env=env,
                          capture_output=True, text=True, timeout=1800, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


@pytest.mark.slow
@pytest.mark.entry
def test_reward_model_trained_then_exported_drives_ppo(tmp_path):
    """The RLHF chain from files: reward modelling (rw_tiny) -> export -> PPO (ppo_tiny) whose
    reward is that model's score; held-out exact match (scored by the task's answers, not by
    the reward model) rises by >= 0.2."""
    rw = json.loads(_main("train", "--config=configs/rw_tiny.py",
                          f"--workdir={tmp_path / 'rw'}").strip().splitlines()[-1])
    assert rw["accuracy_after"] > 0.85, rw  # held-out preference accuracy of the reward model
    exported = json.loads(_main("export", f"--workdir={tmp_path / 'rw'}",
                                f"--out={tmp_path / 'reward'}", "--role=reward"
                                ).strip().splitlines()[-1])
    assert exported["role"] == "reward"
    # A learned reward is only right near the outputs it was trained on (answers reversed or
    # copied): at ppo_tiny's kl_coef 0.05 the policy drifts to outputs the model scores high
    # but that are wrong (reward 0.4 -> 2.6, exact match 0.27 -> 0.03, seen on this task). A
    # stronger KL anchor to the SFT policy, as RLHF with reward models uses, keeps it there.
    ppo = json.loads(_main("train", "--config=configs/ppo_tiny.py", "--config.reward.kind=model",
                           f"--config.models.reward.path={tmp_path / 'reward'}",
                           "--config.ppo.kl_coef=0.5",
                           f"--workdir={tmp_path / 'ppo'}").strip().splitlines()[-1])
    assert ppo["accuracy_after"] >= ppo["accuracy_before"] + 0.2, ppo
