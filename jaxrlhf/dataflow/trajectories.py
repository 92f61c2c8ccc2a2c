"""Multi-turn rollouts: the policy and an environment take turns, the reward comes at the end.

Turns stream through the rollout engine (`engine/rollout/`, the generator's engine for
prompts of P + N ids): a trajectory ready for its turn waits in a queue, takes a free slot, where
its whole conversation so far is prefilled as the prompt, and decodes; a row that ends its turn
gives up its slot, and its conversation goes to the environment (`data/environments.py`, one
call in its process pool) while the other rows keep decoding and queued ones take the slot.
When the reply arrives, its ids (`data/transcript.py`) are appended and the trajectory is
queued again. So a slow environment costs a trajectory its own time, not the batch's.

A trajectory ends when the environment says so, when the policy's turn or the reply would pass
the token budget, after `max_turns` policy turns, or when the environment fails on it (reward 0,
counted: more than `max_error_rate` of a step's trajectories failing stops the run).

Each turn's sampling stream is fixed by the trajectory and the turn alone (row i * max_turns +
j of the rollout's key), so the trajectories do not depend on the environment's timing nor on
the slot a turn lands in. Re-prefilling the conversation each turn costs a prefill of P + N
tokens per turn; keeping the row's KV in its slot while it waits would hold the slot idle.

The result has the layout of a generate call, so GRPO trains on it unchanged: [left-padded
first prompt (P) | trajectory (N), right-padded], and `response_mask_bn` is True only on tokens
the policy wrote, so environment tokens are attended to but never trained.
"""

from __future__ import annotations

import collections
import dataclasses
import time
from collections.abc import Callable, Sequence

import jax
import numpy as np

from jaxrlhf.data.environments import EnvHandle, EnvPool, EnvTurn
from jaxrlhf.data.rewards import ErrorCounts, RewardBatch
from jaxrlhf.data.tokenizer import Tokenizer, decode_response
from jaxrlhf.data.transcript import Transcript, TranscriptError
from jaxrlhf.dataflow.executors import HostFunctionError
from jaxrlhf.dataflow.runtime import ModelRuntime
from jaxrlhf.engine import buckets
from jaxrlhf.engine.generate import Generator
from jaxrlhf.engine.rollout import Rollout
from jaxrlhf.mfc import MFC
from jaxrlhf.parallel.layout import Layout
from jaxrlhf.parallel.reshard import transfer


# The most tokens decoded between looks at the slots (a sync point on a few scalars). A chunk
# ends early as soon as a row ends its turn, so that its environment call starts at once; a
# reply that arrives meanwhile takes a free slot only at a chunk's end, so chunks are short.
TURN_CHUNK_TOKENS = 8


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
    turn_rewards: dict[int, float] = dataclasses.field(default_factory=dict)  # at: reward
    turns: int = 0
    turn_ids: list[int] = dataclasses.field(default_factory=list)  # the policy's last turn
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
      turn_rewards_bn: float32 [b, W], each turn's reward on the last token of the policy's
        turn it answered (0 elsewhere, and where the trajectory failed); rows sum to rewards_b.
      turns_b: int32 [b], policy turns; errors: the environment's failed calls.
      tool_error_rate: the share of the `tool` messages that report a failed call (starting
        "error:", as `data/tools.call_tool` writes them); 0 when there were none.
    """

    tokens_bs: np.ndarray
    mask_bs: np.ndarray
    policy_bn: np.ndarray
    logp_bn: np.ndarray
    rewards_b: np.ndarray
    turn_rewards_bn: np.ndarray
    turns_b: np.ndarray
    errors: ErrorCounts
    tool_error_rate: float


def _fail(t: _Trajectory) -> None:
    t.failed, t.done, t.reward, t.turn_rewards = True, True, 0.0, {}


def _record_failures(batch: RewardBatch, live: Sequence[_Trajectory], messages: list[str]):
    messages.extend(batch.messages)
    for t, ok in zip(live, batch.valid_b):
        if not ok:
            _fail(t)


def _start(pool: EnvPool, transcript: Transcript, rows: Sequence[dict],
           limits: TrajectoryLimits, messages: list[str]) -> list[_Trajectory]:
    """Every row's trajectory from its environment's first messages (reset in one batch)."""
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
    return trajectories


class _Stream:
    """One rollout's scheduling state on the host: which trajectory each slot decodes, which
    wait on their environment (one pool call each) and which are ready for their next turn."""

    def __init__(self, engine: Rollout, params, key, trajectories: list[_Trajectory],
                 limits: TrajectoryLimits, slots: int):
        self.engine, self.params, self.key = engine, params, key
        self.trajectories, self.limits = trajectories, limits
        self.ready = collections.deque(i for i, t in enumerate(trajectories) if not t.done)
        self.waiting: dict[int, EnvHandle] = {}
        self.in_slot = [-1] * slots  # the trajectory each slot decodes, -1: free
        self.state = engine.vacant(slots)  # built by the first fill
        self.longest = 0  # at least every busy slot's response length so far

    def busy(self) -> bool:
        return any(i >= 0 for i in self.in_slot)

    def fill(self, pad_id: int) -> None:
        """Ready trajectories into free slots, each conversation prefilled as a prompt of the
        engine's length P. Trajectory i's turn j samples as row i * max_turns + j of the
        rollout's key: its tokens depend on nothing else (not on which slot, or when)."""
        free = [s for s, i in enumerate(self.in_slot) if i < 0]
        take = [self.ready.popleft() for _ in range(min(len(free), len(self.ready)))]
        if not take:
            return
        p = self.engine.prompt_len
        tokens_kp, mask_kp = np.full((len(take), p), pad_id, np.int32), np.zeros((len(take), p),
                                                                                 bool)
        streams_k, limits_k = np.zeros(len(take), np.int32), np.zeros(len(take), np.int32)
        for k, i in enumerate(take):
            t = self.trajectories[i]
            ids = t.prompt_ids + t.ids
            tokens_kp[k, p - len(ids):], mask_kp[k, p - len(ids):] = ids, True
            streams_k[k] = i * self.limits.max_turns + t.turns
            limits_k[k] = self.limits.budget - len(t.ids)
        targets = self.engine.spread(free, len(self.in_slot))[:len(take)]
        self.state = self.engine.fill(self.state, self.params, 0, targets, tokens_kp, mask_kp,
                                      [self.key] * len(take), streams_k, limits_k)
        for s, i in zip(targets, take):
            self.in_slot[s] = i
        self.longest = max(self.longest, 1)

    def advance(self) -> list[tuple[int, list[int], list[float]]]:
        """Decodes a chunk of tokens in every busy slot; (trajectory, its turn's ids, their
        log-probs) of each row that ended its turn, whose slot is then free."""
        busy = sum(i >= 0 for i in self.in_slot)
        self.state = self.engine.advance(self.state, self.params, 0, TURN_CHUNK_TOKENS,
                                         self.longest, stop_busy=busy - 1)
        done_b, counts = self.engine.poll(self.state)
        self.longest = int(counts[2])
        ended = [s for s, i in enumerate(self.in_slot) if i >= 0 and done_b[s]]
        if not ended:
            return []
        rows = self.engine.rows(self.state)
        p = self.engine.prompt_len
        turns = []
        for s in ended:
            mask_n = rows.response_mask_bn[s]
            turns.append((self.in_slot[s], rows.sequences_bs[s, p:][mask_n].tolist(),
                          rows.logprobs_bn[s][mask_n].tolist()))
            self.in_slot[s] = -1
        return turns


def _wait_any(handles) -> None:
    """Blocks until one of `handles` is done (they share no event: short sleeps between looks;
    the pool's per-call timeout bounds the wait)."""
    while not any(h.done() for h in handles):
        time.sleep(0.001)


def rollout(generator: Generator, params, rng, pool: EnvPool, transcript: Transcript,
            tokenizer: Tokenizer, rows: Sequence[dict], limits: TrajectoryLimits,
            slots: int | None = None) -> Trajectories:
    """The trajectories of `rows` (each {"prompt", "answer"}), one per row, streamed through
    the generator's rollout engine (module docstring).

    Args:
      slots: rows decoded at once (a multiple of the data-parallel size); default: one per
        trajectory (rounded up).

    Raises:
      EnvironmentFailed: the environment failed on more than `max_error_rate` of them, or its
        replies cannot be appended (the chat template rewrites the conversation).
      ValueError: a first prompt longer than P ids; a pipelined layout.
    """
    if not generator.on_engine:
        raise ValueError(f"multi-turn rollouts stream turns through the rollout engine, which a "
                         f"pipelined layout ({generator.layout}) does not run: give actor_gen a "
                         "layout without pipeline stages")
    messages: list[str] = []
    trajectories = _start(pool, transcript, rows, limits, messages)
    dp = generator.layout.dp_size
    slots = -(-max(len(rows), 1) // dp) * dp if slots is None else slots
    engine = generator.rollout_engine(limits.prompt_len + limits.budget, slots)
    stream = _Stream(engine, params, transfer(rng, generator.layout.replicated()), trajectories,
                     limits, slots)
    while stream.ready or stream.waiting or stream.busy():
        _take_replies(stream, transcript, tokenizer, messages)
        stream.fill(tokenizer.pad_id)
        if not stream.busy():  # every unfinished trajectory waits on its environment
            if stream.waiting:
                _wait_any(stream.waiting.values())
            continue
        for i, ids, logp in stream.advance():
            t = trajectories[i]
            t.ids, t.policy, t.logp = t.ids + ids, t.policy + [True] * len(ids), t.logp + logp
            t.turn_ids, t.turns = ids, t.turns + 1
            t.conversation.append({"role": "assistant",
                                   "content": decode_response(tokenizer, ids)})
            stream.waiting[i] = pool.step([t.conversation], [t.row])
    return _arrays(trajectories, limits, messages)


def _take_replies(stream: _Stream, transcript: Transcript, tokenizer: Tokenizer,
                  messages: list[str]) -> None:
    """Every reply that arrived: appended to its trajectory, which is ready for its next turn
    unless it ended."""
    for i in [i for i, handle in stream.waiting.items() if handle.done()]:
        t = stream.trajectories[i]
        (reply,), batch = stream.waiting.pop(i).replies()
        _record_failures(batch, [t], messages)
        if reply is None:
            continue
        try:
            _take_reply(t, reply, transcript, tokenizer, stream.limits)
        except TranscriptError as e:  # the template, not one trajectory: stop the run
            raise EnvironmentFailed(f"env.class: {e}") from None
        if not t.done:
            stream.ready.append(i)


def _take_reply(t: _Trajectory, reply: EnvTurn, transcript: Transcript, tokenizer: Tokenizer,
                limits: TrajectoryLimits) -> None:
    t.reward += reply.reward
    t.turn_rewards[len(t.ids) - 1] = reply.reward  # the turn's last token: the reply follows it
    stopped = bool(t.turn_ids) and t.turn_ids[-1] in tokenizer.stop_ids
    if reply.done or not reply.messages or not stopped or t.turns >= limits.max_turns:
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
    turn_rewards_bn = np.zeros((b, w), np.float32)
    for i, t in enumerate(trajectories):
        n = len(t.ids)
        tokens_bs[i, p - len(t.prompt_ids):p + n] = t.prompt_ids + t.ids
        mask_bs[i, p - len(t.prompt_ids):p + n] = True
        policy_bn[i, :n], logp_bn[i, :n] = t.policy, t.logp
        for at, reward in t.turn_rewards.items():
            turn_rewards_bn[i, at] = reward
    calls = sum(t.tool_calls for t in trajectories)
    return Trajectories(tokens_bs, mask_bs, policy_bn, logp_bn,
                        np.array([t.reward for t in trajectories], np.float32),
                        turn_rewards_bn, np.array([t.turns for t in trajectories], np.int32),
                        ErrorCounts(exception=failed),
                        sum(t.tool_errors for t in trajectories) / max(calls, 1))


def trajectory_executor(mfc: MFC, model: ModelRuntime, layout: Layout, generator: Generator,
                        rng_of_step: Callable[[], jax.Array], pool: EnvPool,
                        tokenizer: Tokenizer, limits: TrajectoryLimits,
                        on_result: Callable[[Trajectories], None]):
    """The generate MFC of a multi-turn run: reads the prompt rows (`prompt_text`, `answer`)
    and writes those of its outputs its MFC names: sequence tokens `seq_tokens_bs`, sequence
    mask `seq_mask_bs`, policy-token mask `response_mask_bn`, behaviour log-probs
    `behav_logp_bn`, trajectory rewards `scores_b`, turn rewards `turn_rewards_bn`."""
    transcript = Transcript(tokenizer)

    def run(buf):
        rows = [{"prompt": p, "answer": a} for p, a in zip(buf["prompt_text"], buf["answer"])]
        out = rollout(generator, model.params_on(layout), rng_of_step(), pool, transcript,
                      tokenizer, rows, limits)
        on_result(out)
        arrays = {"seq_tokens_bs": out.tokens_bs, "seq_mask_bs": out.mask_bs,
                  "response_mask_bn": out.policy_bn, "behav_logp_bn": out.logp_bn,
                  "scores_b": out.rewards_b, "turn_rewards_bn": out.turn_rewards_bn}
        host = tuple(arrays[name] for name in mfc.outputs)
        placed = transfer(host, tuple(layout.batch_sharding(x.ndim) for x in host))
        return dict(zip(mfc.outputs, placed, strict=True))

    return run
