"""Every role from its own weights: a PPO run whose actor, critic and reward model are three
Hugging Face directories of different sizes and families (built here with transformers), with
the reward model scoring on a layout of its own; the first step's critic values and reward
scores equal transformers' for those directories. Also where roles without weights start from.
"""

import numpy as np
import pytest

from hf_fixtures import hf_token_scores, make_tiny_hf_model
from jaxrlhf.data import tasks
from jaxrlhf.data.encode import prompt_batch
from jaxrlhf.data.tokenizer import BYTE_VOCAB_SIZE
from jaxrlhf.mfc import Role
from jaxrlhf.run import build, roles
from jaxrlhf.run.check import check_config
from jaxrlhf.schema import base_config
from jaxrlhf.spec import ConfigError, run_spec

ROWS = 8
# Critic and reward model: other sizes than the actor's (hidden 64, 2 layers), other families.
CRITIC = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2)
REWARD = dict(hidden_size=96, intermediate_size=160, num_hidden_layers=1, num_attention_heads=4,
              num_key_value_heads=2)


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    """(actor dir, critic dir, critic HF model, reward dir, reward HF model)."""
    root = tmp_path_factory.mktemp("roles")
    vocab = dict(vocab_size=BYTE_VOCAB_SIZE)
    actor, _ = make_tiny_hf_model(root / "actor", "llama", seed=1, **vocab)
    critic, critic_hf = make_tiny_hf_model(root / "critic", "qwen2", seq_cls=True, seed=2,
                                           **vocab, **CRITIC)
    reward, reward_hf = make_tiny_hf_model(root / "reward", "llama", seq_cls=True, seed=3,
                                           **vocab, **REWARD)
    return actor, critic, critic_hf, reward, reward_hf


def ppo_config(actor, critic, reward):
    config = base_config()
    config.steps = 1
    config.warm_start.sft_steps = 0
    config.rollout.update(batch_size=ROWS, max_prompt_len=16, max_new_tokens=8)
    config.reward.kind = "model"
    for role, path in (("actor", actor), ("critic", critic), ("reward", reward)):
        config.models[role].path = str(path)
    config.placement.update(kind="manual", allocation=(
        "actor_gen=0-7:d8,reward=4-7:d2t2,ref_inf=0-3:d4,critic_inf=0-7:d4t2,"
        "actor_train=0-7:d8,critic_train=0-7:d4t2"))
    return config


def test_critic_and_reward_of_other_sizes_match_transformers(hf_dirs, tmp_path):
    actor, critic, critic_hf, reward, reward_hf = hf_dirs
    job = check_config(ppo_config(actor, critic, reward), str(tmp_path))
    models = job.spec.models
    assert models[Role.CRITIC].config.hidden_size == 32
    assert models[Role.REWARD].config.num_layers == 1
    assert models[Role.ACTOR].config.hidden_size == 64
    rows = tasks.make_reverse_task(tasks.ReverseTask(num_train=ROWS, num_eval=8, num_sft=8))
    with build.host_pools(job.spec) as pools:
        runner = build.fresh_runner(job, pools)
        result = runner.step(prompt_batch(rows.train, job.tokenizer, 16))
        runner.close()
    buf = result.buffer
    tokens_bs, mask_bs = np.asarray(buf["seq_tokens_bs"]), np.asarray(buf["seq_mask_bs"])
    n = np.asarray(buf["response_mask_bn"]).shape[1]
    # Reward: the classifier's score at each sequence's last real token (HF's pooling).
    last_b = mask_bs.shape[1] - 1 - np.argmax(mask_bs[:, ::-1], axis=1)
    want_b = hf_token_scores(reward_hf, tokens_bs, mask_bs)[np.arange(ROWS), last_b]
    np.testing.assert_allclose(np.asarray(buf["scores_b"]), want_b, atol=1e-4, rtol=1e-4)
    # Critic: the value at every position that predicts a response token (0 on padding).
    values_bn = np.asarray(buf["values_bn"])
    want_bn = hf_token_scores(critic_hf, tokens_bs, mask_bs)[:, -n - 1:-1]
    real_bn = mask_bs[:, -n - 1:-1] == 1
    np.testing.assert_allclose(values_bn[real_bn], want_bn[real_bn], atol=1e-4, rtol=1e-4)
    assert not values_bn[~real_bn].any()
    assert np.isfinite(result.metrics["critic/loss"]) and "reward" in result.metrics
    assert np.std(want_b) > 1e-3  # the scores tell sequences apart: the check can fail


def test_where_roles_start(hf_dirs):
    actor, critic, _, reward, _ = hf_dirs
    spec = run_spec(ppo_config(actor, critic, reward))
    assert roles.starts(spec) == {Role.ACTOR: roles.Start.LOAD, Role.REF: roles.Start.ACTOR_COPY,
                                  Role.CRITIC: roles.Start.LOAD, Role.REWARD: roles.Start.LOAD}
    # The ref copies the actor: it gets the actor's architecture whatever its size key says.
    assert spec.models[Role.REF].config == spec.models[Role.ACTOR].config
    # A critic without weights beside a pretrained actor of another size: a clear error.
    config = ppo_config(actor, "", reward)
    with pytest.raises(ConfigError, match="models.critic: no path, and its architecture"):
        roles.starts(run_spec(config))
    # The actor's own directory as critic: its trunk with a new zero score head.
    config.models.critic.path = str(actor)
    assert roles.start_of(run_spec(config), Role.CRITIC) is roles.Start.LOAD
    # Without any weights: a critic of the actor's size starts from its trunk, another size
    # from its own initialisation.
    config = base_config()
    assert roles.start_of(run_spec(config), Role.CRITIC) is roles.Start.ACTOR_TRUNK
    config.models.critic.size = "small"
    assert roles.start_of(run_spec(config), Role.CRITIC) is roles.Start.INIT


def test_critic_from_a_causal_lm_directory_starts_with_a_zero_head(hf_dirs, tmp_path):
    actor, _, _, reward, _ = hf_dirs
    config = ppo_config(actor, actor, reward)
    config.placement.update(kind="colocate", allocation="")
    job = check_config(config, str(tmp_path))
    home = job.plan.home(job.spec.graph, Role.CRITIC)
    params = build.load_role(job.spec.models[Role.CRITIC], home)
    assert not np.asarray(params["score"]).any()
    actor_params = build.load_role(job.spec.models[Role.ACTOR], home)
    np.testing.assert_array_equal(np.asarray(params["embed_tokens"]["embedding"]),
                                  np.asarray(actor_params["embed_tokens"]["embedding"]))


@pytest.mark.slow  # the PPO test above covers the same code path; this adds the cost role
def test_safe_rlhf_cost_model_from_its_own_directory(hf_dirs, tmp_path):
    actor, critic, critic_hf, cost, cost_hf = hf_dirs
    config = base_config()
    config.algorithm = "safe_rlhf"
    config.steps, config.warm_start.sft_steps = 1, 0
    config.rollout.update(batch_size=ROWS, max_prompt_len=16, max_new_tokens=8)
    config.cost.kind = "model"
    # The reward critic: the actor's own directory (its trunk, a new zero score head).
    for role, path in (("actor", actor), ("critic", actor), ("cost", cost),
                       ("cost_critic", critic)):
        config.models[role].path = str(path)
    job = check_config(config, str(tmp_path))
    rows = tasks.make_reverse_task(tasks.ReverseTask(num_train=ROWS, num_eval=8, num_sft=8))
    with build.host_pools(job.spec) as pools:
        runner = build.fresh_runner(job, pools)
        buf = runner.step(prompt_batch(rows.train, job.tokenizer, 16)).buffer
        runner.close()
    tokens_bs, mask_bs = np.asarray(buf["seq_tokens_bs"]), np.asarray(buf["seq_mask_bs"])
    last_b = mask_bs.shape[1] - 1 - np.argmax(mask_bs[:, ::-1], axis=1)
    want_b = hf_token_scores(cost_hf, tokens_bs, mask_bs)[np.arange(ROWS), last_b]
    np.testing.assert_allclose(np.asarray(buf["costs_b"]), want_b, atol=1e-4, rtol=1e-4)
    n = np.asarray(buf["response_mask_bn"]).shape[1]
    real_bn = mask_bs[:, -n - 1:-1] == 1
    want_bn = hf_token_scores(critic_hf, tokens_bs, mask_bs)[:, -n - 1:-1]
    np.testing.assert_allclose(np.asarray(buf["cost_values_bn"])[real_bn], want_bn[real_bn],
                               atol=1e-4, rtol=1e-4)
