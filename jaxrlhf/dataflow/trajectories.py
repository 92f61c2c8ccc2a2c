"""Multi-turn rollouts: the policy and an environment take turns, the reward comes at the end.

Each turn, every unfinished trajectory's whole conversation so far is a prompt for the rollout
engine (`engine/generate.py`'s `Generator`, rows whose trajectory ended leave the batch), its
sampled turn is appended, and the environment (`data/environments.py`, in its process pool)
answers every live trajectory at once; its reply's ids (`data/transcript.py`) are appended too.
A trajectory ends when the environment says so, when the policy's turn or the reply would pass
the token budget, after `max_turns` policy turns, or when the environment fails on it (reward 0,
counted: more than `max_error_rate` of a step's trajectories failing stops the run).

Re-prefilling the conversation each turn is the simplest correct form: the issue's better one
keeps each row's KV in its slot and prefills only the reply (a follow-up).

The result has the layout of a generate call, so GRPO trains on it unchanged: [left-padded
first prompt (P) | trajectory (N), right-padded], and `response_mask_bn` is True only on tokens
the policy wrote, so environment tokens are attended to but never trained.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import jax
import numpy as np

from jaxrlhf.data.environments import EnvPool, EnvTurn
from jaxrlhf.data.rewards import ErrorCounts, RewardBatch
from jaxrlhf.data.tokenizer import Tokenizer, decode_response
from jaxrlhf.data.transcript import Transcript, TranscriptError
from jaxrlhf.dataflow.executors import HostFunctionError
from jaxrlhf.dataflow.runtime import ModelRuntime
from jaxrlhf.engine import buckets
from jaxrlhf.engine.generate import Generator
from jaxrlhf.mfc import MFC
from jaxrlhf.parallel.layout import Layout
from jaxrlhf.parallel.reshard import fetch, transfer


@dataclasses.dataclass(frozen=True)
class TrajectoryLimits:
    """max_turns: policy turns per trajectory; prompt_len: P, the first prompt's most ids;
    budget: N, the most ids after it (the policy's and the environment's together);
    max_error_rate: the largest share of a step's trajectories the environment may fail on."""

    max_turns: int
    prompt_len: int
    budget: int
    max_error_rate: float


class EnvironmentFailed(HostFunctionError):
    """The environment failed on too many trajectories of one step (one line): the loop stops
    the run with it as with a reward function's failures."""


@dataclasses.dataclass
class _Trajectory:
    row: dict
    conversation: list[dict]
    prompt_ids: list[int]
    ids: list[int] = dataclasses.field(default_factory=list)  # after the prompt
    policy: list[bool] = dataclasses.field(default_factory=list)
    logp: list[float] = dataclasses.field(default_factory=list)
    reward: float = 0.0
    turns: int = 0
    tool_calls: int = 0  # tool messages the environment answered with
    tool_errors: int = 0  # of them, those reporting a failed call ("error: ...")
    done: bool = False
    failed: bool = False


@dataclasses.dataclass(frozen=True)
class Trajectories:
    """A step's trajectories in generate layout (host arrays).

    Attributes:
      tokens_bs: int32 [b, P + W] (W: the longest trajectory's response width bucket).
      mask_bs: bool [b, P + W], True on every real token.
      policy_bn: bool [b, W], True on the tokens the policy wrote.
      logp_bn: float32 [b, W], their behaviour log-probs (0 elsewhere).
      rewards_b: float32 [b], the sum of each trajectory's turn rewards (0 where it failed).
      turns_b: int32 [b], policy turns; errors: the environment's failed calls.
      tool_error_rate: the share of the `tool` messages that report a failed call (starting
        "error:", as `data/tools.call_tool` writes them); 0 when there were none.
    """

    tokens_bs: np.ndarray
    mask_bs: np.ndarray
    policy_bn: np.ndarray
    logp_bn: np.ndarray
    rewards_b: np.ndarray
    turns_b: np.ndarray
    errors: ErrorCounts
    tool_error_rate: float


def _fail(t: _Trajectory) -> None:
    t.failed, t.done, t.reward = True, True, 0.0


def _record_failures(batch: RewardBatch, live: Sequence[_Trajectory], messages: list[str]):
    messages.extend(batch.messages)
    for t, ok in zip(live, batch.valid_b):
        if not ok:
            _fail(t)


def _generate_turn(generator: Generator, params, live: Sequence[_Trajectory], rng,
                   budget: int, pad_id: int, dp: int):
    """(sampled ids, their log-probs) of one policy turn of every live trajectory: the
    conversations left-padded as one batch (rounded up to the data-parallel size with copies of
    the first, which are dropped)."""
    contexts = [t.prompt_ids + t.ids for t in live]
    width = max(map(len, contexts))
    rows = -(-len(contexts) // dp) * dp
    tokens_bp = np.full((rows, width), pad_id, np.int32)
    mask_bp = np.zeros((rows, width), bool)
    limits_b = np.ones(rows, np.int32)
    for i in range(rows):
        ids = contexts[i] if i < len(contexts) else contexts[0]
        tokens_bp[i, width - len(ids):], mask_bp[i, width - len(ids):] = ids, True
        if i < len(live):
            limits_b[i] = budget - len(live[i].ids)
    out = generator(params, tokens_bp, mask_bp, rng, max_new_tokens_b=limits_b)
    response_bn, mask_bn, logp_bn = fetch((out.response_bn, out.response_mask_bn,
                                           out.logprobs_bn))
    return [(response_bn[i][mask_bn[i]].tolist(), logp_bn[i][mask_bn[i]].tolist())
            for i in range(len(live))]


def rollout(generator: Generator, params, rng, pool: EnvPool, transcript: Transcript,
            tokenizer: Tokenizer, rows: Sequence[dict], limits: TrajectoryLimits,
            dp: int = 1) -> Trajectories:
    """The trajectories of `rows` (each {"prompt", "answer"}), one per row.

    Raises:
      EnvironmentFailed: the environment failed on more than `max_error_rate` of them.
      ValueError: a first prompt longer than P ids.
    """
    messages: list[str] = []
    firsts, batch = pool.reset(rows).replies()
    trajectories = []
    for row, first in zip(rows, firsts):
        # A failed reset: the row's prompt alone stands in, so the row is not empty.
        first_messages = first or ({"role": "user", "content": row["prompt"]},)
        ids = transcript.first_ids(first_messages)
        if len(ids) > limits.prompt_len:
            raise ValueError(f"env.class: first messages of {len(ids)} tokens exceed "
                             f"rollout.max_prompt_len={limits.prompt_len}")
        trajectories.append(_Trajectory(row, list(first_messages), ids))
    _record_failures(batch, trajectories, messages)
    for turn in range(limits.max_turns):
        live = [t for t in trajectories if not t.done]
        if not live:
            break
        # The turn index goes up explicitly: steps run under transfer_guard("disallow").
        key = jax.random.fold_in(rng, jax.device_put(np.uint32(turn)))
        sampled = _generate_turn(generator, params, live, key, limits.budget, tokenizer.pad_id,
                                 dp)
        for t, (ids, logp) in zip(live, sampled):
            t.ids += ids
            t.policy += [True] * len(ids)
            t.logp += logp
            t.turns += 1
            t.conversation.append({"role": "assistant",
                                   "content": decode_response(tokenizer, ids)})
        replies, batch = pool.step([t.conversation for t in live], [t.row for t in live]
                                   ).replies()
        _record_failures(batch, live, messages)
        for t, (ids, _), reply in zip(live, sampled, replies):
            if reply is None:
                continue
            try:
                _take_reply(t, reply, ids, transcript, tokenizer, limits, turn)
            except TranscriptError as e:  # the template, not one trajectory: stop the run
                raise EnvironmentFailed(f"env.class: {e}") from None
    return _arrays(trajectories, limits, messages)


def _take_reply(t: _Trajectory, reply: EnvTurn, turn_ids: list[int], transcript: Transcript,
                tokenizer: Tokenizer, limits: TrajectoryLimits, turn: int) -> None:
    t.reward += reply.reward
    stopped = bool(turn_ids) and turn_ids[-1] in tokenizer.stop_ids
    if reply.done or not reply.messages or not stopped or turn + 1 >= limits.max_turns:
        t.done = True
        return
    ids = transcript.reply_ids(t.conversation, reply.messages)
    if len(t.ids) + len(ids) >= limits.budget:  # no room for the policy to answer: truncated
        t.done = True
        return
    t.ids += ids
    t.policy += [False] * len(ids)
    t.logp += [0.0] * len(ids)
    t.conversation.extend(reply.messages)
    tool = [m for m in reply.messages if m["role"] == "tool"]
    t.tool_calls += len(tool)
    t.tool_errors += sum(m["content"].startswith("error:") for m in tool)


def _arrays(trajectories: list[_Trajectory], limits: TrajectoryLimits,
            messages: list[str]) -> Trajectories:
    failed = sum(t.failed for t in trajectories)
    if trajectories and failed / len(trajectories) > limits.max_error_rate:
        raise EnvironmentFailed(
            f"environment failed on {failed} of {len(trajectories)} trajectories this step "
            f"(env.max_error_rate={limits.max_error_rate}): {'; '.join(messages[:3])}")
    p = limits.prompt_len
    longest = max((len(t.ids) for t in trajectories), default=0)
    w = buckets.bucket_length(max(longest, 1), buckets.response_widths(limits.budget))
    b = len(trajectories)
    tokens_bs, mask_bs = np.zeros((b, p + w), np.int32), np.zeros((b, p + w), bool)
    policy_bn, logp_bn = np.zeros((b, w), bool), np.zeros((b, w), np.float32)
    for i, t in enumerate(trajectories):
        n = len(t.ids)
        tokens_bs[i, p - len(t.prompt_ids):p + n] = t.prompt_ids + t.ids
        mask_bs[i, p - len(t.prompt_ids):p + n] = True
        policy_bn[i, :n], logp_bn[i, :n] = t.policy, t.logp
    calls = sum(t.tool_calls for t in trajectories)
    return Trajectories(tokens_bs, mask_bs, policy_bn, logp_bn,
                        np.array([t.reward for t in trajectories], np.float32),
                        np.array([t.turns for t in trajectories], np.int32),
                        ErrorCounts(exception=failed),
                        sum(t.tool_errors for t in trajectories) / max(calls, 1))


def trajectory_executor(mfc: MFC, model: ModelRuntime, layout: Layout, generator: Generator,
                        rng_of_step: Callable[[], jax.Array], pool: EnvPool,
                        tokenizer: Tokenizer, limits: TrajectoryLimits,
                        on_result: Callable[[Trajectories], None]):
    """The generate MFC of a multi-turn run: reads the prompt rows (`prompt_text`, `answer`)
    and writes its outputs in order: sequence tokens [b, s], sequence mask [b, s], policy-token
    mask [b, n] (as the response mask), behaviour log-probs [b, n], trajectory rewards [b]."""
    transcript = Transcript(tokenizer)

    def run(buf):
        rows = [{"prompt": p, "answer": a} for p, a in zip(buf["prompt_text"], buf["answer"])]
        out = rollout(generator, model.params_on(layout), rng_of_step(), pool, transcript,
                      tokenizer, rows, limits, layout.dp_size)
        on_result(out)
        host = (out.tokens_bs, out.mask_bs, out.policy_bn, out.logp_bn, out.rewards_b)
        placed = transfer(host, tuple(layout.batch_sharding(x.ndim) for x in host))
        return dict(zip(mfc.outputs, placed, strict=True))

    return run
