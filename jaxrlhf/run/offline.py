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
from tqdm import tqdm

from jaxrlhf import checkpoint
from jaxrlhf.algorithms.pairs import check_pair_split
from jaxrlhf.algorithms.spec import BatchKind, Evaluation
from jaxrlhf.data import datasets
from jaxrlhf.data.encode import sequence_batch, sft_batch
from jaxrlhf.dataflow.runtime import ModelRuntime
from jaxrlhf.engine.inference import (
    InferenceBatch, InferenceConfig, InferenceKind, make_inference_fn,
)
from jaxrlhf.metrics import METRICS_FILE, MetricsWriter
from jaxrlhf.mfc import MFC, Call
from jaxrlhf.parallel.reshard import fetch
from jaxrlhf.run import build
from jaxrlhf.run.check import Job
from jaxrlhf.run.rl import greedy_accuracy, postfix, restore, resumed_runner
from jaxrlhf.run.runner import Runner
from jaxrlhf.run.warm_start import WarmStart
from jaxrlhf.spec import RolloutSpec

Evaluator = Callable[[], dict[str, float]]


def preference_batch(rows: Sequence[datasets.PreferenceRow], tokenizer, max_prompt_len: int,
                     max_new_tokens: int) -> dict[str, np.ndarray]:
    """The B pairs as 2B sequence rows: chosen responses, then rejected ones (same prompts)."""
    prompts = [r.prompt for r in rows]
    responses = [r.chosen for r in rows] + [r.rejected for r in rows]
    return sequence_batch(prompts + prompts, responses, tokenizer, max_prompt_len, max_new_tokens)


def _pad_to(items: list, multiple: int) -> list:
    """`items` extended by repeats of its head to a multiple of `multiple` (the dp size)."""
    return items + items[: (-len(items)) % multiple]


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
        batch = sequence_batch(_pad_to(prompts, self.dp), _pad_to(responses, self.dp),
                               self.tokenizer, r.max_prompt_len, r.max_new_tokens)
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


def make_evaluator(job: Job, runtime: ModelRuntime, data: build.Data, eval_pairs) -> Evaluator:
    """Held-out metrics of the trained model; "accuracy" as the module docstring defines."""
    prompts = [p.prompt for p in eval_pairs]
    chosen, rejected = [p.chosen for p in eval_pairs], [p.rejected for p in eval_pairs]
    params = lambda: runtime.params
    match job.spec.algorithm.evaluation:
        case Evaluation.PREFERENCE_SCORE:
            scorer = make_scorer(runtime, InferenceKind.SCORES, job)
            return lambda: {"accuracy": float(np.mean(
                scorer.scores(params(), prompts, chosen)
                > scorer.scores(params(), prompts, rejected)))}
        case Evaluation.SFT:
            scorer = make_scorer(runtime, InferenceKind.LOGPROBS, job)
            exact_match = greedy_accuracy(job, runtime.home, data.eval)
            answered = [row for row in data.eval if row.answer is not None]

            def sft_metrics():
                logp_b, count_b = scorer.response_logprobs(
                    params(), [r.prompt for r in answered], [r.answer for r in answered])
                return {"accuracy": exact_match(params()),
                        "eval_loss": float(-logp_b.sum() / count_b.sum())}

            return sft_metrics
        case Evaluation.PREFERENCE_LOGP:
            scorer = make_scorer(runtime, InferenceKind.LOGPROBS, job)
            exact_match = greedy_accuracy(job, runtime.home, data.eval)

            def dpo_metrics():
                logp_chosen_b, _ = scorer.response_logprobs(params(), prompts, chosen)
                logp_rejected_b, _ = scorer.response_logprobs(params(), prompts, rejected)
                return {"accuracy": float(np.mean(logp_chosen_b > logp_rejected_b)),
                        "exact_match": exact_match(params())}

            return dpo_metrics
    raise ValueError(f"algorithm={job.spec.name.value}: no offline evaluation "
                     f"{job.spec.algorithm.evaluation}")


def training_rows(job: Job, data: build.Data, pairs) -> datasets.EpochIterator:
    """Endless batches of training rows (SFT rows or preference pairs); a checkpoint holds its
    position."""
    spec = job.spec
    paired = spec.algorithm.batches is BatchKind.PAIRS
    return datasets.EpochIterator(pairs if paired else data.sft, spec.rollout.batch_size,
                                  seed=spec.seed)


def encode(job: Job, rows: list) -> dict[str, np.ndarray]:
    """One batch of training rows in the runner's keys."""
    r = job.spec.rollout
    paired = job.spec.algorithm.batches is BatchKind.PAIRS
    return (preference_batch if paired else sft_batch)(rows, job.tokenizer, r.max_prompt_len,
                                                      r.max_new_tokens)


def _train_mfc(job: Job) -> MFC:
    return next(m for m in job.spec.graph.mfcs if m.call is Call.TRAIN_STEP
                and m.role is job.spec.algorithm.trained_role)


def train_loop(job: Job, runner: Runner, rows: datasets.EpochIterator, writer,
               checkpoints: checkpoint.Checkpointer, before: dict[str, float]) -> bool:
    """Steps from the runner's step index to spec.steps, with checkpoints (on the cadence, on
    Ctrl-C/SIGTERM, at the end) and the NaN policy; returns whether it was stopped."""
    spec = job.spec
    guard = checkpoint.NanGuard(spec.nan_policy, checkpoints)
    save = lambda: checkpoint.save_run(checkpoints, runner, rows, before.get("accuracy"),
                                       spec.config_json, job.fingerprint, before)
    bar = tqdm(range(runner.step_index, spec.steps), desc=spec.name.value,
               initial=runner.step_index, total=spec.steps, mininterval=1)
    with checkpoint.StopRequest() as stop:
        for step in bar:
            saved = guard.before_step(runner)
            result = runner.step(encode(job, next(rows)))
            if guard.after_step(runner, result.metrics, step, saved):
                result.metrics["nan_skipped"] = 1.0
            writer.write(step, result.metrics)
            bar.set_postfix(postfix(spec.algorithm, result.metrics))
            if checkpoint.save_if_due(checkpoints, stop, step + 1, save, spec.name.value):
                return True
    save()
    return False


def run(job: Job) -> dict:
    """The whole offline job; returns the summary dict printed as the last line.

    Like the RL job, a workdir with checkpoints resumes from the newest intact one (no warm
    start, no 'before' evaluation: both are in it) and repeats the uninterrupted run exactly;
    one with only warm-start checkpoints resumes the warm start.
    """
    start = time.perf_counter()
    spec, workdir = job.spec, job.workdir
    role = spec.algorithm.trained_role
    home = job.plan.home(spec.graph, role)
    data = build.load_data(spec, workdir, job.tokenizer)
    pairs, eval_pairs = [], []
    if spec.algorithm.batches is BatchKind.PAIRS:
        pairs, eval_pairs = build.load_preferences(spec, workdir)
        # Micro-batches must keep each chosen row with its rejected row.
        check_pair_split(spec.rollout.batch_size, job.plan.micro_batches(_train_mfc(job).name),
                         "the number of micro-batches")
    checkpoints = checkpoint.Checkpointer(workdir / checkpoint.CHECKPOINT_DIR, spec.checkpoint)
    restored = restore(job, checkpoints)
    resume = None if restored is None else restored[0]
    # The warm start trains the actor on the trained model's layout (reward modelling then
    # starts its reward model from the actor's trunk).
    warm = WarmStart(job, home, data) if resume is None else None
    checkpoint.trim_metrics(workdir / METRICS_FILE, 0 if resume is None else resume.step,
                            warm.start_step if warm is not None else None)
    summary = {"steps": spec.steps, "workdir": str(workdir),
               "resumed_from": None if resume is None else resume.step}
    with MetricsWriter(workdir) as writer:
        if resume is None:
            try:
                params = warm.run(lambda: build.initial_actor_params(spec, home), writer)
            finally:
                warm.close()
            if params is None:  # stopped in the warm start, its checkpoint saved
                checkpoints.close()
                return {**summary, "seconds": time.perf_counter() - start, "interrupted": True}
            runner = build.fresh_runner(job, {}, params)  # offline graphs have no host MFCs
        else:
            print(f"resuming from checkpoint {resume.step} in {checkpoints.directory}",
                  flush=True)
            runner = resumed_runner(job, resume, restored[1], {})
        evaluate = make_evaluator(job, runner.runtimes[role], data, eval_pairs)
        before = evaluate() if resume is None else resume.evaluation_before
        print(f"held-out before {spec.name.value}: {before}", flush=True)
        rows = training_rows(job, data, pairs)
        if resume is not None:
            rows.restore(resume.iterator)
        try:
            interrupted = train_loop(job, runner, rows, writer, checkpoints, before)
        finally:
            runner.close()
            checkpoints.close()  # waits for background writes
        after = None if interrupted else evaluate()
        if after is not None:
            print(f"held-out after {spec.name.value}:  {after}")
            writer.write(spec.steps, {f"eval/{k}_{when}": v for when, m in
                                      (("before", before), ("after", after))
                                      for k, v in m.items()})
    for key in before:
        summary[f"{key}_before"] = before[key]
        summary[f"{key}_after"] = None if after is None else after[key]
    return {**summary, "seconds": time.perf_counter() - start, "recompiles": runner.compiles,
            "interrupted": interrupted}
