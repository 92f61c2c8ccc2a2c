"""The algorithms' dataflow graphs, and the glue they add around the tested math, vs numpy."""

import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrlhf import spec as spec_lib
from jaxrlhf.run import build
from jaxrlhf.run.layouts import place
from jaxrlhf.algorithms import dpo, grpo, pairs, remax, rw, safe_rlhf
from jaxrlhf.algorithms import losses
from jaxrlhf.data import costs, encode, sources
from jaxrlhf.data.datasets import PreferenceRow
from jaxrlhf.data.tokenizer import load_tokenizer
from jaxrlhf.algorithms.spec import policy_readout
from jaxrlhf.engine import inference
from jaxrlhf.engine.inference import InferenceBatch, InferenceConfig, InferenceKind, InferenceOutput
from jaxrlhf.engine.microbatch import split
from jaxrlhf.mfc import MFC, Call, Role
from jaxrlhf.models.sizes import get_size
from jaxrlhf.parallel.layout import make_layout

RL_DATA = {"prompt_tokens_bp", "prompt_mask_bp", "answer"}
PAIR_DATA = {"seq_tokens_bs", "seq_mask_bs", "response_mask_bn"}

# algorithm -> (its MFC names, dataset keys, trained roles, roles run on the host)
GRAPHS = {
    "grpo": (("actor_gen", "ref_inf", "reward", "actor_train"), RL_DATA, {Role.ACTOR},
             {Role.REWARD}),
    "remax": (("actor_gen", "actor_gen_greedy", "ref_inf", "reward", "reward_greedy",
               "actor_train"), RL_DATA, {Role.ACTOR}, {Role.REWARD}),
    "safe_rlhf": (("actor_gen", "ref_inf", "critic_inf", "cost_critic_inf", "reward", "cost",
                   "actor_train", "critic_train", "cost_critic_train"), RL_DATA,
                  {Role.ACTOR, Role.CRITIC, Role.COST_CRITIC}, {Role.REWARD, Role.COST}),
    "dpo": (("ref_inf", "actor_train"), PAIR_DATA, {Role.ACTOR}, set()),
    "rw": (("reward_train",), PAIR_DATA, {Role.REWARD}, set()),
    "sft": (("actor_train",), PAIR_DATA, {Role.ACTOR}, set()),
}


def tiny_config(name):
    return importlib.import_module(f"jaxrlhf.configs.{name}_tiny").get_config()


@pytest.mark.parametrize("name", sorted(GRAPHS))
def test_graph_builds_and_places(name):
    config = tiny_config(name)
    spec = spec_lib.run_spec(config)
    algorithm, graph = spec.algorithm, spec.graph
    names, dataset_keys, trained, host = GRAPHS[name]
    assert set(graph.order) == set(names)
    assert set(graph.dataset_keys) == dataset_keys
    assert set(algorithm.train) == trained
    assert {m.role for m in graph.mfcs if m.call is Call.TRAIN_STEP} == trained
    assert {m.role for m in graph.mfcs if m.host} == host
    assert set(spec.models) == set(graph.roles()) - host
    plan = place(spec)
    assert set(plan.layouts) == {m.name for m in graph.mfcs if not m.host}
    assert spec.algorithm.offline == (dataset_keys == PAIR_DATA)


@pytest.mark.parametrize("name", sorted(GRAPHS))
def test_run_updates_are_the_trained_models(name):
    """The run's mini-batches and epochs (the placement check's split, the planner's workload,
    the lr schedule's length) are what its trained model's train step does: PPO's settings
    for the RL algorithms, one update per step offline, whatever `ppo` says."""
    config = tiny_config(name)
    config.ppo.update(mini_batches=2, epochs=3)
    spec = spec_lib.run_spec(config)
    train = spec.algorithm.train[spec.algorithm.trained_role]
    offline = spec.algorithm.offline
    assert (spec.mini_batches, spec.epochs) == (train.mini_batches, train.epochs)
    assert (spec.mini_batches, spec.epochs) == ((1, 1) if offline else (2, 3))
    updates = config.steps * (1 if offline else 6)
    assert spec.optimizers[spec.algorithm.trained_role].total_steps == max(
        updates, config.optimizer[spec.algorithm.trained_role.value].warmup_steps + 1)


def test_grpo_needs_groups():
    config = tiny_config("grpo")
    config.rollout.group_size = 1
    with pytest.raises(ValueError, match="group_size >= 2"):
        spec_lib.make_algorithm(config)


def test_greedy_is_a_generate_option():
    with pytest.raises(ValueError, match="only generate calls can be greedy"):
        MFC("x", Role.ACTOR, Call.INFERENCE, ("a",), ("b",), greedy=True)


def test_remax_greedy_mfc_gets_a_greedy_generator():
    config = tiny_config("remax")
    config.rollout.temperature, config.rollout.top_k = 0.7, 5
    spec = spec_lib.run_spec(config)
    algorithm = spec.algorithm
    model = get_size("tiny", dtype=jnp.float32)
    layout = make_layout("0-1:d2", model=model)
    tokenizer = load_tokenizer("byte")
    by_name = {m.name: m for m in algorithm.mfcs}
    engine = lambda n: build.engine_call(by_name[n], model, layout, 1, spec.rollout, tokenizer,
                                         algorithm, None)
    sampled, greedy = engine("actor_gen").gen_config, engine("actor_gen_greedy").gen_config
    assert (sampled.temperature, sampled.top_k) == (0.7, 5)
    assert (greedy.temperature, greedy.top_k, greedy.top_p) == (0.0, 0, 1.0)


# --- numpy references -----------------------------------------------------------------------

def np_log_softmax(x):
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def readout_of(logits_btv, batch, cfg=InferenceConfig(InferenceKind.LOGPROBS)):
    """The train step's readout of `logits_btv` on the batch's rows (what a loss reads)."""
    inputs = InferenceBatch(*(jnp.asarray(batch[k]) for k in
                              ("tokens_bt", "positions_bt", "segment_ids_bt")))
    return inference.readout(cfg, jnp.asarray(logits_btv), inputs)


def np_response_logp(logits_btv, tokens_bt, n):
    logp_btv = np_log_softmax(logits_btv.astype(np.float64))[:, -n - 1:-1]
    return np.take_along_axis(logp_btv, tokens_bt[:, -n:, None], axis=-1)[..., 0]


def np_gae(rewards_bn, values_bn, mask_bn, gamma, lam):
    adv = np.zeros_like(rewards_bn, dtype=np.float64)
    for b in range(rewards_bn.shape[0]):
        next_value = next_adv = 0.0
        for t in reversed(range(rewards_bn.shape[1])):
            if not mask_bn[b, t]:
                continue
            delta = rewards_bn[b, t] + gamma * next_value - values_bn[b, t]
            next_adv = adv[b, t] = delta + gamma * lam * next_adv
            next_value = values_bn[b, t]
    return adv, np.where(mask_bn > 0, adv + values_bn, 0.0)


def np_last_token(mask_bn):
    out = np.zeros(mask_bn.shape)
    for b, row in enumerate(mask_bn):
        valid = np.flatnonzero(row)
        if valid.size:
            out[b, valid[-1]] = 1.0
    return out


def response_mask(lengths, n):
    return (np.arange(n)[None, :] < np.asarray(lengths)[:, None]).astype(np.float32)


def rl_buffer(rng, lengths, n=5, p=3):
    """A step buffer of generated rows: [b, p + n] sequences, responses of `lengths` tokens."""
    b = len(lengths)
    mask_bn = response_mask(lengths, n)
    seq_mask = np.concatenate([np.ones((b, p), np.float32), mask_bn], axis=1)
    f32 = lambda *shape: rng.normal(size=shape).astype(np.float32)
    return {
        "seq_tokens_bs": rng.integers(0, 11, size=(b, p + n)).astype(np.int32),
        "seq_mask_bs": seq_mask, "response_mask_bn": mask_bn,
        "behav_logp_bn": -np.abs(f32(b, n)), "ref_logp_bn": -np.abs(f32(b, n)),
        "scores_b": rng.integers(0, 2, size=b).astype(np.float32),
        "values_bn": f32(b, n), "costs_b": rng.integers(0, 2, size=b).astype(np.float32),
        "cost_values_bn": f32(b, n), "greedy_scores_b": rng.integers(0, 2, b).astype(np.float32),
    }


def test_grpo_group_advantages_vs_numpy():
    rng = np.random.default_rng(0)
    buf = rl_buffer(rng, [5, 3, 1, 4, 2, 5, 5, 2])
    buf["scores_b"] = np.array([1, 0, 0, 1, 1, 1, 1, 1], np.float32)  # second group is flat
    cfg = grpo.GRPOConfig(group_size=4)
    targets, stats = jax.jit(lambda b: grpo.group_advantages(b, cfg))(buf)
    scores_gk = buf["scores_b"].reshape(2, 4).astype(np.float64)
    adv_gk = (scores_gk - scores_gk.mean(1, keepdims=True)) / (scores_gk.std(1, ddof=1,
                                                                              keepdims=True) + 1e-6)
    expected_bn = adv_gk.reshape(8)[:, None] * buf["response_mask_bn"]
    np.testing.assert_allclose(targets["advantages_bn"], expected_bn, rtol=1e-6, atol=1e-6)
    kl_b = ((buf["behav_logp_bn"] - buf["ref_logp_bn"]) * buf["response_mask_bn"]).sum(1)
    np.testing.assert_allclose(stats["kl"], kl_b.mean(), rtol=1e-5)
    assert float(stats["flat_group_frac"]) == 0.5
    assert float(stats["response_length"]) == np.mean([5, 3, 1, 4, 2, 5, 5, 2])


def test_grpo_loss_vs_numpy():
    rng = np.random.default_rng(1)
    b, p, n, v = 4, 3, 5, 11
    buf = rl_buffer(rng, [5, 2, 4, 1], n, p)
    policy = losses.PPOLossConfig(entropy_coef=0.01,
                                  aggregation=losses.LossAggregation.SEQ_MEAN_TOKEN_MEAN)
    cfg = grpo.GRPOConfig(group_size=2, loss=losses.GRPOLossConfig(policy, kl_coef=0.3),
                          temperature=1.0)
    logits_btv = rng.normal(size=(b, p + n, v)).astype(np.float32)
    logp_bn = np_response_logp(logits_btv, buf["seq_tokens_bs"], n)
    buf["behav_logp_bn"] = (logp_bn + rng.normal(scale=0.3, size=(b, n))).astype(np.float32)
    batch, _ = jax.jit(lambda bf: grpo._train_batch(bf, {}, cfg))(buf)
    out = readout_of(logits_btv, batch, policy_readout(cfg.temperature))
    loss_sum, weight, _ = jax.jit(grpo.actor_loss(cfg))(out, batch)

    adv_bn = np.asarray(batch["advantages_bn"], np.float64)
    ratio = np.exp(logp_bn - buf["behav_logp_bn"])
    surrogate = -np.minimum(ratio * adv_bn, np.clip(ratio, 0.8, 1.2) * adv_bn)
    log_r = buf["ref_logp_bn"] - logp_bn
    k3 = np.exp(log_r) - log_r - 1.0
    probs = np.exp(np_log_softmax(logits_btv.astype(np.float64)))[:, -n - 1:-1]
    entropy = -(probs * np.log(probs)).sum(-1)
    mask = buf["response_mask_bn"]
    per_seq = ((surrogate + 0.3 * k3 - 0.01 * entropy) * mask).sum(1) / mask.sum(1)
    assert float(weight) == b
    np.testing.assert_allclose(float(loss_sum) / float(weight), per_seq.mean(), rtol=1e-5)


def test_remax_advantages_vs_numpy():
    rng = np.random.default_rng(2)
    buf = rl_buffer(rng, [5, 3, 1, 4])
    cfg = remax.ReMaxConfig()
    targets, stats = jax.jit(lambda bf: remax.remax_targets(bf, {"kl_coef": 0.2}, cfg))(buf)
    mask = buf["response_mask_bn"]
    rewards = (-0.2 * (buf["behav_logp_bn"] - buf["ref_logp_bn"]) * mask
               + buf["scores_b"][:, None] * np_last_token(mask))
    to_go = np.cumsum(rewards[:, ::-1], axis=1)[:, ::-1]
    expected = (to_go - buf["greedy_scores_b"][:, None]) * mask
    np.testing.assert_allclose(targets["advantages_bn"], expected, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(stats["score_over_greedy"],
                               np.mean(buf["scores_b"] - buf["greedy_scores_b"]), rtol=1e-6)


@pytest.mark.parametrize("whiten", [True, False])
def test_safe_rlhf_targets_vs_numpy(whiten):
    rng = np.random.default_rng(3)
    buf = rl_buffer(rng, [5, 3, 1, 4, 2, 5])
    config = tiny_config("safe_rlhf")
    config.ppo.whiten_advantages = whiten
    cfg = safe_rlhf.from_config(config)
    gamma, lam = cfg.ppo.gamma, cfg.ppo.lam
    controller = {"kl_coef": jnp.float32(0.1), "log_lambda": jnp.float32(np.log(2.0))}
    batch, stats = jax.jit(lambda bf, c: safe_rlhf._actor_batch(bf, c, cfg))(buf, controller)

    mask, last = buf["response_mask_bn"], np_last_token(buf["response_mask_bn"])
    rewards = -0.1 * (buf["behav_logp_bn"] - buf["ref_logp_bn"]) * mask
    rewards += buf["scores_b"][:, None] * last
    adv_r, _ = np_gae(rewards, buf["values_bn"], mask, gamma, lam)
    adv_c, returns_c = np_gae(buf["costs_b"][:, None] * last, buf["cost_values_bn"], mask,
                              gamma, lam)
    combined = (adv_r - 2.0 * adv_c) / 3.0
    valid = mask > 0
    if whiten:
        combined = (combined - combined[valid].mean()) / np.sqrt(combined[valid].var() + 1e-5)
    np.testing.assert_allclose(batch["advantages_bn"], np.where(valid, combined, 0.0),
                               rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(stats["lambda"], 2.0, rtol=1e-6)
    np.testing.assert_allclose(stats["cost"], buf["costs_b"].mean(), rtol=1e-6)

    cost_batch, _ = jax.jit(lambda bf, c: safe_rlhf._cost_critic_batch(bf, c, cfg))(
        buf, controller)
    np.testing.assert_allclose(cost_batch["returns_bn"], returns_c, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(cost_batch["old_values_bn"], buf["cost_values_bn"])


def test_safe_rlhf_lagrange_controller():
    cfg = safe_rlhf.SafeRLHFConfig(lagrange=losses.LagrangeConfig(cost_limit=0.1,
                                                                   lambda_lr=0.5))
    start = {"kl_coef": 0.05, "log_lambda": float(np.log(2.0))}
    up = safe_rlhf.update_controller(start, {"kl": 1.0, "cost": 0.4}, cfg, batch_size=8)
    down = safe_rlhf.update_controller(start, {"kl": 1.0, "cost": 0.0}, cfg, batch_size=8)
    np.testing.assert_allclose(up["log_lambda"], np.log(2.0) + 0.5 * 0.3 * 2.0, rtol=1e-6)
    np.testing.assert_allclose(down["log_lambda"], np.log(2.0) - 0.5 * 0.1 * 2.0, rtol=1e-6)
    assert up["kl_coef"] == down["kl_coef"] == pytest.approx(0.05)


def test_dpo_loss_vs_numpy():
    rng = np.random.default_rng(4)
    pairs_n, p, n, v = 3, 3, 4, 11
    tokens = rng.integers(0, v, size=(2 * pairs_n, p + n)).astype(np.int32)
    mask_bn = response_mask([4, 2, 3, 1, 4, 2], n)
    buf = {"seq_tokens_bs": tokens,
           "seq_mask_bs": np.concatenate([np.ones((2 * pairs_n, p)), mask_bn], 1),
           "response_mask_bn": mask_bn,
           "ref_logp_bn": -np.abs(rng.normal(size=(2 * pairs_n, n))).astype(np.float32)}
    logits = rng.normal(size=(2 * pairs_n, p + n, v)).astype(np.float32)
    cfg = dpo.DPOConfig(losses.DPOLossConfig(beta=0.5))
    batch, _ = dpo._train_batch(buf, {})
    loss_sum, weight, stats = jax.jit(dpo.actor_loss(cfg))(readout_of(logits, batch), batch)

    seq = (np_response_logp(logits, tokens, n) * mask_bn).sum(1)
    ref_seq = (buf["ref_logp_bn"] * mask_bn).sum(1)
    margin = 0.5 * ((seq[:3] - ref_seq[:3]) - (seq[3:] - ref_seq[3:]))
    assert float(weight) == pairs_n
    np.testing.assert_allclose(float(loss_sum) / 3, np.mean(np.log1p(np.exp(-margin))),
                               rtol=1e-5)
    np.testing.assert_allclose(float(stats["reward_accuracy"]), np.sum(margin > 0))


def test_reward_model_loss_reads_the_last_token():
    rng = np.random.default_rng(5)
    values = rng.normal(size=(4, 7)).astype(np.float32)
    segment_ids = np.array([[0, 1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1, 1],
                            [0, 0, 1, 1, 1, 1, 0], [0, 1, 1, 1, 0, 0, 0]], np.int32)
    loss_sum, weight, stats = jax.jit(rw.reward_loss)(InferenceOutput(values_bt=values),
                                                      {"segment_ids_bt": segment_ids})
    last = values[[0, 1, 2, 3], [4, 6, 5, 3]].astype(np.float64)
    margin = last[:2] - last[2:]
    assert float(weight) == 2
    np.testing.assert_allclose(float(loss_sum), np.sum(np.log1p(np.exp(-margin))), rtol=1e-5)
    np.testing.assert_allclose(float(stats["margin"]), margin.sum(), rtol=1e-5)


@pytest.mark.parametrize("k", [1, 2, 3, 6])
def test_strided_splits_keep_pairs_when_k_divides_the_pairs(k):
    num_pairs = 6
    row_ids = np.arange(2 * num_pairs)  # pair i is rows i and num_pairs + i
    micro_kb = np.asarray(split({"x": jnp.asarray(row_ids)}, k)["x"])
    for micro in micro_kb:
        chosen, rejected = pairs.split_pairs(jnp.asarray(micro))
        np.testing.assert_array_equal(np.asarray(rejected), np.asarray(chosen) + num_pairs)
    pairs.check_pair_split(num_pairs, k, "micro")


def test_splits_that_would_separate_pairs_are_rejected():
    with pytest.raises(ValueError, match="must divide the 3 preference pairs"):
        pairs.check_pair_split(3, 2, "micro_batches")
    with pytest.raises(ValueError, match="even number of rows"):
        pairs.split_pairs(jnp.zeros(5))


def test_preference_batch_is_chosen_then_rejected():
    tokenizer = load_tokenizer("byte")
    rows = [PreferenceRow("12>", "21", "12"), PreferenceRow("345>", "543", "3x5")]
    batch = encode.preference_batch(rows, tokenizer, 6, 5)
    decode = lambda i: tokenizer.decode(
        [t for t, m in zip(batch["seq_tokens_bs"][i], batch["seq_mask_bs"][i]) if m])
    texts = [decode(i) for i in range(4)]
    eos = tokenizer.decode([tokenizer.eos_id])
    assert texts == [f"12>21{eos}", f"345>543{eos}", f"12>12{eos}", f"345>3x5{eos}"]
    assert batch["response_mask_bn"].sum(1).tolist() == [3, 4, 3, 4]


def test_built_in_preferences_hold_out_unseen_pairs(tmp_path):
    config = tiny_config("dpo")
    config.data.preference_holdout = 50
    spec = spec_lib.run_spec(config)
    train, held_out = sources.read_pairs(spec.data, tmp_path, spec.rollout.batch_size, "dpo")
    assert len(held_out) == 50 and len(train) == config.data.task.num_train - 50
    assert not {r.prompt for r in held_out} & {r.prompt for r in train}
    assert all(r.chosen == r.prompt[:-1][::-1] for r in held_out)


def test_contains_nine_cost():
    assert costs.contains_nine("1293>", "3921", "3921") == 1.0
    assert costs.contains_nine("1283>", "3821", "3821") == 0.0
    assert costs.contains_nine("1283>", "3821\n9", None) == 0.0  # only the answer line counts
