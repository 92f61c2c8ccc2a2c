"""The newer objectives' shipped tiny configs learn, through `python -m jaxrlhf.train`, and the
RLHF pipeline (SFT -> reward model -> PPO with the learned reward) run from its three configs.

Each run is a subprocess on 8 virtual CPU devices with the shipped schedule (300 warm-start
steps, 40 or 60 RL steps), about 3 minutes on 2 cores; the numerics are in tests/unit/test_objectives.py.
`python -m pytest -q -m slow tests/test_entry_objectives.py` runs them.
"""

import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]


def _main(module, *flags):
    """`python -m jaxrlhf.<module> FLAGS`; returns its last line (JSON)."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run([sys.executable, "-m", f"jaxrlhf.{module}", *flags], env=env,
                          capture_output=True, text=True, timeout=1200, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def train(config, workdir, *flags):
    """(summary line, metrics.jsonl records of the RL steps) of a run of `config`."""
    summary = _main("train", f"--config=configs/{config}", f"--workdir={workdir}", *flags)
    records = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    return summary, [r for r in records if "reward" in r]


def series(records, key):
    return np.array([r[key] for r in records])


@pytest.mark.slow
@pytest.mark.entry
@pytest.mark.parametrize("config,steps,shown", [
    ("rloo_tiny.py", 60, "actor/kl"),
    ("reinforce_pp_tiny.py", 40, "actor/kl"),
    ("gspo_tiny.py", 40, "actor/ref_kl"),
    ("grpo_tiny.py:dr_grpo", 60, "actor/kl"),
    ("cispo_tiny.py", 40, "actor/clip_frac"),
])
def test_objective_learns(config, steps, shown, tmp_path):
    summary, records = train(config, tmp_path)
    assert summary["accuracy_before"] < 0.5 and summary["accuracy_after"] >= 0.85, summary
    assert len(records) == steps and np.isfinite(series(records, shown)).all()


@pytest.mark.slow
@pytest.mark.entry
def test_dapo_learns_with_dynamic_sampling_and_mismatch_correction(tmp_path):
    """dapo_tiny with truncated importance sampling: it learns; every step logs the mismatch
    and trains a batch of informative groups found among twice as many."""
    summary, records = train("dapo_tiny.py", tmp_path, "--config.ppo.tis_cap=2.0")
    assert summary["accuracy_before"] < 0.5 and summary["accuracy_after"] >= 0.85, summary
    informative, filled = series(records, "actor/informative_group_frac"), series(
        records, "actor/filled_frac")
    assert (filled >= np.minimum(2 * informative, 1.0) - 1e-6).all(), (informative, filled)
    assert filled.mean() > informative.mean()  # the refill at work
    gap_mean, gap_max = series(records, "actor/mismatch_mean"), series(records, "actor/mismatch_max")
    assert len(gap_mean) == 40 and (gap_max >= gap_mean).all() and (gap_max < 1e-2).all()


@pytest.mark.slow
@pytest.mark.entry
def test_rlhf_pipeline_learns_from_its_reward_model(tmp_path):
    """SFT -> export -> reward model from the SFT trunk -> export -> PPO on the learned reward,
    each stage its shipped config; held-out exact match (the task's answers, which the reward
    model never sees) rises by >= 0.3 over the SFT model, with the KL to it held near target."""
    sft = _main("train", "--config=configs/rlhf_sft_tiny.py", f"--workdir={tmp_path / 'sft'}")
    _main("export", f"--workdir={tmp_path / 'sft'}", f"--out={tmp_path / 'sft_hf'}")
    rw = _main("train", "--config=configs/rlhf_rw_tiny.py", f"--workdir={tmp_path / 'rw'}",
               f"--config.models.actor.path={tmp_path / 'sft_hf'}")
    assert rw["accuracy_after"] > 0.85, rw  # held-out preference accuracy
    _main("export", f"--workdir={tmp_path / 'rw'}", f"--out={tmp_path / 'rm_hf'}",
          "--role=reward")
    ppo, records = train("rlhf_ppo_tiny.py", tmp_path / "ppo",
                         f"--config.models.actor.path={tmp_path / 'sft_hf'}",
                         f"--config.models.reward.path={tmp_path / 'rm_hf'}")
    assert ppo["accuracy_before"] == sft["accuracy_after"]  # PPO starts from the SFT model
    assert ppo["accuracy_after"] >= ppo["accuracy_before"] + 0.3, ppo
    kl = series(records, "actor/kl")
    assert kl[-10:].mean() < 2 * 2.0, kl  # near ppo.kl_target, not running away
