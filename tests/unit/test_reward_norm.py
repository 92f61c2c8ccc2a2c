"""Reward normalisation (running mean/std over the run, then clipping) against numpy, as the
trained models' `prepare` sees it, with its statistics carried by the controller state."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrlhf.algorithms import ppo
from jaxrlhf.algorithms import reward_norm as rn
from jaxrlhf.mfc import Role
from jaxrlhf.schema import base_config
from jaxrlhf.spec import ConfigError, run_spec

B, S, N = 4, 6, 3


def numpy_norm(scores, history, clip):
    mean, std = np.mean(history), np.std(history)
    out = (scores - mean) / np.sqrt(std**2 + 1e-8)
    return np.clip(out, -clip, clip) if clip else out


@pytest.mark.parametrize("clip", [0.0, 1.5])
def test_running_statistics_match_numpy(clip):
    rng = np.random.default_rng(0)
    cfg = rn.RewardNormConfig(normalize=True, clip=clip)
    stats, history = (0.0, 0.0, 0.0), []
    for _ in range(4):
        scores = rng.normal(3.0, 2.0, size=B).astype(np.float32)
        history += list(scores)
        stats = rn.merge(*stats, jnp.asarray(scores))
        np.testing.assert_allclose(stats[0], len(history))
        np.testing.assert_allclose(stats[1], np.mean(history), rtol=1e-5)
        np.testing.assert_allclose(stats[2] / stats[0], np.var(history), rtol=1e-4)
        got = rn.normalized(jnp.asarray(scores), *stats, cfg)
        np.testing.assert_allclose(got, numpy_norm(scores, history, clip), rtol=1e-4, atol=1e-5)


def _buffer(rng, scores):
    return {"seq_tokens_bs": jnp.ones((B, S), jnp.int32), "seq_mask_bs": jnp.ones((B, S)),
            "response_mask_bn": jnp.ones((B, N)), "behav_logp_bn": jnp.zeros((B, N)),
            "ref_logp_bn": jnp.zeros((B, N)), "values_bn": jnp.asarray(rng.normal(size=(B, N))),
            "scores_b": jnp.asarray(scores)}


def test_trained_models_see_normalised_scores_and_the_controller_keeps_the_statistics():
    algorithm = rn.with_reward_norm(ppo.make(ppo.PPOConfig(), reward_model=True, batch_size=B),
                                    rn.RewardNormConfig(normalize=True, clip=2.0))
    rng = np.random.default_rng(1)
    controller, history = dict(algorithm.controller_init), []
    for _ in range(3):
        scores = rng.normal(-1.0, 5.0, size=B).astype(np.float32)
        history += list(scores)
        buf = _buffer(rng, scores)
        scalars = {k: np.float32(v) for k, v in controller.items()}
        outs = {role: jax.jit(spec.prepare)(buf, scalars)[1]
                for role, spec in algorithm.train.items()}
        want = numpy_norm(scores, history, 2.0)
        for stats in outs.values():  # actor and critic: the same normalised scores
            np.testing.assert_allclose(stats["score"], np.mean(want), rtol=1e-4, atol=1e-5)
        controller = algorithm.controller_update(controller, {k: float(v) for k, v in
                                                              outs[Role.ACTOR].items()})
    assert controller[rn.COUNT] == len(history)
    np.testing.assert_allclose(controller[rn.MEAN], np.mean(history), rtol=1e-5)
    np.testing.assert_allclose(controller[rn.M2] / len(history), np.var(history), rtol=1e-4)
    assert "kl_coef" in controller  # PPO's own controller goes on


def test_reward_norm_config():
    config = base_config()
    config.reward.update(normalize=True, clip=5.0)
    assert rn.COUNT in run_spec(config).algorithm.controller_init
    config.reward.clip = -1.0
    with pytest.raises(ConfigError, match="reward.clip=-1.0: must be >= 0"):
        run_spec(config)
    config.reward.clip, config.algorithm = 0.0, "dpo"
    with pytest.raises(ConfigError, match="reward: reward normalisation needs an RL algorithm"):
        run_spec(config)
