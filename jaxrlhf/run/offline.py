"""The offline job: SFT, reward modelling and DPO on a fixed dataset, through the same runner.

The job mirrors the RL job: data (the built-in task or user files), the optional supervised
warm start of the actor, held-out evaluation before and after, one runner step per batch, a
progress bar, metrics.jsonl and TensorBoard events, checkpoints (`checkpoint.every`, Ctrl-C and
SIGTERM save and stop, a rerun resumes exactly; `python -m jaxrlhf.export` writes the trained
model as a Hugging Face directory), and a summary whose `accuracy_before` / `accuracy_after`
mean what the algorithm's `Evaluation` says (`run/evaluate.py`, `offline_evaluator`).

Preference pairs are batched as chosen rows then rejected rows (`algorithms.pairs`).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Sequence

import numpy as np

from jaxrlhf.algorithms.spec import BatchKind
from jaxrlhf.data import datasets
from jaxrlhf.data.encode import sequence_batch, sft_batch
from jaxrlhf.metrics import MetricsWriter
from jaxrlhf.run import rl
from jaxrlhf.run.check import Job
from jaxrlhf.run.evaluate import offline_evaluator

def preference_batch(rows: Sequence[datasets.PreferenceRow], tokenizer, max_prompt_len: int,
                     max_new_tokens: int) -> dict[str, np.ndarray]:
    """The B pairs as 2B sequence rows: chosen responses, then rejected ones (same prompts)."""
    prompts = [r.prompt for r in rows]
    responses = [r.chosen for r in rows] + [r.rejected for r in rows]
    return sequence_batch(prompts + prompts, responses, tokenizer, max_prompt_len, max_new_tokens)


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
    spec, name = job.spec, job.spec.algorithm.name
    paired = spec.algorithm.batches is BatchKind.PAIRS
    with rl.begin(job) as start, MetricsWriter(job.workdir) as writer:
        runner = start.runner(job, writer, {})  # offline graphs have no host MFCs
        if runner is None:  # stopped in the warm start, its checkpoint saved
            return rl.summary(job, t0, start, None, None, {}, None)
        evaluate = offline_evaluator(job, runner.runtimes[spec.algorithm.trained_role])
        with contextlib.closing(runner):
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
    return rl.summary(job, t0, start, runner, loop, before, after)
