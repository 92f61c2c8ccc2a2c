"""CISPO (`jaxrlhf/algorithms/cispo.py`), the algorithm registry's proof: one module, its
config and this test. The loss and its gradient against numpy, the advantages against numpy,
the graph, what the registry lets it run, and `configs/cispo_tiny.py:smoke` through the run
stack as `python -m jaxrlhf.train` runs it."""

import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrlhf.algorithms import cispo, registry
from jaxrlhf.configs import cispo_tiny
from jaxrlhf.mfc import Role
from jaxrlhf.run import rl
from jaxrlhf.run.check import check_config
from jaxrlhf.schema import ConfigError
from jaxrlhf.spec import run_spec


def _np_loss(logp, old_logp, adv, mask, low, high):
    """(token mean of −sg(clip(r)) · A · log π, d mean / d log π, clip fraction) in float64."""
    ratio = np.exp(logp - old_logp)
    weight = np.clip(ratio, 1.0 - low, 1.0 + high)
    count = mask.sum()
    loss = np.sum(-weight * adv * logp * mask) / count
    grad = -weight * adv * mask / count  # the weight is a constant: REINFORCE's, weighed
    return loss, grad, np.sum((weight != ratio) * mask) / count


def _inputs(seed=0, b=6, n=5):
    rng = np.random.default_rng(seed)
    logp = -rng.uniform(0.05, 3.0, (b, n))
    old_logp = logp + rng.normal(0.0, 0.5, (b, n))  # ratios from about 0.2 to 5
    adv = np.repeat(rng.normal(size=(b, 1)), n, axis=1)
    mask = np.ones((b, n))
    mask[1, 3:] = mask[4, 1:] = 0.0
    return logp, old_logp, adv, mask


@pytest.mark.parametrize("low, high", [(1.0, 0.28), (0.2, 0.28), (1.0, 3.0)])
def test_loss_and_gradient_match_numpy(low, high):
    logp, old_logp, adv, mask = _inputs()
    cfg = cispo.CISPOConfig(group_size=2, clip_eps_low=low, clip_eps_high=high)

    def mean_loss(logp_bn):
        loss_sum, weight, stats = cispo.cispo_loss(
            logp_bn, jnp.asarray(old_logp, jnp.float32), jnp.asarray(adv, jnp.float32),
            jnp.asarray(mask, jnp.float32), cfg)
        return loss_sum / weight, stats["clip_frac"] / weight

    (loss, clip_frac), grad = jax.value_and_grad(mean_loss, has_aux=True)(
        jnp.asarray(logp, jnp.float32))
    want_loss, want_grad, want_clip = _np_loss(logp, old_logp, adv, mask, low, high)
    np.testing.assert_allclose(loss, want_loss, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(grad, want_grad, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(clip_frac, want_clip, rtol=1e-6)
    assert 0.0 < want_clip < 1.0 or high == 3.0  # the clip acts on some tokens, not all


def test_every_token_keeps_its_gradient():
    """PPO's surrogate gives a token outside its clip range no gradient; CISPO's does."""
    logp, old_logp, adv, mask = _inputs(1)
    cfg = cispo.CISPOConfig(group_size=2, clip_eps_low=0.1, clip_eps_high=0.1)
    grad = jax.grad(lambda x: cispo.cispo_loss(x, old_logp, adv, mask, cfg)[0])(
        jnp.asarray(logp, jnp.float32))
    assert np.all((np.asarray(grad) != 0) == ((mask > 0) & (adv != 0)))


def test_advantages_are_group_normalised():
    rng = np.random.default_rng(2)
    b, n, g = 8, 4, 4
    buf = {"seq_tokens_bs": jnp.ones((b, 6 + n), jnp.int32),
           "seq_mask_bs": jnp.ones((b, 6 + n), jnp.int32),
           "response_mask_bn": jnp.asarray(rng.uniform(size=(b, n)) > 0.3),
           "behav_logp_bn": jnp.asarray(-rng.uniform(size=(b, n)), jnp.float32),
           "scores_b": jnp.asarray([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0], jnp.float32)}
    batch, stats = cispo._train_batch(buf, {}, cispo.CISPOConfig(group_size=g))
    scores = np.asarray(buf["scores_b"]).reshape(-1, g)
    want = (scores - scores.mean(1, keepdims=True)) / (scores.std(1, ddof=1, keepdims=True) + 1e-6)
    mask = np.asarray(buf["response_mask_bn"], np.float32)
    np.testing.assert_allclose(batch["advantages_bn"], want.reshape(-1, 1) * mask, rtol=1e-5,
                               atol=1e-6)
    assert float(stats["flat_group_frac"]) == 0.5


def test_graph_and_what_the_registry_lets_it_run():
    config = cispo_tiny.get_config("smoke")
    spec = run_spec(config)
    assert [m.name for m in spec.graph.mfcs] == ["actor_gen", "reward", "actor_train"]
    assert Role.REF not in spec.graph.roles() and spec.algorithm.name == "cispo"
    assert (spec.mini_batches, spec.epochs) == (2, 1)
    assert registry.lookup("cispo").reads_sections == ("cispo", "ppo")
    config.async_rl.max_staleness = 1
    with pytest.raises(ConfigError, match=r"^async_rl.max_staleness=1: asynchronous RL runs "
                                          r"ppo and grpo, not cispo$"):
        run_spec(config)
    config = cispo_tiny.get_config("smoke")
    config.cispo.clip_eps_low = 1.5
    with pytest.raises(ConfigError, match=r"^cispo.clip_eps_low=1.5: must be <= 1$"):
        run_spec(config)


def test_another_algorithm_refuses_its_keys(tmp_path):
    config = cispo_tiny.get_config("smoke")
    config.algorithm, config.cispo.clip_eps_high = "grpo", 0.5
    with pytest.raises(ConfigError, match=r"^cispo.clip_eps_high=0.5: algorithm=grpo does not "
                                          r"read cispo.\* \(read by cispo\)$"):
        check_config(config, str(tmp_path))


def test_smoke_variant_runs(tmp_path):
    summary = rl.run(check_config(cispo_tiny.get_config("smoke"), str(tmp_path)))
    assert summary["steps"] == 2 and not summary["interrupted"], summary
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "reward" in r]
    assert [r["step"] for r in steps] == [0, 1]
    for record in steps:
        for key in ("reward", "actor/loss", "actor/clip_frac", "actor/importance_weight"):
            assert math.isfinite(record[key]), (key, record.get(key))
