"""The offline job: SFT, reward modelling and DPO on a fixed dataset, through the same runner.

The job mirrors the RL job: data (the built-in task or user files), the optional supervised
warm start of the actor, held-out evaluation before and after, one runner step per batch, a
progress bar, metrics.jsonl and TensorBoard events, checkpoints (`checkpoint.every`, Ctrl-C and
SIGTERM save and stop, a rerun resumes exactly; `python -m jaxrlhf.export` writes the trained
model as a Hugging Face directory), and a summary whose `accuracy_before` / `accuracy_after`
mean what the algorithm's `Evaluation` says:

  SFT               greedy exact-match accuracy on the held-out prompts (also `eval_loss_*`:
                    token NLL of their reference answers);
  PREFERENCE_LOGP   (DPO) held-out preference accuracy of the policy: log π(chosen) >
                    log π(rejected), summed over the response tokens (also `exact_match_*`);
  PREFERENCE_SCORE  (RW) held-out preference accuracy of the reward model: r(chosen) >
                    r(rejected).

Preference pairs are batched as chosen rows then rejected rows (`algorithms.pairs`).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence

import numpy as np

from jaxrlhf.algorithms.spec import BatchKind, Evaluation
from jaxrlhf.data import datasets
from jaxrlhf.data.encode import sequence_batch, sft_batch
from jaxrlhf.dataflow.runtime import ModelRuntime
from jaxrlhf.engine.inference import (
    InferenceBatch, InferenceConfig, InferenceKind, make_inference_fn,
)
from jaxrlhf.metrics import MetricsWriter
from jaxrlhf.parallel.reshard import fetch
from jaxrlhf.run import rl
from jaxrlhf.run.check import Job
from jaxrlhf.run.evaluate import _padded_rows, greedy_accuracy
from jaxrlhf.spec import RolloutSpec

Evaluator = Callable[[], dict[str, float]]


def preference_batch(rows: Sequence[datasets.PreferenceRow], tokenizer, max_prompt_len: int,
                     max_new_tokens: int) -> dict[str, np.ndarray]:
    """The B pairs as 2B sequence rows: chosen responses, then rejected ones (same prompts)."""
    prompts = [r.prompt for r in rows]
    responses = [r.chosen for r in rows] + [r.rejected for r in rows]
    return sequence_batch(prompts + prompts, responses, tokenizer, max_prompt_len, max_new_tokens)


@dataclasses.dataclass(frozen=True)
class Scorer:
    """Forward passes of one model over held-out (prompt, response) rows, on one layout."""

    infer: Callable
    dp: int
    tokenizer: object
    rollout: RolloutSpec

    def __call__(self, params, prompts: list[str], responses: list[str]):
        """(output, response_mask_bn) of the model on the rows (padding rows cut off)."""
        r = self.rollout
        batch = sequence_batch(_padded_rows(prompts, 1, self.dp),
                               _padded_rows(responses, 1, self.dp), self.tokenizer,
                               r.max_prompt_len, r.max_new_tokens)
        out = self.infer(params, InferenceBatch.padded(batch["seq_tokens_bs"],
                                                        batch["seq_mask_bs"]))
        return out, batch["response_mask_bn"][: len(prompts)]

    def response_logprobs(self, params, prompts, responses) -> tuple[np.ndarray, np.ndarray]:
        """([b] Σ log p of each response incl. EOS, [b] its token count)."""
        out, mask_bn = self(params, prompts, responses)
        logp_bn = fetch(out.logprobs_bt)[: len(prompts), -mask_bn.shape[1]:]  # any process
        return np.sum(logp_bn * mask_bn, axis=1), np.sum(mask_bn, axis=1)

    def scores(self, params, prompts, responses) -> np.ndarray:
        out, _ = self(params, prompts, responses)
        return fetch(out.scores_bk)[: len(prompts), 0]


def make_scorer(runtime: ModelRuntime, kind: InferenceKind, job: Job) -> Scorer:
    r = job.spec.rollout
    infer = make_inference_fn(runtime.config, InferenceConfig(kind), runtime.home,
                              length_buckets=(r.seq_len,))
    return Scorer(infer, runtime.home.dp_size, job.tokenizer, r)


def make_evaluator(job: Job, runtime: ModelRuntime) -> Evaluator:
    """Held-out metrics of the trained model; "accuracy" as the module docstring defines."""
    pairs = job.data.eval_pairs
    prompts = [p.prompt for p in pairs]
    chosen, rejected = [p.chosen for p in pairs], [p.rejected for p in pairs]
    params = lambda: runtime.params
    match job.spec.algorithm.evaluation:
        case Evaluation.PREFERENCE_SCORE:
            scorer = make_scorer(runtime, InferenceKind.SCORES, job)
            return lambda: {"accuracy": float(np.mean(
                scorer.scores(params(), prompts, chosen)
                > scorer.scores(params(), prompts, rejected)))}
        case Evaluation.SFT:
            scorer = make_scorer(runtime, InferenceKind.LOGPROBS, job)
            exact_match = greedy_accuracy(job, runtime.home, job.data.eval)
            answered = [row for row in job.data.eval if row.answer is not None]

            def sft_metrics():
                logp_b, count_b = scorer.response_logprobs(
                    params(), [r.prompt for r in answered], [r.answer for r in answered])
                return {"accuracy": exact_match(params()),
                        "eval_loss": float(-logp_b.sum() / count_b.sum())}

            return sft_metrics
        case Evaluation.PREFERENCE_LOGP:
            scorer = make_scorer(runtime, InferenceKind.LOGPROBS, job)
            exact_match = greedy_accuracy(job, runtime.home, job.data.eval)

            def dpo_metrics():
                logp_chosen_b, _ = scorer.response_logprobs(params(), prompts, chosen)
                logp_rejected_b, _ = scorer.response_logprobs(params(), prompts, rejected)
                return {"accuracy": float(np.mean(logp_chosen_b > logp_rejected_b)),
                        "exact_match": exact_match(params())}

            return dpo_metrics
    raise ValueError(f"algorithm={job.spec.name.value}: no offline evaluation "
                     f"{job.spec.algorithm.evaluation}")


def encode(job: Job, rows: list) -> dict[str, np.ndarray]:
    """One batch of training rows in the runner's keys."""
    r = job.spec.rollout
    paired = job.spec.algorithm.batches is BatchKind.PAIRS
    return (preference_batch if paired else sft_batch)(rows, job.tokenizer, r.max_prompt_len,
                                                      r.max_new_tokens)


def run(job: Job) -> dict:
    """The whole offline job; returns the summary dict printed as the last line.

    Like the RL job, a workdir with checkpoints resumes from the newest intact one (no warm
    start, no 'before' evaluation: both are in it) and repeats the uninterrupted run exactly;
    one with only warm-start checkpoints resumes the warm start.
    """
    t0 = time.perf_counter()
    spec, name = job.spec, job.spec.name.value
    paired = spec.algorithm.batches is BatchKind.PAIRS
    with rl.begin(job) as start, MetricsWriter(job.workdir) as writer:
        summary = {"steps": spec.steps, "workdir": str(job.workdir),
                   "resumed_from": None if start.resume is None else start.resume.step}
        runner = start.runner(job, writer, {})  # offline graphs have no host MFCs
        if runner is None:  # stopped in the warm start, its checkpoint saved
            return {**summary, "seconds": time.perf_counter() - t0, "interrupted": True}
        evaluate = make_evaluator(job, runner.runtimes[spec.algorithm.trained_role])
        with runner:
            before = evaluate() if start.resume is None else start.before()
            print(f"held-out before {name}: {before}", flush=True)
            rows = start.rows(job.data.pairs if paired else job.data.sft, job)
            loop = rl.train_loop(job, runner, rows, lambda batch: encode(job, batch), writer,
                                 start.checkpoints, before.get("accuracy"), before, name)
        after = None if loop.interrupted else evaluate()
        if after is not None:
            print(f"held-out after {name}:  {after}")
            writer.write(spec.steps, {f"eval/{k}_{when}": v for when, m in
                                      (("before", before), ("after", after))
                                      for k, v in m.items()})
    for key in before:
        summary[f"{key}_before"] = before[key]
        summary[f"{key}_after"] = None if after is None else after[key]
    return {**summary, "seconds": time.perf_counter() - t0, "recompiles": runner.compiles,
            "interrupted": loop.interrupted}
