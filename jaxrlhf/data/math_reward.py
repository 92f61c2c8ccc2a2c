"""A verifiable `math` reward: 1.0 when the completion's final answer equals the reference.

The final answer is taken, in order of preference, from the last `\\boxed{...}` (braces balanced),
the last `#### N` line (GSM8K), what `math-verify` itself extracts from the text (a LaTeX
environment such as `$\\frac{\\pi}{2}$`, or the last expression), or the last number. Whether it equals the reference
is decided by Hugging Face's `math-verify`, the verifier TRL and open-r1 train with: both sides
are parsed from LaTeX into sympy and compared symbolically and numerically, so `2\\sqrt{2}`
equals `\\sqrt{8}`, `\\frac{\\pi}{2}` equals `\\pi/2`, `x = 4` equals `4`, `1{,}250` and `1,250`
equal `1250`, `10^{3}` equals `1000`, `\\$18` equals `18`, and `3, 1, 2` equals `\\{1,2,3\\}`.

An answer found here (a box's content, a `####` line, a number) is handed to `math-verify` inside
`\\boxed{}`, which tells its parser to read all of it as one expression.

The function runs in `RewardPool` workers (data/rewards.py), whose per-call timeout kills a
worker that hangs. `math-verify` bounds its own sympy work with `signal.alarm`, which only works
on a process's main thread, where the pool calls it; there a slow answer scores 0 without the
cost of replacing the worker. Elsewhere its alarms are off and the pool's timeout is the bound.
"""

from __future__ import annotations

import re
import threading

import math_verify

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")
_GSM = re.compile(r"####\s*([^\n]+)")
# Seconds math-verify may spend parsing one side, and comparing them; below the pool's default
# per-call timeout (10 s) with room for both parses and the comparison.
_VERIFY_TIMEOUT_S = 2


def last_boxed(text: str) -> str | None:
    """Content of the last `\\boxed{...}` (nested braces balanced), or None."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    i, depth = start + len("\\boxed{"), 1
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i:j]
    return None  # unbalanced: the completion was cut off inside the box


def _marked_answer(text: str) -> str | None:
    """The answer a completion marks: its last \\boxed{}, else its last `#### N` line, or None.

    A sentence's closing period goes (`#### 18.`): math-verify would not read `18.` as a number.
    """
    boxed = last_boxed(text)
    if boxed is not None:
        return boxed.strip().rstrip(".")
    gsm = _GSM.findall(text)
    return gsm[-1].strip().rstrip(".") if gsm else None


def final_answer(text: str) -> str | None:
    """The completion's final answer as text: last \\boxed{}, else last `#### N`, else last number."""
    marked = _marked_answer(text)
    if marked is not None:
        return marked
    numbers = _NUMBER.findall(text)
    return numbers[-1] if numbers else None


def _timeout_s() -> int | None:
    """math-verify's own time limit where its `signal.alarm` works (the main thread), else None."""
    return _VERIFY_TIMEOUT_S if threading.current_thread() is threading.main_thread() else None


def _parse(answer: str) -> list:
    """math-verify's parse of one extracted answer: [sympy value, its string], or [] if none."""
    return math_verify.parse(f"\\boxed{{{answer}}}", parsing_timeout=_timeout_s())


def parsed_answer(text: str) -> list:
    """The final answer of `text` as math-verify's parse: [sympy value, its string], or [].

    The marked answer (box, `####`) first; else what math-verify extracts from the whole text;
    else the last number, for text where it finds nothing (`It costs \\$18.`, a cut-off box).
    """
    marked = _marked_answer(text)
    if marked is not None:
        return _parse(marked)
    found = math_verify.parse(text, parsing_timeout=_timeout_s())
    if found:
        return found
    numbers = _NUMBER.findall(text)
    return _parse(numbers[-1]) if numbers else []


def answers_equal(predicted: str, reference: str) -> bool:
    """Whether two extracted answers are mathematically equal, as math-verify judges."""
    return _verify(_parse(reference), _parse(predicted))


def _verify(reference: list, predicted: list) -> bool:
    return bool(reference and predicted) and math_verify.verify(
        reference, predicted, timeout_seconds=_timeout_s())


def math_reward(prompt: str, completion: str, answer: str | None) -> float:
    """1.0 if the final answer of `completion` equals `answer`, else 0.0.

    A reference with `#### N` or `\\boxed{}` (a full solution) is reduced to its marked answer;
    any other reference is the answer itself.

    Raises:
      ValueError: the prompt row carries no reference answer.
    """
    del prompt
    if answer is None:
        raise ValueError("the math reward needs a reference answer; the prompt row has none")
    marked = _marked_answer(answer)
    reference = _parse(answer if marked is None else marked)
    return 1.0 if _verify(reference, parsed_answer(completion)) else 0.0
