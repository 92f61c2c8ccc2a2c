"""A verifiable `math` reward: 1.0 when the completion's final answer equals the reference.

The final answer is taken, in order of preference, from the last `\\boxed{...}` (braces balanced),
the last `#### N` line (GSM8K), or the last number in the text. Both sides are normalised:
`$`, `\\left`/`\\right`, `\\!`, spaces, thousands commas, a trailing period and `\\text{...}`
units go; `\\frac{a}{b}`, `\\dfrac`, `a/b` and decimals compare as exact fractions, so "0.5",
"1/2" and "\\frac{1}{2}" all equal. Non-numeric answers compare as normalised strings.
"""

from __future__ import annotations

import fractions
import re

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")
_FRAC = re.compile(r"\\[dt]?frac\{([^{}]*)\}\{([^{}]*)\}")
_TEXT = re.compile(r"\\(?:text|mathrm|textbf)\{([^{}]*)\}")
_GSM = re.compile(r"####\s*([^\n]+)")


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


def final_answer(text: str) -> str | None:
    """The completion's final answer: last \\boxed{}, else last `#### N`, else last number."""
    boxed = last_boxed(text)
    if boxed is not None:
        return boxed
    gsm = _GSM.findall(text)
    if gsm:
        return gsm[-1].strip()
    numbers = _NUMBER.findall(text)
    return numbers[-1] if numbers else None


def normalize(answer: str) -> str:
    """Simple LaTeX and formatting removed; fractions written as a/b."""
    s = answer.strip()
    s = _TEXT.sub(r"\1", s)
    for junk in ("$", "\\left", "\\right", "\\!", "\\,", "\\;", "\\ ", "^\\circ", "^{\\circ}", "%"):
        s = s.replace(junk, "")
    s = _FRAC.sub(r"(\1)/(\2)", s)
    s = re.sub(r"(?<=\d),(?=\d{3}\b)", "", s)  # 1,000 -> 1000
    s = re.sub(r"\s+", "", s).rstrip(".")
    return s


def as_fraction(answer: str) -> fractions.Fraction | None:
    """Exact value of a normalised numeric answer (int, decimal, a/b), or None."""
    s = answer.replace("(", "").replace(")", "")
    try:
        if s.count("/") == 1:
            num, den = s.split("/")
            return fractions.Fraction(num) / fractions.Fraction(den)
        return fractions.Fraction(s)
    except (ValueError, ZeroDivisionError):
        return None


def answers_equal(predicted: str, reference: str) -> bool:
    """Numeric equality when both parse as numbers, else normalised string equality."""
    p, r = normalize(predicted), normalize(reference)
    pf, rf = as_fraction(p), as_fraction(r)
    if pf is not None and rf is not None:
        return pf == rf
    return p == r


def math_reward(prompt: str, completion: str, answer: str | None) -> float:
    """1.0 if the final answer of `completion` equals `answer` (itself reduced by
    `final_answer` when it is a full GSM8K solution with `#### N`), else 0.0.

    Raises:
      ValueError: the prompt row carries no reference answer.
    """
    del prompt
    if answer is None:
        raise ValueError("the math reward needs a reference answer; the prompt row has none")
    reference = final_answer(answer) if "####" in answer or "\\boxed{" in answer else answer
    predicted = final_answer(completion)
    if predicted is None or reference is None:
        return 0.0
    return 1.0 if answers_equal(predicted, reference) else 0.0
