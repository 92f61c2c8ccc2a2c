"""Packing (engine/packing.py): the plan places every token once, per data-parallel shard and
balanced; and for every algorithm's loss, the train step's packed forward gives the losses,
stats, gradients and log-probs of the unpacked batch (within 1e-5) on mixed lengths."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrlhf.algorithms import dapo, dpo, grpo, gspo, losses, ppo, reinforce, remax, rw, sft
from jaxrlhf.mfc import Call
from jaxrlhf.parallel.strategy import DeviceRange
from jaxrlhf.plan.choice import CallChoice
from jaxrlhf.plan.cluster import Cluster
from jaxrlhf.plan.cost import inference_cost, train_cost
from jaxrlhf.plan.experiment import Workload
from jaxrlhf.plan.memory import call_memory
from jaxrlhf.plan.profile import profile_of
from jaxrlhf.engine import packing
from jaxrlhf.engine import train_step as ts
from jaxrlhf.engine.inference import InferenceBatch, infer, infer_packed
from jaxrlhf.mfc import Role
from jaxrlhf.models.config import HeadKind
from jaxrlhf.models.sizes import get_size
from jaxrlhf.models.transformer import Transformer

# One layer, small dims: each case compiles one step; the packing is what is under test.
MODEL = get_size("tiny", hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2,
                 num_kv_heads=1, dtype=jnp.float32)
PROMPT, NEW = 6, 18  # [b, 24] rows: left-padded prompts of 2..6 tokens, responses of 1..18
RESPONSES = (18, 1, 3, 12, 2, 5, 18, 4)
PROMPTS = (6, 2, 4, 3, 6, 5, 2, 3)


def _segment_ids(prompts, responses, width=PROMPT + NEW, prompt=PROMPT):
    cols = np.arange(width)[None]
    return ((cols >= prompt - np.asarray(prompts)[:, None])
            & (cols < prompt + np.asarray(responses)[:, None])).astype(np.int32)


def test_plan_places_every_token_once_on_its_own_shard():
    rng = np.random.default_rng(0)
    b, width, micro, shards = 32, 40, 2, 2
    prompts = rng.integers(1, 9, b)
    responses = np.clip(np.exp(rng.normal(np.log(8), 1.0, b)), 1, 32).astype(int)  # long tail
    seg_bt = _segment_ids(prompts, responses, width, 8)
    plan = packing.plan(seg_bt, micro, shards, packing.Rows.PACKED)
    rows = plan.rows
    assert rows % shards == 0 and rows < b // micro  # fewer rows than the padded ones
    per_block = b // micro // shards
    for j in range(micro):
        seg_local = seg_bt[j::micro]
        for d in range(shards):
            block = slice(d * rows // shards, (d + 1) * rows // shards)
            gather, packed_seg = plan.gather_mrt[j, block], plan.segment_ids_mrt[j, block]
            scatter = plan.scatter_mbt[j, d * per_block:(d + 1) * per_block]
            real = seg_local[d * per_block:(d + 1) * per_block] != 0
            # every real token of the shard's rows sits in exactly one packed slot, and back
            taken = np.sort(gather[packed_seg != 0])
            np.testing.assert_array_equal(taken, np.flatnonzero(real.reshape(-1)))
            np.testing.assert_array_equal(gather.reshape(-1)[scatter[real]],
                                          np.flatnonzero(real.reshape(-1)))
            # a sequence is one run of one segment id, and ids differ within a row
            for row_ids in packed_seg:
                runs = row_ids[row_ids != 0]
                assert (np.diff(runs) >= 0).all()
    identity = packing.plan(seg_bt, micro, shards, packing.Rows.PADDED)
    assert identity.rows == b // micro
    np.testing.assert_array_equal(identity.segment_ids_mrt != 0,
                                  np.stack([seg_bt[j::micro] != 0 for j in range(micro)]))


def test_spans_and_row_ladder():
    seg = np.array([[0, 1, 1, 2, 2, 0], [3, 3, 3, 3, 3, 3], [0, 0, 0, 0, 0, 0]])
    spans = packing.sequence_spans(seg)
    assert spans.row_n.tolist() == [0, 0, 1] and spans.start_n.tolist() == [1, 3, 0]
    assert spans.length_n.tolist() == [2, 2, 6]
    assert [packing.row_buckets(n, 1) for n in (1, 2, 3, 4, 5, 7, 9, 13, 17, 33)] == \
        [1, 2, 3, 4, 5, 7, 10, 14, 20, 40]
    assert packing.row_buckets(5, 4) == 8


def _rl_buffer(rng):
    b = len(RESPONSES)
    seg = _segment_ids(PROMPTS, RESPONSES)
    mask_bn = seg[:, PROMPT:].astype(np.float32)
    f32 = lambda *shape: rng.normal(size=shape).astype(np.float32)
    return {
        "seq_tokens_bs": np.where(seg, rng.integers(1, MODEL.vocab_size, seg.shape), 0
                                  ).astype(np.int32),
        "seq_mask_bs": seg.astype(np.float32), "response_mask_bn": mask_bn,
        "behav_logp_bn": -np.abs(f32(b, NEW)) - 5.0, "ref_logp_bn": -np.abs(f32(b, NEW)) - 5.0,
        "scores_b": rng.normal(size=b).astype(np.float32), "values_bn": f32(b, NEW),
        "greedy_scores_b": rng.normal(size=b).astype(np.float32),
    }


def _case(name):
    """(model config, TrainSpec) of one algorithm's trained model."""
    b = len(RESPONSES)
    entropy = losses.PPOLossConfig(entropy_coef=0.01)
    match name:
        case "grpo":
            cfg = grpo.GRPOConfig(group_size=2, temperature=0.7, loss=losses.GRPOLossConfig(
                losses.PPOLossConfig(entropy_coef=0.01,
                                     aggregation=losses.LossAggregation.SEQ_MEAN_TOKEN_MEAN)))
            alg = grpo.make(cfg, reward_model=False)
        case "ppo_actor" | "ppo_critic":
            alg = ppo.make(ppo.PPOConfig(kl_in_reward=False, policy=entropy), reward_model=False,
                           batch_size=b)
        case "remax":
            alg = remax.make(remax.ReMaxConfig(policy=entropy), reward_model=False, batch_size=b)
        case "dapo":
            alg = dapo.make(dapo.DAPOConfig(group_size=2, temperature=0.8), reward_model=False)
        case "gspo":
            alg = gspo.make(gspo.GSPOConfig(grpo.GRPOConfig(group_size=2)), reward_model=False)
        case "reinforce":
            alg = reinforce.make(reinforce.ReinforceConfig(reinforce.Baseline.LEAVE_ONE_OUT,
                                                           group_size=2, policy=entropy),
                                 reward_model=False, batch_size=b)
        case "sft":
            alg = sft.make()
        case "dpo":
            alg = dpo.make(dpo.DPOConfig())
        case "rw":
            alg = rw.make()
    role = {"ppo_critic": Role.CRITIC, "rw": Role.REWARD}.get(name, Role.ACTOR)
    scalar = role is not Role.ACTOR
    model = MODEL.replace(head=HeadKind.SCALAR) if scalar else MODEL
    return model, alg, alg.train[role]


def _params(model):
    tokens = jnp.zeros((1, 1), jnp.int32)
    params = nn.unbox(Transformer(model).init(jax.random.key(0), tokens, tokens, tokens + 1))
    params = params["params"]
    if "score" in params:  # a zero head would make every other gradient zero
        params["score"] = 0.5 * jax.random.normal(jax.random.key(1), params["score"].shape)
    return params


# One compiled program per head: every algorithm's loss and gradient, packed and unpacked.
HEADS = {"lm": ["grpo", "ppo_actor", "remax", "dapo", "gspo", "reinforce", "sft", "dpo"],
         "scalar": ["ppo_critic", "rw"]}


@pytest.mark.parametrize("head", list(HEADS))
def test_packed_equals_unpacked_for_every_algorithm(head):
    cases = {name: _case(name) for name in HEADS[head]}
    model_cfg = next(iter(cases.values()))[0]
    model, params = Transformer(model_cfg), _params(model_cfg)
    rng = np.random.default_rng(1)
    buf = _rl_buffer(rng)
    batches, plans = {}, {}
    for name, (_, alg, train) in cases.items():
        controller = jax.tree.map(jnp.float32, alg.controller_init)
        batches[name], _ = jax.jit(train.prepare)(buf, controller)
        plan = packing.plan(np.asarray(batches[name]["segment_ids_bt"]), 1, 1,
                            packing.Rows.PACKED)
        assert plan.rows == 4  # 94 tokens in 8 padded rows of 24 slots: 4 packed rows
        plans[name] = plan

    @jax.jit
    def run(params, batches, plans):
        results = {}
        for name, (_, _, train) in cases.items():
            batch = batches[name]
            readout = train.readout or ts.default_readout(model_cfg)
            inputs = InferenceBatch(*(batch[k] for k in ts.MODEL_INPUT_KEYS))

            def loss(p, packed, train=train, batch=batch, readout=readout, inputs=inputs,
                     plan=plans[name]):
                out = (infer_packed(model, readout, 1, p, inputs, plan) if packed
                       else infer(model, readout, p, inputs))
                loss_sum, weight, stats = train.loss_fn(out, batch)
                return loss_sum, (weight, stats, out)

            results[name] = [jax.value_and_grad(loss, has_aux=True)(params, packed)
                             for packed in (False, True)]
        return results

    for name, (((ref_loss, ref_aux), ref_grads), ((loss, aux), grads)) in run(
            params, batches, plans).items():
        _assert_same(name, ref_loss, ref_aux, ref_grads, loss, aux, grads)


def _assert_same(name, ref_loss, ref_aux, ref_grads, loss, aux, grads):
    """The optimised loss (Σloss / Σweight), stats, per-token readout and gradients of the
    packed forward equal the unpacked one's."""
    weight = float(ref_aux[0])
    assert np.isfinite(float(ref_loss)) and weight > 0, name
    assert float(aux[0]) == weight, name  # token or sequence counts
    np.testing.assert_allclose(loss / weight, ref_loss / weight, rtol=0, atol=1e-5,
                               err_msg=name)
    for key in ref_aux[1]:
        np.testing.assert_allclose(aux[1][key] / weight, ref_aux[1][key] / weight, rtol=0,
                                   atol=1e-5, err_msg=f"{name} {key}")
    for got, want in zip(aux[2], ref_aux[2]):  # log-probs, entropies or values per token
        if want is not None:
            assert np.any(np.asarray(want) != 0), name
            np.testing.assert_allclose(got, want, rtol=0, atol=1e-5, err_msg=name)
    flat = jax.tree.leaves(ref_grads)
    assert max(float(jnp.max(jnp.abs(g))) for g in flat) / weight > 1e-3, name
    for got, want in zip(jax.tree.leaves(grads), flat):
        np.testing.assert_allclose(got / weight, want / weight, rtol=0, atol=1e-5, err_msg=name)


def test_planner_counts_packed_tokens():
    """Train steps and inference are priced on the sequences' tokens in whole packed rows:
    prompts of 64 and responses of mean 64 in rows of 512 cost a quarter of the padded rows'
    work."""
    profile = profile_of(get_size("small"))
    choice = CallChoice(DeviceRange(0, 1), data=2)
    cluster = _CLUSTER
    padded = Workload(batch_size=64, prompt_len=64, new_tokens=448)
    packed = Workload(batch_size=64, prompt_len=64, new_tokens=448, mean_new_tokens=64.0)
    assert packed.packed_tokens_per_device(Call.TRAIN_STEP, 2, 1) == 8 * 512  # 32 x 128 tokens
    assert padded.packed_tokens_per_device(Call.TRAIN_STEP, 2, 1) == 32 * 512
    for cost in (lambda w: train_cost(profile, w, choice, cluster, False),
                 lambda w: inference_cost(profile, w, choice, cluster)):
        assert cost(packed).compute == pytest.approx(cost(padded).compute / 4)
    for call in (Call.TRAIN_STEP, Call.INFERENCE):
        full, small = (call_memory(profile, call, w, choice).activations
                       for w in (padded, packed))
        assert small == pytest.approx(full / 4, rel=0.01)


_CLUSTER = Cluster(
    name="test_1x2", hosts=1, devices_per_host=2, hbm_bytes=10**9, peak_bf16_flops=1e12,
    hbm_bandwidth=1e11, intra_host_bandwidth=1e10, inter_host_bandwidth=1e9,
    host_link_bandwidth=5e8, matmul_efficiency=0.5, hbm_efficiency=0.5, comm_efficiency=0.5)


def _plan_seconds(expected_new_tokens: float) -> dict[str, float]:
    """The planner's seconds for the default (PPO) config's train and inference calls, and its
    step's, every MFC on two data-parallel devices, with responses of that expected mean
    length (of at most 448)."""
    from jaxrlhf.plan.choice import ExecutionPlan
    from jaxrlhf.plan.evaluate import Evaluator
    from jaxrlhf.schema import base_config
    from jaxrlhf.spec import run_spec

    config = base_config()
    config.rollout.update(batch_size=64, max_prompt_len=64, max_new_tokens=448,
                          expected_new_tokens=expected_new_tokens)
    experiment = run_spec(config).experiment()
    evaluator = Evaluator(experiment, _CLUSTER)
    choice = CallChoice(DeviceRange(0, 1), data=2)
    device_mfcs = [m.name for m in experiment.graph.mfcs if not m.host]
    seconds = {name: evaluator.mfc_seconds(name, choice) for name in device_mfcs
               if experiment.graph.mfc(name).call is not Call.GENERATE}
    plan = ExecutionPlan.of({name: choice for name in device_mfcs})
    seconds["step"] = evaluator.evaluate(plan).step_seconds
    return seconds


def test_expected_new_tokens_prices_packed_calls():
    """`rollout.expected_new_tokens` reaches the planner: the train steps and inference calls of
    responses expected at 64 of 448 tokens cost well under half of those at the limit, and so
    does less of the step."""
    at_limit, unset, short = (_plan_seconds(n) for n in (448.0, 0.0, 64.0))
    assert at_limit == unset  # 0 means max_new_tokens
    assert {"actor_train", "critic_train", "ref_inf", "critic_inf"} <= set(at_limit)
    for name, seconds in at_limit.items():
        if name != "step":
            assert short[name] < 0.5 * seconds, name
    assert short["step"] < at_limit["step"]


def _tail_segments(seed: int, rows: int, width: int = 1024) -> np.ndarray:
    """[rows, width] right-padded rows, lengths lognormal (median 64) clipped to [4, 1024]:
    the rollout benchmark's long tail."""
    rng = np.random.default_rng(seed)
    lengths = np.clip(np.exp(rng.normal(np.log(64), 1.0, rows)), 4, 1024).astype(int)
    return (np.arange(width)[None] < lengths[:, None]).astype(np.int32)


@pytest.mark.parametrize("micro,shards", [(1, 4), (2, 4), (1, 8)])
def test_spread_plan_balances_the_ranks_tokens(micro, shards):
    """On long-tailed lengths each shard packing its own rows leaves the fullest rank with
    1.1-1.9x the mean tokens; dealt longest first, every rank is within 2% of the mean and the
    packed rows (what every rank computes) shrink. Every token is placed once, and back."""
    for seed in range(3):
        seg_bt = _tail_segments(seed, 64)
        own = packing.plan(seg_bt, micro, shards, packing.Rows.PACKED)
        spread = packing.plan(seg_bt, micro, shards, packing.Rows.PACKED, spread=True)
        assert spread.rows == packing.spread_rows(seg_bt, micro, shards) <= own.rows
        own_md, spread_md = (packing.shard_tokens(p, shards) for p in (own, spread))
        np.testing.assert_array_equal(own_md.sum(1), spread_md.sum(1))
        imbalance = lambda t_md: float(np.max(t_md.max(1) / t_md.mean(1)))
        assert imbalance(own_md) > 1.1 and imbalance(spread_md) < 1.02, seed
        for j in range(micro):
            real = seg_bt[j::micro] != 0
            gather, packed_seg = spread.gather_mrt[j], spread.segment_ids_mrt[j]
            np.testing.assert_array_equal(np.sort(gather[packed_seg != 0]),
                                          np.flatnonzero(real.reshape(-1)))
            np.testing.assert_array_equal(gather.reshape(-1)[spread.scatter_mbt[j][real]],
                                          np.flatnonzero(real.reshape(-1)))


@pytest.mark.slow  # two compiles, ~10 s on quiet cores (90 s at load 20)
@pytest.mark.devices(2)
def test_spread_train_step_equals_padded():
    """A train step on two data-parallel devices whose shards' own rows would need 8 packed
    rows takes the spread plan (6) and updates as the padded rows do (within 1e-5)."""
    from tests.unit.test_token_microbatch import _batch, sequence_nll

    from jaxrlhf.engine import optimizer as opt
    from jaxrlhf.parallel.layout import make_layout

    model_cfg = MODEL
    layout = make_layout("0-1:d2", model=model_cfg)
    optimizer = opt.OptimizerConfig(lr=1e-3, warmup_steps=0, total_steps=4, eps=1e-6)
    params = jax.tree.map(np.asarray, _params(model_cfg))
    batch = _batch(6, rows=16)
    steps = {rows: ts.make_train_step(model_cfg, layout, sequence_nll, optimizer, rows=rows)
             for rows in packing.Rows}
    count, plan, spread = steps[packing.Rows.PACKED]._planned(batch)
    assert spread and (count, plan.rows) == (1, 6)
    assert packing.plan(batch["segment_ids_bt"], 1, 2, packing.Rows.PACKED).rows == 8
    out = {}
    for rows, step in steps.items():
        state, metrics = step(ts.create_train_state(params, model_cfg, layout, optimizer), batch)
        out[rows] = jax.device_get((metrics, state.params))
    (got, got_params), (want, want_params) = out[packing.Rows.PACKED], out[packing.Rows.PADDED]
    for key in ("loss", "grad_norm", "num_tokens", "weight"):
        np.testing.assert_allclose(got[key], want[key], rtol=1e-5, err_msg=key)
    for g, w in zip(jax.tree.leaves(got_params), jax.tree.leaves(want_params)):
        np.testing.assert_allclose(g, w, rtol=0, atol=1e-5)


@pytest.mark.devices(2)
def test_spread_inference_equals_padded():
    """Inference on two data-parallel devices, long-tailed lengths: each shard packing its own
    rows needs 8 packed rows, the fuller rank holding 1.42x the mean tokens; the call deals the
    sequences over the shards instead (6 rows, both ranks within 2% of the mean) and gives the
    padded rows' log-probs and entropies (within 1e-5)."""
    from tests.unit.test_token_microbatch import _batch

    from jaxrlhf.engine.inference import InferenceConfig, InferenceKind, make_inference_fn
    from jaxrlhf.parallel.layout import make_layout

    layout = make_layout("0-1:d2", model=MODEL)
    b = _batch(6, rows=16)
    seg_bt = b["segment_ids_bt"]
    cfg = InferenceConfig(InferenceKind.LOGPROBS, temperature=0.7, with_entropy=True)
    calls = {rows: make_inference_fn(MODEL, cfg, layout, length_buckets=(seg_bt.shape[1],),
                                     rows=rows) for rows in packing.Rows}
    own = packing.plan(seg_bt, 1, 2, packing.Rows.PACKED)
    plan, spread = calls[packing.Rows.PACKED]._plan(seg_bt)
    assert spread and (own.rows, plan.rows) == (8, 6)
    imbalance = lambda p: float(np.max(packing.shard_tokens(p, 2).max(1)
                                       / packing.shard_tokens(p, 2).mean(1)))
    assert imbalance(own) > 1.4 and imbalance(jax.device_get(plan)) < 1.02
    params = _params(MODEL)
    batch = InferenceBatch(b["tokens_bt"], b["positions_bt"], seg_bt)
    got, want = (jax.device_get(calls[rows](params, batch)) for rows in packing.Rows)
    np.testing.assert_allclose(got.logprobs_bt, want.logprobs_bt, rtol=0, atol=1e-5)
    np.testing.assert_allclose(got.entropy_bt, want.entropy_bt, rtol=0, atol=1e-5)
    assert calls[packing.Rows.PACKED].compile_cache.compiles == 1
