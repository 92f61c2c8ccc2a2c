"""Held-out evaluation metrics from per-sample rewards: accuracy, pass@k and mean@k.

Pure functions over a [num_prompts, n] array of scores (n samples per prompt, a sample counts as
correct when its score >= `threshold`), so a training loop only has to generate and score.
"""

from __future__ import annotations

import math

import numpy as np


def pass_at_k(num_samples: int, num_correct: int, k: int) -> float:
    """Unbiased pass@k of one prompt: 1 - C(n-c, k) / C(n, k) (Chen et al., 2021)."""
    if not 1 <= k <= num_samples:
        raise ValueError(f"pass@k needs 1 <= k <= n samples, got k={k}, n={num_samples}")
    if num_samples - num_correct < k:
        return 1.0
    return 1.0 - math.comb(num_samples - num_correct, k) / math.comb(num_samples, k)


def eval_metrics(scores_pn: np.ndarray, ks: tuple[int, ...] = (1,), *,
                 threshold: float = 1.0, prefix: str = "eval") -> dict[str, float]:
    """Metrics of `scores_pn` [num_prompts, n]: `{prefix}/mean@n` (mean score), `{prefix}/pass@k`
    for each k (averaged over prompts) and, when n == 1 (greedy), `{prefix}/accuracy`."""
    scores_pn = np.asarray(scores_pn, np.float64)
    if scores_pn.ndim != 2 or scores_pn.size == 0:
        raise ValueError(f"scores must be a non-empty [prompts, samples] array, got {scores_pn.shape}")
    n = scores_pn.shape[1]
    correct_p = (scores_pn >= threshold).sum(axis=1)
    out = {f"{prefix}/mean@{n}": float(scores_pn.mean())}
    for k in ks:
        out[f"{prefix}/pass@{k}"] = float(np.mean([pass_at_k(n, int(c), k) for c in correct_p]))
    if n == 1:
        out[f"{prefix}/accuracy"] = float(correct_p.mean())
    return out
