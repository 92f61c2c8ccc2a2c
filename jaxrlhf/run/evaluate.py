"""Held-out evaluation of the actor, following the run's reward.

Before and after training (and every `eval.every` steps) the actor answers the held-out prompts
greedily on the generation layout. What is reported depends on what the data and the run have:

  * `reward`: the mean reward of those responses under the run's own reward, always: its host
    function (in a process pool of its own, with the run's timeout: a failure scores 0) or its
    reward model (scored at each sequence's last real token, as in training);
  * `accuracy`: only when every held-out row has an `answer`: the fraction of responses the
    verifier accepts (score >= 1). The verifier is the reward function when the reward is a
    function (exact match, `math`, ...), and exact match when it is a model, so a learned
    reward is never its own judge.

A multi-turn run (`env.name`) evaluates greedy trajectories with its environment instead:
`reward` (their mean), `accuracy` (the share with reward >= 1), `turns` and `tool_error_rate`.

With `eval.samples = n > 0`, the periodic evaluation also samples n responses per prompt at the
rollout temperature and reports `pass@1`, `pass@n` (unbiased, Chen et al. 2021) and `mean@n` of
the verifier (see `data/evaluation.py`). Metric names carry the `eval/` prefix in metrics.jsonl
and TensorBoard.

Offline runs evaluate their trained model before and after training (`evaluator`);
the job's summary `accuracy` means what the algorithm's `Evaluation` says:

  SFT               greedy exact-match accuracy on the held-out prompts (also `eval_loss`:
                    token NLL of their reference answers);
  PREFERENCE_LOGP   (DPO) held-out preference accuracy of the policy: log π(chosen) >
                    log π(rejected), summed over the response tokens (also `exact_match`);
  PREFERENCE_SCORE  (RW) held-out preference accuracy of the reward model: r(chosen) >
                    r(rejected).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import jax
import numpy as np

from jaxrlhf.algorithms.spec import Evaluation
from jaxrlhf.data.datasets import PromptRow
from jaxrlhf.data.encode import prompt_batch, sequence_batch
from jaxrlhf.data.evaluation import eval_metrics
from jaxrlhf.data.rewards import RewardPool, exact_match
from jaxrlhf.data.environments import EnvPool
from jaxrlhf.data.tokenizer import decode_response
from jaxrlhf.data.transcript import Transcript
from jaxrlhf.dataflow.runtime import ModelRuntime
from jaxrlhf.dataflow.trajectories import TrajectoryLimits, rollout
from jaxrlhf.engine.generate import make_generate_fn
from jaxrlhf.engine.inference import InferenceBatch, InferenceConfig, InferenceKind
from jaxrlhf.engine.inference import make_inference_fn
from jaxrlhf.mfc import Call, Role
from jaxrlhf.parallel.layout import Layout
from jaxrlhf.parallel.reshard import fetch
from jaxrlhf.run.build import actor_copy
from jaxrlhf.run.check import Job
from jaxrlhf.run.runner import Runner
from jaxrlhf.spec import RolloutSpec


def _padded_rows(rows: Sequence[PromptRow], repeat: int, multiple: int) -> list[PromptRow]:
    """`rows` cycled until len * repeat is a multiple of `multiple` (the extra rows are
    generated but never scored)."""
    count = len(rows)
    while (count * repeat) % multiple:
        count += 1
    return [rows[i % len(rows)] for i in range(count)]


@dataclasses.dataclass
class Responses:
    """Generated responses of `repeat` samples per prompt (sample j of prompt i at row
    i·repeat + j), the first `len(rows)*repeat` rows.

    seq_bs, mask_bs: int/bool [rows·repeat, P+N] host arrays (prompt + response, real tokens).
    texts: decoded responses (up to the first stop id).
    """

    seq_bs: np.ndarray
    mask_bs: np.ndarray
    texts: list[str]
    lengths_b: np.ndarray  # int [rows·repeat]: each response's real tokens


@dataclasses.dataclass(frozen=True)
class Scorer:
    """Forward passes of one model over held-out rows (the reward model's of generated
    responses, an offline run's of (prompt, response) texts), on one layout."""

    infer: Callable
    dp: int
    tokenizer: object
    rollout: RolloutSpec

    def infer_rows(self, params, seq_bs: np.ndarray, mask_bs: np.ndarray):
        """The model's output on int/bool [b, P+N] host rows, cycled to whole rows per device
        (its first b rows are theirs)."""
        rows = _padded_rows(list(range(len(seq_bs))), 1, self.dp)
        return self.infer(params, InferenceBatch.padded(seq_bs[rows], mask_bs[rows]))

    def _rows(self, prompts: list[str], responses: list[str]) -> dict[str, np.ndarray]:
        """The (prompt, response) texts as token rows (`data.encode.sequence_batch`)."""
        r = self.rollout
        return sequence_batch(prompts, responses, self.tokenizer, r.max_prompt_len,
                              r.max_new_tokens)

    def row_scores(self, params, seq_bs: np.ndarray, mask_bs: np.ndarray) -> np.ndarray:
        """float [b]: the model's score at each host row's last real token."""
        out = self.infer_rows(params, seq_bs, mask_bs)
        return np.asarray(fetch(out.scores_bk))[: len(seq_bs), 0]  # any process

    def scores(self, params, prompts, responses) -> np.ndarray:
        batch = self._rows(prompts, responses)
        return self.row_scores(params, batch["seq_tokens_bs"], batch["seq_mask_bs"])

    def response_logprobs(self, params, prompts, responses) -> tuple[np.ndarray, np.ndarray]:
        """([b] Σ log p of each response incl. EOS, [b] its token count)."""
        batch = self._rows(prompts, responses)
        out = self.infer_rows(params, batch["seq_tokens_bs"], batch["seq_mask_bs"])
        mask_bn = batch["response_mask_bn"]
        logp_bn = fetch(out.logprobs_bt)[: len(prompts), -mask_bn.shape[1]:]  # any process
        return np.sum(logp_bn * mask_bn, axis=1), np.sum(mask_bn, axis=1)


def make_scorer(runtime: ModelRuntime, kind: InferenceKind, job: Job) -> Scorer:
    r = job.spec.rollout
    infer = make_inference_fn(runtime.config, InferenceConfig(kind), runtime.home,
                              length_buckets=(r.seq_len,))
    return Scorer(infer, runtime.home.dp_size, job.tokenizer, r)


def sampling_key(seed: int, step: int) -> jax.Array:
    """The key the periodic evaluation after update `step` of a run seeded `seed` samples
    with (so that `python -m jaxrlhf.evaluate` on that checkpoint draws the same samples)."""
    return jax.random.fold_in(jax.random.key(seed + 1), step)


class HeldOut:
    """The held-out evaluation of one run (see the module docstring).

    Args:
      job: the checked job (spec, tokenizer, plan, its held-out rows).
      layout: the generation layout the actor's parameters are given on (default: the actor's
        generation layout, or an offline run's trained model's home, where its parameters are).
    """

    def __init__(self, job: Job, layout: Layout | None = None):
        spec, rows = job.spec, job.data.eval
        self._job, self.layout = job, generation_layout(job) if layout is None else layout
        self._rows = list(rows[:spec.evaluation.max_prompts] if spec.evaluation.max_prompts
                          else rows)
        self.has_answers = bool(self._rows) and all(r.answer is not None for r in self._rows)
        r = spec.rollout
        gen = lambda greedy: make_generate_fn(
            spec.base.config, r.generate(job.tokenizer, greedy=greedy), self.layout,
            prompt_buckets=(r.max_prompt_len,))
        self._greedy = gen(True)
        self._sampling = gen(False) if spec.evaluation.samples else None
        self._reward_spec = spec.rewards.get(Role.REWARD)  # None: a reward model
        self._pool: RewardPool | None = None
        self._env_pool: EnvPool | None = None
        self._reward_scorer: Scorer | None = None

    # --- scoring ---------------------------------------------------------------------------

    def _function_scores(self, rows: Sequence[PromptRow], texts: list[str]
                         ) -> tuple[np.ndarray, int]:
        """(float [len(texts)] rewards of the run's reward function, 0 where a call failed;
        the number of failed calls)."""
        if self._pool is None:
            f = self._reward_spec
            self._pool = RewardPool(f.function, num_workers=f.workers, timeout_s=f.timeout)
        handle = self._pool.submit([r.prompt for r in rows], texts, [r.answer for r in rows])
        result = handle.result()
        return result.rewards_b.astype(np.float64), result.errors.total

    def _model_scores(self, reward: ModelRuntime, responses: Responses) -> np.ndarray:
        """float [rows]: the reward model's score at each sequence's last real token."""
        if self._reward_scorer is None:
            self._reward_scorer = make_scorer(reward, InferenceKind.SCORES, self._job)
        scores = self._reward_scorer.row_scores(reward.params, responses.seq_bs,
                                                responses.mask_bs)
        reward.after_call()  # a frozen reward model goes back to host memory if it waits there
        return scores.astype(np.float64)

    def _verdicts(self, rows: Sequence[PromptRow], texts: list[str],
                  rewards: np.ndarray | None) -> np.ndarray:
        """float [len(texts)]: the verifier's score of each response (see module docstring)."""
        if self._reward_spec is not None:
            return rewards if rewards is not None else self._function_scores(rows, texts)[0]
        return np.array([exact_match(r.prompt, t, r.answer) for r, t in zip(rows, texts)])

    # --- generation ------------------------------------------------------------------------

    def _generate(self, generator, params, repeat: int, rng,
                  rows: Sequence[PromptRow] | None = None) -> Responses:
        tokenizer, p = self._job.tokenizer, self._job.spec.rollout.max_prompt_len
        rows = self._rows if rows is None else rows
        batch = prompt_batch(_padded_rows(rows, repeat, self.layout.dp_size), tokenizer, p,
                             repeat)
        out = generator(params, batch["prompt_tokens_bp"], batch["prompt_mask_bp"], rng)
        n = len(rows) * repeat  # every process scores all rows
        seq_bs, prompt_mask_bp, mask_bn = fetch((out.sequences_bs, out.prompt_mask_bp,
                                                 out.response_mask_bn))
        seq_bs, mask_bn = np.asarray(seq_bs)[:n], np.asarray(mask_bn)[:n]
        mask_bs = np.concatenate([np.asarray(prompt_mask_bp)[:n], mask_bn], axis=1)
        texts = [decode_response(tokenizer, row[p:].tolist()) for row in seq_bs]
        return Responses(seq_bs, mask_bs, texts, mask_bn.sum(axis=1))

    def responses(self, params, rows: Sequence[PromptRow], repeat: int, rng, *,
                  greedy: bool) -> Responses:
        """`repeat` responses to each of `rows` (greedy, or sampled as the periodic evaluation
        samples: with eval.samples > 0), in one generate call."""
        return self._generate(self._greedy if greedy else self._sampling, params, repeat, rng,
                              rows)

    def score(self, rows: Sequence[PromptRow], texts: list[str]) -> tuple[np.ndarray, int]:
        """(float [len(texts)] rewards of the run's reward function, 0 where a call failed;
        the number of failed calls); row i of `rows` goes with text i."""
        return self._function_scores(rows, texts)

    # --- evaluations -----------------------------------------------------------------------

    def greedy(self, params, reward: ModelRuntime | None = None) -> dict[str, float]:
        """{"reward": mean reward, "accuracy" (only with answers)} of greedy responses, and
        "reward_errors" (failed calls) when the reward is a function.

        Args:
          params: the actor's parameters on the generation layout.
          reward: the reward model's runtime when the run's reward is a model; None skips
            the model's mean reward (before the runner exists it is not loaded yet).
        """
        if not self._rows:
            return {}
        if self._job.spec.env is not None:
            return self._greedy_trajectories(params)
        responses = self._generate(self._greedy, params, 1, jax.random.key(0))
        metrics, rewards = {}, None
        if self._reward_spec is not None:
            rewards, errors = self._function_scores(self._rows, responses.texts)
            metrics["reward_errors"] = float(errors)
        elif reward is not None:
            rewards = self._model_scores(reward, responses)
        if rewards is not None:
            metrics["reward"] = float(rewards.mean())
        if self.has_answers:
            verdicts = self._verdicts(self._rows, responses.texts, rewards)
            metrics["accuracy"] = float(np.mean(verdicts >= 1.0))
        return metrics

    def _greedy_trajectories(self, params) -> dict[str, float]:
        """A multi-turn run's greedy trajectories with its environment: the mean reward, the
        success rate (`accuracy`: reward >= 1), turns per trajectory, the tool-call error rate
        and the environment's failed trajectories (scored 0; they never stop an evaluation)."""
        spec = self._job.spec
        if self._env_pool is None:
            e = spec.env
            self._env_pool = EnvPool(e.spec, num_workers=e.workers, timeout_s=e.timeout)
        limits = TrajectoryLimits(spec.env.max_turns, spec.rollout.max_prompt_len,
                                  spec.rollout.max_new_tokens, max_error_rate=1.0)
        out = rollout(self._greedy, params, jax.random.key(0), self._env_pool,
                      Transcript(self._job.tokenizer), self._job.tokenizer,
                      [{"prompt": r.prompt, "answer": r.answer} for r in self._rows], limits)
        return {"reward": float(out.rewards_b.mean()),
                "accuracy": float(np.mean(out.rewards_b >= 1.0)),
                "turns": float(out.turns_b.mean()), "tool_error_rate": out.tool_error_rate,
                "reward_errors": float(out.errors.total)}

    def periodic(self, params, step: int, reward: ModelRuntime | None = None
                 ) -> dict[str, float]:
        """`eval/`-prefixed metrics of step `step`: the greedy ones, and with eval.samples = n
        and answers, pass@1, pass@n and mean@n of n sampled responses per prompt."""
        out = {f"eval/{k}": v for k, v in self.greedy(params, reward).items()}
        n = self._job.spec.evaluation.samples
        if n and self.has_answers and self._job.spec.env is None:  # single turns only
            rng = sampling_key(self._job.spec.seed, step)
            responses = self._generate(self._sampling, params, n, rng)
            rows = [r for r in self._rows for _ in range(n)]
            verdicts = self._verdicts(rows, responses.texts, None)
            ks = tuple(sorted({1, n}))
            out.update(eval_metrics(verdicts.reshape(len(self._rows), n), ks, prefix="eval"))
        return out

    def due(self, steps_done: int) -> bool:
        every = self._job.spec.evaluation.every
        return every > 0 and steps_done % every == 0 and bool(self._rows)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.close()
            self._pool = None
        if self._env_pool is not None:
            self._env_pool.close()
            self._env_pool = None

    def __enter__(self) -> HeldOut:
        return self

    def __exit__(self, *exc) -> None:
        self.close()  # also when the run raises: no reward worker outlives it


# --- offline runs (SFT, DPO, reward modelling) -----------------------------------------

Evaluator = Callable[[], dict[str, float]]


def evaluator(job: Job, runner: Runner, held_out: HeldOut) -> Evaluator:
    """The run's held-out evaluation before and after training, by its algorithm's
    `Evaluation` (module docstring), on `held_out`'s layout."""
    runtime = runner.runtimes[job.spec.algorithm.trained_role]
    pairs = job.data.eval_pairs
    prompts = [p.prompt for p in pairs]
    chosen, rejected = [p.chosen for p in pairs], [p.rejected for p in pairs]
    params = lambda: runtime.params
    match job.spec.algorithm.evaluation:
        case Evaluation.EXACT_MATCH:  # the runner holds the reward model, if there is one
            return lambda: held_out.greedy(
                actor_copy(params(), job.spec.base.config, held_out.layout),
                runner.runtimes.get(Role.REWARD))
        case Evaluation.PREFERENCE_SCORE:
            scorer = make_scorer(runtime, InferenceKind.SCORES, job)
            return lambda: {"accuracy": float(np.mean(
                scorer.scores(params(), prompts, chosen)
                > scorer.scores(params(), prompts, rejected)))}
        case Evaluation.SFT:
            scorer = make_scorer(runtime, InferenceKind.LOGPROBS, job)
            answered = [row for row in job.data.eval if row.answer is not None]

            def sft_metrics():  # greedy exact match, and the answers' token NLL
                logp_b, count_b = scorer.response_logprobs(
                    params(), [r.prompt for r in answered], [r.answer for r in answered])
                return {**held_out.greedy(params()),
                        "eval_loss": float(-logp_b.sum() / count_b.sum())}

            return sft_metrics
        case Evaluation.PREFERENCE_LOGP:
            scorer = make_scorer(runtime, InferenceKind.LOGPROBS, job)

            def dpo_metrics():
                logp_chosen_b, _ = scorer.response_logprobs(params(), prompts, chosen)
                logp_rejected_b, _ = scorer.response_logprobs(params(), prompts, rejected)
                greedy = held_out.greedy(params())  # its accuracy is exact match
                return {"accuracy": float(np.mean(logp_chosen_b > logp_rejected_b)),
                        **{"exact_match": v for k, v in greedy.items() if k == "accuracy"}}

            return dpo_metrics


def generation_layout(job: Job) -> Layout:
    """Where the held-out evaluation generates by default (`HeldOut`)."""
    spec, layouts = job.spec, job.plan.layouts
    return next((layouts[m.name] for m in spec.graph.mfcs
                 if m.role is Role.ACTOR and m.call is Call.GENERATE),
                job.plan.home(spec.graph, spec.algorithm.trained_role))
