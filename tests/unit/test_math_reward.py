"""The built-in `math` reward: answer extraction and normalisation."""

import pytest

from jaxrlhf.data.math_reward import answers_equal, final_answer, last_boxed, math_reward
from jaxrlhf.data.rewards import resolve_reward


# (completion, reference, reward); tests/test_math_verify.py checks math-verify agrees.
TABLE = [
    ("so the answer is \\boxed{42}.", "42", 1.0),
    ("\\boxed{\\frac{1}{2}}", "0.5", 1.0),
    ("\\boxed{\\dfrac{3}{4}}", "3/4", 1.0),
    ("$\\boxed{1,000}$", "1000", 1.0),
    ("\\boxed{\\text{5 apples}}", "5", 0.0),  # math-verify keeps the words in \text
    ("\\boxed{x^{2}+1}", "x^{2}+1", 1.0),  # nested braces, non-numeric
    ("she has 3 then 7 left", "7", 1.0),  # last number
    ("she has 7 then 3 left", "7", 0.0),
    ("Work...\n#### 18", "Janet sells 16 - 3 - 4 = 9 ... 9 * 2 = 18\n#### 18", 1.0),  # GSM8K ref
    ("#### 17", "#### 18", 0.0),
    ("\\boxed{12} but later 13", "12", 1.0),  # the box wins over the last number
    ("no answer here", "3", 0.0),
    ("\\boxed{12", "12", 1.0),  # cut-off box: falls back to the last number
    ("\\boxed{-2.50}", "-5/2", 1.0),
    ("\\boxed{1/0}", "1/0", 1.0),  # both sides infinite
    ("It costs \\$18.", "18", 1.0),  # math-verify finds nothing here: the last number
]


@pytest.mark.parametrize("completion,answer,score", TABLE)
def test_math_reward_table(completion, answer, score):
    assert math_reward("q", completion, answer) == score


def test_helpers_and_registry():
    assert last_boxed("a \\boxed{1} b \\boxed{{2}}") == "{2}"
    assert final_answer("x = 3.") == "3" and final_answer("#### 3.") == "3"
    assert answers_equal("3", "3.0") and not answers_equal("3", "4")
    assert resolve_reward("math") is math_reward
    with pytest.raises(ValueError, match="needs a reference answer"):
        math_reward("q", "1", None)
