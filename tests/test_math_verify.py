"""The `math` reward judges equality with Hugging Face's math-verify, and agrees with it.

The equivalences are the ones issue 35 lists as missed by the hand-written reward it replaced;
every case of this file and of test_math_reward.py is also scored by math-verify end to end
(its own extraction of the completion and of the reference), and the reward must agree.
"""

import threading

import math_verify
import pytest

from jaxrlhf.data.math_reward import math_reward
from jaxrlhf.data.rewards import RewardPool
from tests.unit.test_math_reward import TABLE

# (completion, reference, reward): each equivalence, and a near miss beside it.
EQUIVALENCES = [
    ("\\boxed{2\\sqrt{2}}", "\\sqrt{8}", 1.0),
    ("\\boxed{2\\sqrt{3}}", "\\sqrt{8}", 0.0),
    ("so it is $\\frac{\\pi}{2}$", "\\pi/2", 1.0),  # math-verify's extraction: no box needed
    ("\\boxed{\\frac{\\pi}{3}}", "\\pi/2", 0.0),
    ("\\boxed{x = 4}", "4", 1.0),
    ("\\boxed{y = 4}", "x = 4", 0.0),
    ("\\boxed{1{,}250}", "1250", 1.0),
    ("#### 1,250.", "1250", 1.0),
    ("\\boxed{1{,}250}", "125", 0.0),
    ("\\boxed{10^{3}}", "1000", 1.0),
    ("\\boxed{10^{4}}", "1000", 0.0),
    ("\\boxed{3, 1, 2}", "\\{1, 2, 3\\}", 1.0),
    ("\\boxed{3, 1}", "\\{1, 2, 3\\}", 0.0),
    ("\\boxed{\\$18}", "18", 1.0),
    ("\\boxed{\\$18}", "\\$19", 0.0),
    ("\\boxed{50\\%}", "0.5", 1.0),
    ("\\boxed{0.333}", "1/3", 0.0),  # numbers compare to 6 digits, not 3
]


@pytest.mark.parametrize("completion,answer,score", EQUIVALENCES)
def test_equivalences_of_issue_35(completion, answer, score):
    assert math_reward("q", completion, answer) == score


def _math_verify_score(completion: str, answer: str) -> tuple[float, bool]:
    """math-verify's own verdict end to end, and whether it found an answer in `completion`.

    A bare reference (`\\pi/2`) is LaTeX without delimiters: math-verify reads it between `$`.
    """
    full = "####" in answer or "\\boxed{" in answer
    gold = math_verify.parse(answer if full else f"${answer}$")
    predicted = math_verify.parse(completion)
    return float(math_verify.verify(gold, predicted)), bool(predicted)


@pytest.mark.parametrize("completion,answer,score", EQUIVALENCES + TABLE)
def test_agrees_with_math_verify(completion, answer, score):
    """Where math-verify finds an answer, the verdicts are equal; where it finds none (a cut-off
    box, `It costs \\$18.`), the reward's last-number fallback is the only difference."""
    verdict, found = _math_verify_score(completion, answer)
    if found:
        assert score == verdict
    else:
        assert verdict == 0.0
    assert math_reward("q", completion, answer) == score


def test_runs_in_the_reward_pool_and_off_the_main_thread():
    """The pool's workers call it on their main thread (math-verify's alarms on); a thread of the
    trainer may too, where math-verify would refuse to set an alarm: there they are off."""
    completions = [c for c, _, _ in EQUIVALENCES]
    answers = [a for _, a, _ in EQUIVALENCES]
    with RewardPool("math", num_workers=1, timeout_s=30.0) as pool:
        batch = pool.submit(["q"] * len(completions), completions, answers).result(timeout=120)
    assert batch.errors.total == 0
    assert batch.rewards_b.tolist() == [s for _, _, s in EQUIVALENCES]
    got = []
    thread = threading.Thread(target=lambda: got.append(math_reward("q", "\\boxed{2\\sqrt{2}}",
                                                                    "\\sqrt{8}")))
    thread.start()
    thread.join()
    assert got == [1.0]
