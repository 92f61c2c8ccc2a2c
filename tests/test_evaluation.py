"""Evaluation metrics: greedy accuracy, pass@k, mean@k."""

import itertools

import numpy as np
import pytest

from jaxrlhf.data.evaluation import eval_metrics, pass_at_k


def test_pass_at_k_matches_enumeration():
    # pass@k = fraction of k-subsets of the n samples holding at least one correct sample.
    for n, c, k in [(5, 2, 1), (5, 2, 3), (6, 0, 2), (4, 4, 4), (7, 3, 4)]:
        samples = [1] * c + [0] * (n - c)
        subsets = list(itertools.combinations(samples, k))
        want = sum(any(s) for s in subsets) / len(subsets)
        assert pass_at_k(n, c, k) == pytest.approx(want, abs=1e-12)
    with pytest.raises(ValueError, match="1 <= k <= n"):
        pass_at_k(3, 1, 4)


def test_eval_metrics():
    scores = np.array([[1.0, 0.0, 0.0, 0.0], [1.0, 1.0, 0.0, 1.0]])
    m = eval_metrics(scores, ks=(1, 2))
    assert m["eval/mean@4"] == pytest.approx(4 / 8)
    assert m["eval/pass@1"] == pytest.approx((1 / 4 + 3 / 4) / 2)
    assert m["eval/pass@2"] == pytest.approx(((1 - 3 / 6) + 1.0) / 2)
    greedy = eval_metrics(np.array([[1.0], [0.0], [1.0]]), prefix="heldout")
    assert greedy["heldout/accuracy"] == pytest.approx(2 / 3)
    with pytest.raises(ValueError, match="non-empty"):
        eval_metrics(np.zeros((0, 2)))
