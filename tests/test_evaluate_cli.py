"""`python -m jaxrlhf.evaluate` on a run's checkpoint and held-out file agrees with the run's
own evaluations: its greedy pass@1 is the run's final accuracy, and with --samples=8 its pass@1
and pass@8 are the run's periodic `eval.samples=8` figures, at the run's layout (slow: a
one-step PPO run and three evaluations compile, about 4 minutes on 2 loaded cores).

The reward counts digits (tests/fixtures/reward_fns.py:digit_count), on which an untrained
model's responses spread out, so the figures compared are not all 0 or 1."""

import json
import pathlib
import subprocess
import sys

import pytest

from jaxrlhf.run import rl
from jaxrlhf.run.check import check_config
from jaxrlhf.schema import base_config

FIXTURES = pathlib.Path(__file__).parent / "fixtures"
DIGITS = f"{FIXTURES / 'reward_fns.py'}:digit_count"


def _run(workdir: pathlib.Path) -> dict:
    config = base_config()
    config.steps = 1
    config.rollout.update(batch_size=8, max_prompt_len=8, max_new_tokens=6)
    config.data.task.update(num_train=32, num_eval=6, num_sft=8)
    config.reward.update(workers=1, function=DIGITS)
    config.eval.update(every=1, samples=8)
    config.checkpoint.update(every=0, async_save=False)
    return rl.run(check_config(config, str(workdir)))


def evaluate(*args: str, out: pathlib.Path) -> tuple[list[dict], dict]:
    """(the per-prompt lines, the totals) of one `python -m jaxrlhf.evaluate` call."""
    proc = subprocess.run([sys.executable, "-m", "jaxrlhf.evaluate", *args, f"--out={out}"],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    return lines[:-1], lines[-1]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("run")
    summary = _run(workdir)
    periodic = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()
                if "eval/pass@8" in line]
    return workdir, summary, periodic[-1]


@pytest.mark.slow
def test_greedy_and_pass_at_8_equal_the_runs_evaluations(run, tmp_path):
    workdir, summary, periodic = run
    held_out = workdir / "data" / "eval.jsonl"
    prompts, greedy = evaluate(f"--workdir={workdir}", f"--data={held_out}",
                               out=tmp_path / "greedy.jsonl")
    assert greedy["prompts"] == len(prompts) == 6 and greedy["samples"] == 1
    assert greedy["pass@1"] == summary["accuracy_after"]
    assert greedy["mean_reward"] == pytest.approx(summary["reward_after"])
    assert all(len(p["samples"]) == len(p["rewards"]) == 1 for p in prompts)
    assert greedy["reward_errors"] == 0 and greedy["tokens_per_second"] > 0

    prompts, sampled = evaluate(f"--workdir={workdir}", f"--data={held_out}", "--samples=8",
                                out=tmp_path / "sampled.jsonl")
    assert 0 < periodic["eval/pass@1"] < 1  # the comparison is not between blanks
    assert sampled["pass@1"] == pytest.approx(periodic["eval/pass@1"], abs=1e-12)
    assert sampled["pass@8"] == pytest.approx(periodic["eval/pass@8"], abs=1e-12)
    assert all(len(p["samples"]) == len(p["rewards"]) == len(p["lengths"]) == 8
               for p in prompts)
    assert [r for p in prompts for r in p["rewards"]] == [
        float(sum(c.isdigit() for c in s)) for p in prompts for s in p["samples"]]
    assert sampled["mean_response_tokens"] == pytest.approx(
        sum(n for p in prompts for n in p["lengths"]) / 48)
