"""Held-out evaluation through the real RL job (`jaxrlhf/run/evaluate.py`): it follows the
run's reward, reports exact-match accuracy only when the rows have answers, and runs every
`eval.every` steps with pass@k / mean@k into metrics.jsonl and TensorBoard."""

import json
import pathlib

import numpy as np
import pytest
from tensorboardX.proto.event_pb2 import Event

from jaxrlhf.metrics import MetricsWriter
from jaxrlhf.run import rl
from jaxrlhf.run.check import check_config
from jaxrlhf.run.evaluate import HeldOut, _padded_rows
from jaxrlhf.schema import base_config

FIXTURES = pathlib.Path(__file__).parent / "fixtures"


def _config(steps=2, **eval_settings):
    config = base_config()
    config.steps = steps
    config.rollout.update(batch_size=8, max_prompt_len=8, max_new_tokens=5)
    config.data.task.update(num_train=32, num_eval=6, num_sft=8)
    config.reward.update(workers=1)
    config.eval.update(**eval_settings)
    config.checkpoint.update(every=0, async_save=False)
    return config


def _metrics(workdir):
    return [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]


def _tensorboard_tags(workdir):
    """Scalar tags in the run's event files (TFRecords: u64 length, u32 crc, data, u32 crc)."""
    tags = set()
    for events in (workdir / "tensorboard").rglob("events.*"):
        raw, i = events.read_bytes(), 0
        while i < len(raw):
            n = int.from_bytes(raw[i:i + 8], "little")
            tags.update(v.tag for v in Event.FromString(raw[i + 12:i + 12 + n]).summary.value)
            i += 12 + n + 4
    return tags


def test_padded_rows_fill_whole_batches():
    assert _padded_rows([1, 2, 3], 1, 4) == [1, 2, 3, 1]
    assert _padded_rows([1, 2, 3], 2, 4) == [1, 2, 3, 1]  # 4 rows × 2 samples = 8
    assert _padded_rows([1], 1, 8) == [1] * 8
    assert _padded_rows([1, 2], 4, 8) == [1, 2]


@pytest.mark.slow  # ~50 s of CPU: an RL run with greedy and sampled evaluations compiled
def test_periodic_evaluation_with_answers(tmp_path):
    summary = rl.run(check_config(_config(steps=1, every=1, samples=3, max_prompts=4),
                                  str(tmp_path)))
    rows = _metrics(tmp_path)
    evaluated = [r for r in rows if "eval/accuracy" in r]
    assert [r["step"] for r in evaluated] == [0]  # after step 0, in the step's own record
    for r in evaluated:
        assert "reward" in r  # the same record as the RL step
        # The reward is exact match: greedy reward and accuracy are the same figure.
        assert r["eval/reward"] == r["eval/accuracy"]
        assert r["eval/reward_errors"] == 0
        # With 0/1 scores, unbiased pass@1 is the mean score; pass@3 bounds both from above.
        assert r["eval/pass@1"] == pytest.approx(r["eval/mean@3"], abs=1e-12)
        assert r["eval/mean@3"] <= r["eval/pass@3"] <= 1.0
        assert r["eval/mean@3"] * 12 == pytest.approx(round(r["eval/mean@3"] * 12))  # k/12
    # TensorBoard tags hold no '@' (tensorboardX writes pass@3 as pass_3).
    assert {"eval/accuracy", "eval/pass_3", "eval/mean_3"} <= _tensorboard_tags(tmp_path)
    assert summary["accuracy_before"] == summary["reward_before"]
    assert 0.0 <= summary["accuracy_after"] <= 1.0


def test_rows_without_answers_report_the_mean_reward(tmp_path):
    """Before this, such a run crashed after the warm start (exact match needs answers)."""
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{i}{i + 1}>"}) + "\n" for i in range(16)))
    config = _config()
    config.data.update(train_path=str(data), eval_path=str(data))
    config.reward.function = f"{FIXTURES / 'reward_fns.py'}:digit_count"
    workdir = tmp_path / "run"
    summary = rl.run(check_config(config, str(workdir)))
    assert summary["accuracy_before"] is None and summary["accuracy_after"] is None
    # digit_count of a 5-token response lies in [0, 5]; the runs' rewards are real numbers.
    for key in ("reward_before", "reward_after"):
        assert isinstance(summary[key], float) and 0.0 <= summary[key] <= 5.0, summary
    assert not any(k.startswith("eval/") for r in _metrics(workdir) for k in r)  # every = 0
    assert np.isfinite(summary["reward_after"])


@pytest.mark.slow  # ~2 min of CPU: HF models, a PPO step with a reward model, two evaluations
def test_reward_model_evaluation_equals_transformers(tmp_path):
    """reward.kind=model and rows without answers: the before-RL evaluation is the reward
    model's mean score of the actor's greedy chat responses, as transformers computes it."""
    import torch

    from hf_fixtures import hf_token_scores, make_tiny_hf_model
    from test_generate_chat import _write_tokenizer

    actor, hf_actor = make_tiny_hf_model(tmp_path, "llama")
    hf_tok = _write_tokenizer(actor, hf_actor.config.vocab_size, "llama3")  # stops: 4, 1
    reward, hf_reward = make_tiny_hf_model(tmp_path, "llama", seq_cls=True, seed=1)
    prompts = [f"w{7 + i} w{9 + i}" for i in range(8)]
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    config = _config(steps=1)
    config.tokenizer = str(actor)
    config.models.actor.path = config.models.critic.path = str(actor)
    config.models.reward.path = str(reward)
    config.reward.kind = "model"
    config.data.update(train_path=str(data), eval_path=str(data))
    config.rollout.update(max_prompt_len=16, max_new_tokens=4)
    summary = rl.run(check_config(config, str(tmp_path / "run")))

    scores = []
    for prompt in prompts:
        ids = hf_tok.apply_chat_template([{"role": "user", "content": prompt}],
                                         add_generation_prompt=True, tokenize=True)
        ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
        with torch.no_grad():
            out = hf_actor.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids)),
                                    max_new_tokens=4, do_sample=False, eos_token_id=[4, 1],
                                    pad_token_id=0)
        new = out[0, len(ids):].tolist()
        new = new[:next((i + 1 for i, t in enumerate(new) if t in (4, 1)), len(new))]
        seq_bt = np.array([ids + new])  # scored at its last token, the EOS when it has one
        scores.append(hf_token_scores(hf_reward, seq_bt, np.ones_like(seq_bt))[0, -1])
    assert summary["accuracy_before"] is None
    assert summary["reward_before"] == pytest.approx(float(np.mean(scores)), abs=1e-4)


def test_the_evaluation_reward_pool_closes_when_the_run_raises(tmp_path):
    """The held-out reward pool's worker processes never outlive a failed run (rl.run holds the
    evaluation in a `with`); this used to leak them when the RL loop raised."""
    job = check_config(_config(), str(tmp_path))
    with pytest.raises(RuntimeError, match="the RL loop failed"):
        with HeldOut(job, job.plan.layouts["actor_gen"]) as held_out:
            rows = job.data.eval[:2]
            scores, errors = held_out._function_scores(rows, [r.answer for r in rows])
            workers = [w.process for w in held_out._pool._workers]
            raise RuntimeError("the RL loop failed")
    assert list(scores) == [1.0, 1.0] and errors == 0  # the pool did run
    assert held_out._pool is None and workers and not any(p.is_alive() for p in workers)


def test_tensorboard_tags_name_at_signs_as_underscores(tmp_path):
    """metrics.jsonl keeps "eval/pass@3"; its TensorBoard tag is "eval/pass_3" (tags hold no
    '@'), named by MetricsWriter itself, and both come back the same on reopening."""
    with MetricsWriter(tmp_path) as writer:
        writer.write(0, {"eval/pass@3": 0.5, "actor/loss": 1.0})
    with MetricsWriter(tmp_path):  # rewrites the events from metrics.jsonl
        pass
    assert _metrics(tmp_path) == [{"step": 0, "eval/pass@3": 0.5, "actor/loss": 1.0}]
    assert _tensorboard_tags(tmp_path) == {"eval/pass_3", "actor/loss"}
