"""A built-in verifiable task for the tiny CPU default: multi-digit arithmetic ("12+345=" -> "357").

Everything is a pure function of `ArithmeticTask` (including its seed): the train prompts, the
disjoint held-out eval prompts, SFT demonstrations for a warm start (a chosen fraction of them
with a wrong answer, so that an SFT-warm-started model is only moderately accurate and RL has
room to improve) and preference pairs (correct vs corrupted answer) for reward modelling / DPO.
`write_task` stores them as JSONL so that training reads them through the same code path as a
user's dataset. The reward is `rewards.exact_match` on the answer digits.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import pathlib

import numpy as np

from jaxrlhf.data import tools
from jaxrlhf.data.datasets import PreferenceRow, PromptRow, SFTRow, write_rows


class Op(enum.Enum):
    ADD = "+"
    SUB = "-"
    MUL = "*"


@dataclasses.dataclass(frozen=True)
class ArithmeticTask:
    """Knobs of the generated task.

    Attributes:
      num_digits: operands are drawn uniformly from [0, 10**num_digits).
      num_operands: operands per problem (>= 2); operators are drawn from `ops`.
      ops: operators to draw from; evaluation follows the usual precedence (* before + and -).
      num_train: distinct train prompts.
      num_eval: distinct held-out prompts, disjoint from the train prompts.
      num_sft: SFT demonstrations, taken from the train prompts.
      sft_noise: fraction of SFT demonstrations whose answer has one digit changed.
      seed: everything above is a pure function of it.
    """

    num_digits: int = 2
    num_operands: int = 2
    ops: tuple[Op, ...] = (Op.ADD,)
    num_train: int = 2000
    num_eval: int = 200
    num_sft: int = 1000
    sft_noise: float = 0.3
    seed: int = 0

    def __post_init__(self):
        if self.num_digits < 1 or self.num_operands < 2 or not self.ops:
            raise ValueError(f"need num_digits >= 1, num_operands >= 2 and some ops: {self}")
        if not 0 <= self.num_sft <= self.num_train:
            raise ValueError(f"num_sft={self.num_sft} must be in [0, num_train={self.num_train}]")
        if not 0.0 <= self.sft_noise <= 1.0:
            raise ValueError(f"sft_noise={self.sft_noise} must be in [0, 1]")
        wanted = self.num_train + self.num_eval
        # Rejection sampling of distinct problems stays fast while at most half are taken.
        if 2 * wanted > self.num_distinct_problems:
            raise ValueError(
                f"{wanted} distinct problems requested, more than half of the "
                f"{self.num_distinct_problems} that exist; raise num_digits or num_operands"
            )

    @property
    def num_distinct_problems(self) -> int:
        k = self.num_operands
        return (10**self.num_digits) ** k * len(self.ops) ** (k - 1)


@dataclasses.dataclass(frozen=True)
class TaskData:
    train: list[PromptRow]
    eval: list[PromptRow]
    sft: list[SFTRow]
    preference: list[PreferenceRow]


@dataclasses.dataclass(frozen=True)
class TaskFiles:
    train: pathlib.Path
    eval: pathlib.Path
    sft: pathlib.Path
    preference: pathlib.Path


def evaluate(operands: list[int], ops: list[Op]) -> int:
    """Value of operands[0] ops[0] operands[1] ..., with * binding tighter than + and -."""
    total, sign, term = 0, 1, operands[0]
    for op, operand in zip(ops, operands[1:]):
        match op:
            case Op.MUL:
                term *= operand
            case Op.ADD | Op.SUB:
                total += sign * term
                sign, term = (1 if op is Op.ADD else -1), operand
    return total + sign * term


def _draw_problem(task: ArithmeticTask, rng: np.random.Generator) -> PromptRow:
    operands = [int(x) for x in rng.integers(0, 10**task.num_digits, size=task.num_operands)]
    ops = [task.ops[i] for i in rng.integers(0, len(task.ops), size=task.num_operands - 1)]
    text = str(operands[0]) + "".join(op.value + str(x) for op, x in zip(ops, operands[1:]))
    return PromptRow(prompt=text + "=", answer=str(evaluate(operands, ops)))


def corrupt_answer(answer: str, rng: np.random.Generator) -> str:
    """`answer` with one digit replaced by a different digit (never equal to `answer`)."""
    digit_positions = [i for i, c in enumerate(answer) if c.isdigit()]
    pos = digit_positions[int(rng.integers(len(digit_positions)))]
    old = int(answer[pos])
    new = (old + int(rng.integers(1, 10))) % 10
    # A leading zero would read as a formatting error rather than a wrong value.
    if new == 0 and pos == digit_positions[0] and len(digit_positions) > 1:
        new = 1 if old != 1 else 2
    return answer[:pos] + str(new) + answer[pos + 1 :]


def make_task(task: ArithmeticTask) -> TaskData:
    """Generates the task's rows; identical for equal `task` values."""
    rng = np.random.default_rng(task.seed)
    seen: dict[str, PromptRow] = {}
    while len(seen) < task.num_train + task.num_eval:
        row = _draw_problem(task, rng)
        seen.setdefault(row.prompt, row)
    problems = list(seen.values())
    train, held_out = problems[: task.num_train], problems[task.num_train :]

    noise_rng = np.random.default_rng([task.seed, 1])
    num_noisy = round(task.sft_noise * task.num_sft)
    noisy = set(noise_rng.permutation(task.num_sft)[:num_noisy].tolist())
    sft = [
        SFTRow(
            prompt=row.prompt,
            response=corrupt_answer(row.answer, noise_rng) if i in noisy else row.answer,
        )
        for i, row in enumerate(train[: task.num_sft])
    ]
    preference = [
        PreferenceRow(
            prompt=row.prompt, chosen=row.answer, rejected=corrupt_answer(row.answer, noise_rng)
        )
        for row in train
    ]
    return TaskData(train=train, eval=held_out, sft=sft, preference=preference)


@dataclasses.dataclass(frozen=True)
class ReverseTask:
    """Digit reversal ("4821>" -> "1284"), learnable by rule, so held-out prompts generalise.

    Its noisy demonstrations carry a systematic failure mode instead of random typos: a
    fraction `sft_noise` of them copy the digits instead of reversing them. A model imitating
    them prefers copying whenever that fraction is above one half, so its greedy answers are
    mostly wrong although the right answer is often sampled: the situation RL from an
    exact-match reward is for.

    Attributes:
      num_digits: digits per prompt (distinct reversed/copied answers need >= 2).
      num_train, num_eval, num_sft, sft_noise, seed: as in ArithmeticTask.
    """

    num_digits: int = 4
    num_train: int = 2000
    num_eval: int = 200
    num_sft: int = 1000
    sft_noise: float = 0.6
    seed: int = 0

    def __post_init__(self):
        if self.num_digits < 2:
            raise ValueError(f"num_digits={self.num_digits} must be >= 2")
        if not 0 <= self.num_sft <= self.num_train:
            raise ValueError(f"num_sft={self.num_sft} must be in [0, num_train={self.num_train}]")
        if 2 * (self.num_train + self.num_eval) > 10**self.num_digits:
            raise ValueError(f"{self.num_train + self.num_eval} distinct prompts requested, more "
                             f"than half of the {10**self.num_digits} that exist")


def make_reverse_task(task: ReverseTask) -> TaskData:
    """Generates the reversal task's rows; identical for equal `task` values."""
    rng = np.random.default_rng(task.seed)
    seen: dict[str, PromptRow] = {}
    while len(seen) < task.num_train + task.num_eval:
        digits = "".join(str(d) for d in rng.integers(0, 10, size=task.num_digits))
        if digits != digits[::-1]:  # palindromes cannot tell reversal from copying
            seen.setdefault(digits, PromptRow(prompt=digits + ">", answer=digits[::-1]))
    problems = list(seen.values())
    train, held_out = problems[: task.num_train], problems[task.num_train :]
    noise_rng = np.random.default_rng([task.seed, 1])
    noisy = set(noise_rng.permutation(task.num_sft)[: round(task.sft_noise * task.num_sft)].tolist())
    sft = [SFTRow(prompt=row.prompt, response=row.prompt[:-1] if i in noisy else row.answer)
           for i, row in enumerate(train[: task.num_sft])]
    preference = [PreferenceRow(prompt=row.prompt, chosen=row.answer, rejected=row.prompt[:-1])
                  for row in train]
    return TaskData(train=train, eval=held_out, sft=sft, preference=preference)


@dataclasses.dataclass(frozen=True)
class ToolArithmeticTask:
    """Addition with a calculator tool (the built-in `tools` environment of
    `data/environments.py`, which scores an answer only after a calculator call).

    The prompts are `ArithmeticTask`'s ("12+34="). A demonstration is a trajectory: the policy
    calls the calculator on the prompt's expression, the environment replies with its value,
    the policy answers that value. A fraction `sft_noise` of them carry a systematic slip
    instead of random typos (as `ReverseTask`'s): they subtract ("12-34"), and answer what the
    calculator says. A model imitating them writes `-` whenever that fraction is above one half,
    so its greedy trajectories mostly score 0 although `+` is often sampled; every demonstration
    teaches the rest (copying the operands into the call, the tool's value into the answer).

    Attributes:
      num_digits, num_train, num_eval, num_sft, sft_noise, seed: as in ArithmeticTask.
    """

    num_digits: int = 2
    num_train: int = 2000
    num_eval: int = 200
    num_sft: int = 1000
    sft_noise: float = 0.6
    seed: int = 0

    def __post_init__(self):  # the checks of the arithmetic task it draws from
        self.arithmetic()

    def arithmetic(self) -> ArithmeticTask:
        return ArithmeticTask(num_digits=self.num_digits, num_train=self.num_train,
                              num_eval=self.num_eval, num_sft=self.num_sft,
                              sft_noise=self.sft_noise, seed=self.seed)


def calculator_call(expression: str) -> str:
    """A policy turn calling the calculator on `expression` (Qwen3's tool-call format)."""
    call = {"name": "calculator", "arguments": {"expression": expression}}
    return f"<tool_call>{json.dumps(call, separators=(',', ':'))}</tool_call>"


def make_tool_task(task: ToolArithmeticTask) -> TaskData:
    """Generates the tool task's rows; identical for equal `task` values."""
    data = make_task(task.arithmetic())
    noise_rng = np.random.default_rng([task.seed, 2])
    noisy = set(noise_rng.permutation(task.num_sft)[: round(task.sft_noise * task.num_sft)].tolist())

    def turns(i: int, row: PromptRow) -> tuple[dict, ...]:
        expression = row.prompt.rstrip("=")
        if i in noisy:  # the slip: subtracting instead of adding
            expression = expression.replace("+", "-")
        value = tools.calculate(expression)  # what the environment's calculator replies
        return ({"role": "assistant", "content": calculator_call(expression)},
                {"role": "tool", "content": value},
                {"role": "assistant", "content": value})

    sft = [SFTRow(prompt=row.prompt, response="", messages=turns(i, row))
           for i, row in enumerate(data.train[: task.num_sft])]
    return dataclasses.replace(data, sft=sft)


@dataclasses.dataclass(frozen=True)
class LookupTask:
    """Facts the policy must ask its environment for, turn by turn (the built-in `lookup`
    environment of `data/environments.py`): a chain of two lookups.

    A prompt names a key ("q="); the row's answer is a two-digit value ("58") drawn afresh for
    every row. Asked for the prompt's key ("q?"), the environment names a second key
    (`lookup_link`: a function of the prompt's key and the value, so only it knows which);
    asked for that one, it replies with the value; the policy's first turn that asks nothing is
    its answer (reward 1 when it is the row's value). A demonstration asks twice and answers; a
    fraction `sft_noise` of them carry a systematic slip (as `ReverseTask`'s and
    `ToolArithmeticTask`'s): they take the first reply for the answer, stopping after one
    question. Both start their second turn by copying the reply's key, then one asks ("n?")
    and the other stops ("n"): a model imitating them stops whenever that fraction is above
    one half, so its greedy trajectories score 0; the clean ones teach the rest (asking for the
    key a reply names, reading the value).

    Attributes:
      num_train, num_eval: distinct train and held-out rows; num_sft: demonstrations (of the
        train rows); sft_noise: the share of them that slip; seed: all of it is a function
        of it.
    """

    num_train: int = 2000
    num_eval: int = 200
    num_sft: int = 1000
    sft_noise: float = 0.6
    seed: int = 0

    def __post_init__(self):
        if not 0 <= self.num_sft <= self.num_train:
            raise ValueError(f"num_sft={self.num_sft} must be in [0, num_train={self.num_train}]")
        if not 0.0 <= self.sft_noise <= 1.0:
            raise ValueError(f"sft_noise={self.sft_noise} must be in [0, 1]")
        if self.num_train + self.num_eval > len(LOOKUP_KEYS) * 100:
            raise ValueError(f"num_train + num_eval must be at most {len(LOOKUP_KEYS) * 100} "
                             "(keys x values)")


LOOKUP_KEYS = "abcdefghijklmnopqrstuvwxyz"


def lookup_link(key: str, value: str) -> str:
    """The second key of the chain from `key` to the two-digit `value` (never `key` itself)."""
    at = LOOKUP_KEYS.index(key)
    return LOOKUP_KEYS[(at + 1 + 7 * int(value) % (len(LOOKUP_KEYS) - 1)) % len(LOOKUP_KEYS)]


def make_lookup_task(task: LookupTask) -> TaskData:
    """Generates the lookup task's rows; identical for equal `task` values."""
    rng = np.random.default_rng(task.seed)
    seen: dict[tuple[str, str], PromptRow] = {}
    while len(seen) < task.num_train + task.num_eval:
        key, value = LOOKUP_KEYS[rng.integers(len(LOOKUP_KEYS))], f"{rng.integers(100):02d}"
        seen.setdefault((key, value), PromptRow(prompt=key + "=", answer=value))
    rows = list(seen.values())
    train, held_out = rows[: task.num_train], rows[task.num_train:]
    noise_rng = np.random.default_rng([task.seed, 3])
    noisy = set(noise_rng.permutation(task.num_sft)[: round(task.sft_noise * task.num_sft)].tolist())

    def turns(i: int, row: PromptRow) -> tuple[dict, ...]:
        key, value = row.prompt[0], row.answer
        link = lookup_link(key, value)
        asked = ({"role": "assistant", "content": f"{key}?"}, {"role": "tool", "content": link})
        if i in noisy:  # the slip: the first reply taken for the answer
            return (*asked, {"role": "assistant", "content": link})
        return (*asked, {"role": "assistant", "content": f"{link}?"},
                {"role": "tool", "content": value}, {"role": "assistant", "content": value})

    sft = [SFTRow(prompt=row.prompt, response="", messages=turns(i, row))
           for i, row in enumerate(train[: task.num_sft])]
    return TaskData(train=train, eval=held_out, sft=sft, preference=[])


def write_task(task: ArithmeticTask | ReverseTask | ToolArithmeticTask | LookupTask,
               out_dir: str | pathlib.Path) -> TaskFiles:
    """Writes train/eval prompts, SFT demonstrations and preference pairs as JSONL in `out_dir`."""
    out_dir = pathlib.Path(out_dir)
    match task:
        case ReverseTask():
            data = make_reverse_task(task)
        case ToolArithmeticTask():
            data = make_tool_task(task)
        case LookupTask():
            data = make_lookup_task(task)
        case _:
            data = make_task(task)
    return TaskFiles(
        train=write_rows(out_dir / "train.jsonl", data.train),
        eval=write_rows(out_dir / "eval.jsonl", data.eval),
        sft=write_rows(out_dir / "sft.jsonl", data.sft),
        preference=write_rows(out_dir / "preference.jsonl", data.preference),
    )
