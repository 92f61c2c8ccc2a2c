"""Multi-turn rollouts: the policy and an environment take turns, the reward comes at the end.

Turns stream through the rollout engine (`engine/rollout/`, the generator's engine for
prompts of P + N ids) as requests of its scheduler (`engine.rollout.scheduler`), whose
continuation is the environment: a trajectory ready for its turn waits in a queue, takes a
free slot, where its whole conversation so far is prefilled as the prompt, and decodes; a row
that ends its turn gives up its slot, and its conversation goes to the environment
(`data/environments.py`, one call in its process pool) while the other rows keep decoding and
queued ones take the slot.
When the reply arrives, its ids (`data/transcript.py`) are appended and the trajectory is
queued again. So a slow environment costs a trajectory its own time, not the batch's.

A trajectory ends when the environment says so, when the policy's turn or the reply would pass
the token budget, after `max_turns` policy turns, or when the environment fails on it (reward 0,
counted: more than `max_error_rate` of a step's trajectories failing stops the run). A stop
signal abandons the rollout between the scheduler's rounds (`rollout`'s `stop`), its
environment calls cancelled: a slow environment never holds the stop.

Each turn's sampling stream is fixed by the trajectory and the turn alone (row i * max_turns +
j of the rollout's key), so the trajectories do not depend on the environment's timing nor on
the slot a turn lands in. Re-prefilling the conversation each turn costs a prefill of P + N
tokens per turn; keeping the row's KV in its slot while it waits would hold the slot idle.

The result has the layout of a generate call, so GRPO trains on it unchanged: [left-padded
first prompt (P) | trajectory (N), right-padded], and `response_mask_bn` is True only on tokens
the policy wrote, so environment tokens are attended to but never trained.

A model with experts records which ones each token used (routing replay, `engine.replay`):
every token keeps those of the first forward that fed it. The first prompt's come from the
first turn's prefill, the policy's tokens from the decode steps that fed them, and the
environment's (and each turn's last policy token, never fed in its turn) from the prefill of
the next turn, under the weights that sampled that turn's first token from them
(docs/ARCHITECTURE.md, "Routing replay").
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import jax
import numpy as np

from jaxrlhf.algorithms.routing import routes_key
from jaxrlhf.data.environments import EnvHandle, EnvPool, EnvTurn
from jaxrlhf.data.rewards import ErrorCounts, RewardBatch
from jaxrlhf.data.tokenizer import Tokenizer, decode_response
from jaxrlhf.data.transcript import Transcript, TranscriptError
from jaxrlhf.dataflow.executors import HostFunctionError
from jaxrlhf.dataflow.runtime import ModelRuntime
from jaxrlhf.engine import buckets, replay
from jaxrlhf.engine.generate import Generator
from jaxrlhf.engine.rollout import NO_VERSION
from jaxrlhf.engine.rollout.scheduler import Abandoned, Later, Request, Scheduler, Turn
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
    versions: list[int] = dataclasses.field(default_factory=list)  # policy version per id
    reward: float = 0.0
    turn_rewards: dict[int, float] = dataclasses.field(default_factory=dict)  # at: reward
    turns: int = 0
    turn_ids: list[int] = dataclasses.field(default_factory=list)  # the policy's last turn
    tool_calls: int = 0  # tool messages the environment answered with
    tool_errors: int = 0  # of them, those reporting a failed call ("error: ...")
    done: bool = False
    failed: bool = False
    # The experts of every id of prompt_ids + ids [len, L, k] (a model with experts; NO_ROUTE
    # where no forward fed it yet), from the first turn on.
    routes: np.ndarray | None = None


@dataclasses.dataclass(frozen=True)
class Trajectories:
    """A step's trajectories in generate layout (host arrays).

    Attributes:
      tokens_bs: int32 [b, P + W] (W: the longest trajectory's response width bucket).
      mask_bs: bool [b, P + W], True on every real token.
      policy_bn: bool [b, W], True on the tokens the policy wrote.
      logp_bn: float32 [b, W], their behaviour log-probs (0 elsewhere).
      versions_bn: int32 [b, W], the policy version that sampled each of them (NO_VERSION
        elsewhere): a trajectory's turns may come from different versions (asynchronous RL).
      rewards_b: float32 [b], the sum of each trajectory's turn rewards (0 where it failed).
      turn_rewards_bn: float32 [b, W], each turn's reward on the last token of the policy's
        turn it answered (0 elsewhere, and where the trajectory failed); rows sum to rewards_b.
      turns_b: int32 [b], policy turns; errors: the environment's failed calls.
      tool_error_rate: the share of the `tool` messages that report a failed call (starting
        "error:", as `data/tools.call_tool` writes them); 0 when there were none.
      routes_bslk: [b, P + W, L, k] the experts each token used in each layer (module
        docstring; NO_ROUTE on padding and where no forward fed the token); None for a model
        without experts.
    """

    tokens_bs: np.ndarray
    mask_bs: np.ndarray
    policy_bn: np.ndarray
    logp_bn: np.ndarray
    versions_bn: np.ndarray
    rewards_b: np.ndarray
    turn_rewards_bn: np.ndarray
    turns_b: np.ndarray
    errors: ErrorCounts
    tool_error_rate: float
    routes_bslk: np.ndarray | None = None


def _fail(t: _Trajectory) -> None:
    t.failed, t.done, t.reward, t.turn_rewards = True, True, 0.0, {}


def _record_failures(batch: RewardBatch, live: Sequence[_Trajectory], messages: list[str]):
    messages.extend(batch.messages)
    for t, ok in zip(live, batch.valid_b):
        if not ok:
            _fail(t)


def _start(reset: EnvHandle, transcript: Transcript, rows: Sequence[dict],
           limits: TrajectoryLimits, messages: list[str]) -> list[_Trajectory]:
    """Every row's trajectory from its environment's first messages (`reset`: the rows'
    resets, one batch of the pool)."""
    firsts, batch = reset.replies()
    trajectories = []
    for row, first in zip(rows, firsts):
        # A failed reset: the row's prompt alone stands in, so the row is not empty.
        first_messages = first or ({"role": "user", "content": row["prompt"]},)
        ids = transcript.first_ids(first_messages)
        if len(ids) > limits.prompt_len:
            raise ValueError(f"env.name: first messages of {len(ids)} tokens exceed "
                             f"rollout.max_prompt_len={limits.prompt_len}")
        trajectories.append(_Trajectory(row, list(first_messages), ids))
    _record_failures(batch, trajectories, messages)
    return trajectories


@dataclasses.dataclass(frozen=True)
class Environment:
    """What multi-turn rollouts talk to: the environment's process pool, the chat transcript
    its replies are rendered with, the tokenizer and the trajectories' limits."""

    pool: EnvPool
    transcript: Transcript
    tokenizer: Tokenizer
    limits: TrajectoryLimits


class TurnRequests:
    """One rollout's trajectories as requests of the rollout engine's scheduler: each turn is
    a request whose continuation takes the turn's tokens and starts the environment's call
    (one in its pool); the reply, when it arrives, makes the next turn's request.

    Args:
      env: the environment and the limits.
      rows: one trajectory per row ({"prompt", "answer"}), started here (its environment's
        reset, in one batch).
      prompt_len: the engine's P (the first prompt's and the trajectory's ids together).
      key: the rollout's PRNG key (replicated on the engine's devices).
      tag: the requests' tags are (tag, trajectory index).
      wait: wait here for the resets; else `starting` is the scheduler's `Later` of them.
    """

    def __init__(self, env: Environment, rows: Sequence[dict], prompt_len: int, key,
                 tag=None, wait: bool = True):
        self.env, self.prompt_len, self.key, self.tag = env, prompt_len, key, tag
        self.messages: list[str] = []
        self.trajectories: list[_Trajectory] | None = None
        self.left = -1  # trajectories not ended (-1: not started)
        self._calls: list[EnvHandle] = []  # the environment's calls, for `cancel`
        self._reset = _Reset(self, rows, self._call(env.pool.reset(rows)))
        if wait:
            self._reset.result()

    def _call(self, handle: EnvHandle) -> EnvHandle:
        self._calls = [h for h in self._calls if not h.done()]
        self._calls.append(handle)
        return handle

    def cancel(self) -> None:
        """The environment's calls still on their way dropped (those running killed): the
        rollout was abandoned."""
        self.env.pool.cancel([h for h in self._calls if not h.done()])
        self._calls = []

    def first(self) -> list[Request]:
        """The first turn of every trajectory that did not end at its start."""
        return [self.request(i) for i, t in enumerate(self.trajectories) if not t.done]

    def starting(self) -> Later:
        """The resets on their way (`wait=False`): their result is `first()`."""
        return self._reset

    @property
    def done(self) -> bool:
        return self.left == 0

    def result(self) -> Trajectories:
        """The trajectories in generate layout (once `done`)."""
        return _arrays(self.trajectories, self.env.limits, self.messages)

    def request(self, i: int) -> Request:
        """Trajectory i's next turn: its conversation so far as a prompt of the engine's
        length P. Turn j samples as row i * max_turns + j of the rollout's key: its tokens
        depend on nothing else (not on which slot, or when)."""
        t, p, limits = self.trajectories[i], self.prompt_len, self.env.limits
        ids = t.prompt_ids + t.ids
        tokens_p, mask_p = np.full(p, self.env.tokenizer.pad_id, np.int32), np.zeros(p, bool)
        tokens_p[p - len(ids):], mask_p[p - len(ids):] = ids, True
        return Request(tokens_p, mask_p, self.key, i * limits.max_turns + t.turns,
                       limits.budget - len(t.ids), then=self.ended, tag=(self.tag, i))

    def ended(self, turn: Turn) -> _Reply:
        """A turn's tokens appended to its trajectory, whose conversation goes to the
        environment."""
        i, row = turn.request.tag[1], turn.row
        mask_n = row.response_mask_bn
        ids = row.sequences_bs[self.prompt_len:][mask_n].tolist()
        t = self.trajectories[i]
        if row.routes_bslk is not None:  # a model with experts: before its tokens are added
            _record_routes(t, row.routes_bslk, self.prompt_len, mask_n)
        t.ids, t.policy = t.ids + ids, t.policy + [True] * len(ids)
        t.logp = t.logp + row.logprobs_bn[mask_n].tolist()
        t.versions = t.versions + row.versions_bn[mask_n].tolist()
        t.turn_ids, t.turns = ids, t.turns + 1
        t.conversation.append({"role": "assistant",
                               "content": decode_response(self.env.tokenizer, ids)})
        return _Reply(self, i, self._call(self.env.pool.step([t.conversation], [t.row])))


def _record_routes(t: _Trajectory, routes_slk: np.ndarray, prompt_len: int,
                   mask_n: np.ndarray) -> None:
    """A turn's routes [P + N, L, k] (its prompt: the conversation so far, prompt_ids + ids,
    left-padded to `prompt_len` P) added to `t.routes` before its tokens are added to `t`:
    the prefill's for the ids that had none yet, then those of the turn's tokens (`mask_n`
    [N]: where the row has them) as their decode steps recorded them."""
    prefill_clk = routes_slk[prompt_len - len(t.prompt_ids) - len(t.ids):prompt_len]
    known_clk = prefill_clk if t.routes is None else np.where(t.routes >= 0, t.routes,
                                                              prefill_clk)
    t.routes = np.concatenate([known_clk, routes_slk[prompt_len:][mask_n]])


@dataclasses.dataclass
class _Reset:
    """A rollout's environment resets on their way (the scheduler's `Later`)."""

    turns: TurnRequests
    rows: Sequence[dict]
    handle: EnvHandle

    def done(self) -> bool:
        return self.handle.done()

    def result(self) -> list[Request]:
        """The trajectories started from their first messages; their first turns."""
        turns = self.turns
        if turns.trajectories is None:
            turns.trajectories = _start(self.handle, turns.env.transcript, self.rows,
                                        turns.env.limits, turns.messages)
            turns.left = sum(not t.done for t in turns.trajectories)
        return turns.first()


@dataclasses.dataclass
class _Reply:
    """An environment's reply on its way (the scheduler's `Later`)."""

    turns: TurnRequests
    i: int
    handle: EnvHandle

    def done(self) -> bool:
        return self.handle.done()

    def result(self) -> Request | None:
        """The reply appended to its trajectory; its next turn's request unless it ended."""
        turns, t = self.turns, self.turns.trajectories[self.i]
        env = turns.env
        (reply,), batch = self.handle.replies()
        _record_failures(batch, [t], turns.messages)
        if reply is not None:
            try:
                _take_reply(t, reply, env.transcript, env.tokenizer, env.limits)
            except TranscriptError as e:  # the template, not one trajectory: stop the run
                raise EnvironmentFailed(f"env.name: {e}") from None
            if not t.done:
                return turns.request(self.i)
        turns.left -= 1
        return None


def rollout(generator: Generator, params, rng, pool: EnvPool, transcript: Transcript,
            tokenizer: Tokenizer, rows: Sequence[dict], limits: TrajectoryLimits,
            slots: int | None = None, stop: Callable[[], bool] | None = None) -> Trajectories:
    """The trajectories of `rows` (each {"prompt", "answer"}), one per row, streamed through
    the generator's rollout engine by its scheduler (module docstring).

    Args:
      slots: rows decoded at once (a multiple of the data-parallel size); default: one per
        trajectory (rounded up).
      stop: asked between the scheduler's rounds and while it waits for the environment:
        True abandons the rollout (a stop signal), its environment calls cancelled.

    Raises:
      Abandoned: `stop()` said so before the trajectories ended.
      EnvironmentFailed: the environment failed on more than `max_error_rate` of them, or its
        replies cannot be appended (the chat template rewrites the conversation).
      ValueError: a first prompt longer than P ids; a pipelined layout.
    """
    if not generator.on_engine:
        raise ValueError(f"multi-turn rollouts stream turns through the rollout engine, which a "
                         f"pipelined layout ({generator.layout}) does not run: give actor_gen a "
                         "layout without pipeline stages")
    env = Environment(pool, transcript, tokenizer, limits)
    turns = TurnRequests(env, rows, limits.prompt_len + limits.budget,
                         transfer(rng, generator.layout.replicated()), wait=False)
    dp = generator.layout.dp_size
    slots = -(-max(len(rows), 1) // dp) * dp if slots is None else slots
    scheduler = Scheduler(generator.rollout_engine(limits.prompt_len + limits.budget, slots),
                          slots, TURN_CHUNK_TOKENS)
    scheduler.expect(turns.starting())  # the resets, awaited as the replies are
    try:
        scheduler.run(params, stop=stop)
    except Abandoned:
        turns.cancel()
        raise
    return turns.result()


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
    t.versions += [NO_VERSION] * len(ids)
    if t.routes is not None:  # the next turn's prefill records them
        t.routes = np.concatenate([t.routes, np.full((len(ids), *t.routes.shape[1:]),
                                                     replay.NO_ROUTE, t.routes.dtype)])
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
    versions_bn = np.full((b, w), NO_VERSION, np.int32)
    turn_rewards_bn = np.zeros((b, w), np.float32)
    recorded = [t.routes for t in trajectories if t.routes is not None]
    routes_bslk = None if not recorded else np.full(
        (b, p + w, *recorded[0].shape[1:]), replay.NO_ROUTE, recorded[0].dtype)
    for i, t in enumerate(trajectories):
        n = len(t.ids)
        tokens_bs[i, p - len(t.prompt_ids):p + n] = t.prompt_ids + t.ids
        mask_bs[i, p - len(t.prompt_ids):p + n] = True
        if t.routes is not None:  # a trajectory that had a turn
            routes_bslk[i, p - len(t.prompt_ids):p + n] = t.routes
        policy_bn[i, :n], logp_bn[i, :n], versions_bn[i, :n] = t.policy, t.logp, t.versions
        for at, reward in t.turn_rewards.items():
            turn_rewards_bn[i, at] = reward
    calls = sum(t.tool_calls for t in trajectories)
    return Trajectories(tokens_bs, mask_bs, policy_bn, logp_bn, versions_bn,
                        np.array([t.reward for t in trajectories], np.float32),
                        turn_rewards_bn, np.array([t.turns for t in trajectories], np.int32),
                        ErrorCounts(exception=failed),
                        sum(t.tool_errors for t in trajectories) / max(calls, 1), routes_bslk)


def trajectory_executor(mfc: MFC, model: ModelRuntime, layout: Layout, generator: Generator,
                        rng_of_step: Callable[[], jax.Array], pool: EnvPool,
                        tokenizer: Tokenizer, limits: TrajectoryLimits,
                        on_result: Callable[[Trajectories], None],
                        stop: Callable[[], bool] = lambda: False):
    """The generate MFC of a multi-turn run: reads the prompt rows (`prompt_text`, `answer`)
    and writes those of its outputs its MFC names: sequence tokens `seq_tokens_bs`, sequence
    mask `seq_mask_bs`, policy-token mask `response_mask_bn`, behaviour log-probs
    `behav_logp_bn`, trajectory rewards `scores_b`, turn rewards `turn_rewards_bn`, and under
    routing replay the tokens' experts `seq_routes_bslk` (`trajectory_arrays`). `stop`:
    `rollout`'s (it raises `Abandoned`)."""
    transcript = Transcript(tokenizer)

    def run(buf):
        rows = [{"prompt": p, "answer": a} for p, a in zip(buf["prompt_text"], buf["answer"])]
        out = rollout(generator, model.params_on(layout), rng_of_step(), pool, transcript,
                      tokenizer, rows, limits, stop=stop)
        on_result(out)
        arrays = trajectory_arrays(out)
        host = tuple(arrays[name] for name in mfc.outputs)
        placed = transfer(host, tuple(layout.batch_sharding(x.ndim) for x in host))
        return dict(zip(mfc.outputs, placed, strict=True))

    return run


def trajectory_arrays(out: Trajectories) -> dict[str, np.ndarray]:
    """The generate MFC's keys of `out` (those a multi-turn graph's generate call may name):
    the recorded experts under the key `algorithms.routing` gives the sequences' where the
    model has them."""
    arrays = {"seq_tokens_bs": out.tokens_bs, "seq_mask_bs": out.mask_bs,
              "response_mask_bn": out.policy_bn, "behav_logp_bn": out.logp_bn,
              "scores_b": out.rewards_b, "turn_rewards_bn": out.turn_rewards_bn}
    if out.routes_bslk is not None:
        arrays[routes_key("seq_tokens_bs")] = out.routes_bslk
    return arrays
