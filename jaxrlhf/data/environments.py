"""Environments of multi-turn rollouts, and the process pool that runs them beside training.

An environment is a class a user writes and names in a config (`env.name`: a built-in name,
`my_pkg.envs:MyEnv` or `/path/envs.py:MyEnv`), made once per worker process with no
arguments:

    class MyEnv:
        def reset(self, row: dict) -> list[dict]:
            '''The first messages of the trajectory of prompt row `row` ({"prompt", "answer"}).'''
        def step(self, messages: list[dict], row: dict) -> EnvTurn | tuple:
            '''After a policy turn (the last of `messages`): the reply messages (None: none),
            the reward of this turn, and whether the episode is done.'''

Calls carry the whole conversation, so an instance keeps no state between them: any worker may
answer any trajectory's turn. A trajectory's reward is the sum of its turns' rewards.

Environments are user code, so they run where reward functions run: in `RewardPool`'s worker
processes (its machinery, a different function and value check), where a call that raises,
hangs past the timeout or returns something malformed is a counted error; the trajectory it
belongs to ends with reward 0 (`dataflow/trajectories.py`).

Built-in environments: `ToolEnv` answers the policy's tool calls (`data/tools.py`) with
`tool` messages and scores the final answer against the row's by exact match, with reward only
when the calculator was called first (`configs/tool_math_tiny.py`); `LookupEnv` answers
questions for chained facts only it knows, one a turn (`configs/multiturn_tiny.py`).
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
from typing import Any, Callable, Sequence

from jaxrlhf.data import rewards, tasks, tools
from jaxrlhf.data.rewards import ErrorKind, RewardHandle, RewardPool

Message = dict[str, Any]


@dataclasses.dataclass(frozen=True)
class EnvTurn:
    """What `step` returns (a 3-tuple in this order is accepted too).

    Attributes:
      messages: the environment's reply (appended to the conversation), or None.
      reward: this turn's reward.
      done: the episode ended (the policy does not write another turn).
    """

    messages: tuple[Message, ...] | None
    reward: float
    done: bool


class ToolEnv:
    """The policy may call the built-in tools (Qwen3's `<tool_call>` format); its first turn
    without a call is its answer, worth 1 when it equals the row's answer (as `exact_match`)
    after at least one calculator call, else 0. A malformed call is answered by an error
    message the policy can read."""

    tool_format = tools.ToolCallFormat.QWEN3

    def reset(self, row: dict) -> list[Message]:
        return [{"role": "user", "content": row["prompt"]}]

    def step(self, messages: list[Message], row: dict) -> EnvTurn:
        text = messages[-1]["content"]
        try:
            calls = tools.parse_tool_calls(text, self.tool_format)
        except tools.ToolCallError as e:
            return EnvTurn(({"role": "tool", "content": f"error: {e}"},), 0.0, False)
        if calls:
            return EnvTurn(tuple({"role": "tool", "content": tools.call_tool(c)} for c in calls),
                           0.0, False)
        used = any(c.name == "calculator" for m in messages[:-1] if m["role"] == "assistant"
                   for c in _calls_or_none(m["content"], self.tool_format))
        correct = rewards.extract_answer(text) == (row["answer"] or "").strip()
        return EnvTurn(None, float(used and correct), True)


def _calls_or_none(text: str, fmt: tools.ToolCallFormat) -> list[tools.ToolCall]:
    try:
        return tools.parse_tool_calls(text, fmt)
    except tools.ToolCallError:
        return []


class Llama3ToolEnv(ToolEnv):
    """`ToolEnv` for models that call tools as Llama-3.1 does (the turn is one JSON object)."""

    tool_format = tools.ToolCallFormat.LLAMA3


class LookupEnv:
    """The chained facts of `data/tasks.LookupTask`: a prompt names a key ("q="), the row's
    answer is the value at the chain's end. A turn "k?" asks for key k: the prompt's key is
    answered with the chain's second key, that one with the value (tool messages; any other
    key with an error message); the first turn that asks nothing is the answer, worth 1 when
    it is the row's, else 0."""

    def reset(self, row: dict) -> list[Message]:
        return [{"role": "user", "content": row["prompt"]}]

    def step(self, messages: list[Message], row: dict) -> EnvTurn:
        text, first, value = messages[-1]["content"].strip(), row["prompt"][0], row["answer"]
        if not text.endswith("?"):
            return EnvTurn(None, float(text == value), True)
        link = tasks.lookup_link(first, value)
        facts = {first: link, link: value}
        key = text[:-1]
        content = facts[key] if key in facts else f"error: no key {key!r}"
        return EnvTurn(({"role": "tool", "content": content},), 0.0, False)


BUILTIN_ENVS = {"tools": ToolEnv, "tools_llama3": Llama3ToolEnv, "lookup": LookupEnv}


def resolve_env_class(spec: str) -> type:
    """The environment class named by `spec` (built-in name, `module:Class`, `file.py:Class`).

    Raises:
      ValueError: naming `spec`: unknown, not importable, or without `reset` and `step`.
    """
    target, sep, name = spec.rpartition(":")
    if not sep:
        if spec not in BUILTIN_ENVS:
            raise ValueError(f"unknown environment {spec!r}: use one of {sorted(BUILTIN_ENVS)}, "
                             "'module.path:Class' or '/path/file.py:Class'")
        return BUILTIN_ENVS[spec]
    module = (rewards._import(spec, target) if target.endswith(".py")
              else importlib.import_module(target))
    cls = getattr(module, name, None)
    if not inspect.isclass(cls):
        raise ValueError(f"environment {spec!r}: {target} has no class {name!r}")
    missing = [m for m in ("reset", "step") if not callable(getattr(cls, m, None))]
    if missing:
        raise ValueError(f"environment {spec!r}: {name} has no method {' or '.join(missing)}")
    return cls


def env_caller(spec: str) -> Callable:
    """`call(method, row, messages)`: `reset(row)` or `step(messages, row)` of one instance of
    the environment `spec` (the pool's worker function)."""
    env = resolve_env_class(spec)()

    def call(method: str, row: dict, messages: list[Message]):
        if method == "reset":
            return "reset", env.reset(row)
        return "step", env.step(messages, row)

    return call


def _messages(value, what: str) -> tuple[Message, ...]:
    if not isinstance(value, (list, tuple)) or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str)
            and isinstance(m.get("content"), str) for m in value):
        raise TypeError(f"{what} must be a list of {{'role': str, 'content': str}} dicts, got "
                        f"{str(value)[:80]}")
    return tuple(dict(m) for m in value)


def check_env_value(value) -> tuple[ErrorKind | None, object]:
    """(None, messages) of a reset, (None, EnvTurn) of a step, else (BAD_VALUE, why)."""
    method, out = value
    try:
        if method == "reset":
            return None, _messages(out, "reset's return")
        if isinstance(out, tuple) and len(out) == 3:
            out = EnvTurn(*out)
        if not isinstance(out, EnvTurn):
            raise TypeError(f"step must return an EnvTurn or (messages, reward, done), "
                            f"got {type(out).__name__}")
        kind, reward = rewards._check_value(out.reward)
        if kind is not None:
            raise TypeError(f"step's reward {reward}")
        msgs = None if out.messages is None else _messages(out.messages, "step's messages")
        return None, EnvTurn(msgs, float(reward), bool(out.done))
    except TypeError as e:
        return ErrorKind.BAD_VALUE, str(e)


class EnvHandle(RewardHandle):
    """The future replies of one `EnvPool` batch: `replies()` gives each call's value, or None
    where it failed (counted in `result().errors`)."""

    def __init__(self, size: int):
        self._values: list[object] = [None] * size
        super().__init__(size)

    def _record(self, index: int, kind: ErrorKind | None, payload) -> None:
        if kind is None:
            self._values[index] = payload
            payload = 0.0  # the parent's float array only tracks that the call succeeded
        super()._record(index, kind, payload)

    def replies(self, timeout: float | None = None) -> tuple[list[object], rewards.RewardBatch]:
        """(each call's checked value or None, the batch's error counts and messages)."""
        batch = self.result(timeout)
        return [v if ok else None for v, ok in zip(self._values, batch.valid_b)], batch


class EnvPool:
    """An environment's `reset` and `step` run in worker processes with a per-call timeout."""

    def __init__(self, spec: str, *, num_workers: int, timeout_s: float):
        self.spec = spec
        self._pool = RewardPool(spec, num_workers=num_workers, timeout_s=timeout_s,
                                resolve=env_caller, check=check_env_value, what="environment")

    def __enter__(self) -> "EnvPool":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def close(self) -> None:
        self._pool.close()

    def cancel(self, handles: Sequence[EnvHandle]) -> None:
        """The calls of `handles` not answered yet dropped, those running killed
        (`RewardPool.cancel`)."""
        self._pool.cancel(handles)

    def reset(self, rows: Sequence[dict]) -> EnvHandle:
        return self._pool.submit_calls([("reset", r, None) for r in rows], EnvHandle(len(rows)))

    def step(self, conversations: Sequence[list[Message]], rows: Sequence[dict]) -> EnvHandle:
        return self._pool.submit_calls([("step", r, list(c)) for c, r in zip(conversations, rows)],
                                       EnvHandle(len(rows)))
