"""Routing replay (engine/replay.py, algorithms/routing.py): the rollout engine records every
token's experts, the log-prob and train calls use exactly those when replaying, and
`routing_mismatch` counts the tokens whose fresh choice differs."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrlhf.algorithms.routing import Routing, routes_key
from jaxrlhf.engine import optimizer as opt
from jaxrlhf.engine import packing, replay
from jaxrlhf.engine import train_step as ts
from jaxrlhf.engine.generate import GenerateConfig, make_generate_fn
from jaxrlhf.engine.inference import (
    InferenceBatch, InferenceConfig, InferenceKind, make_inference_fn,
)
from jaxrlhf.models.sizes import get_size
from jaxrlhf.models.transformer import Transformer
from jaxrlhf.parallel.layout import make_layout
from jaxrlhf.schema import ConfigError
from jaxrlhf.spec import run_spec

PROMPT, NEW = 8, 8


def _params(cfg):
    ones = jnp.ones((1, 4), jnp.int32)
    return nn.meta.unbox(Transformer(cfg).init(jax.random.key(0), ones, ones, ones)["params"])


def _rollout(cfg, rows: int, prompt: int, new: int, micro_batches: int = 1, spec="0-0:d1"):
    """(layout, params, host prompts' mask, the generate call's output) of `rows` random
    prompts, the first left-padded by 3; `micro_batches` > 1: rows queue for rows/k slots,
    looked at every 4 tokens (the scheduler's fills into busy states)."""
    layout = make_layout(spec, model=cfg)
    params = _params(cfg)
    gen = make_generate_fn(cfg, GenerateConfig(max_new_tokens=new, eos_token_id=1,
                                               pad_token_id=0), layout, prompt_buckets=[prompt],
                           chunk_tokens=4 if micro_batches > 1 else 32)
    rng = np.random.default_rng(0)
    tokens_bp = rng.integers(2, cfg.vocab_size, (rows, prompt)).astype(np.int32)
    mask_bp = np.ones((rows, prompt), bool)
    mask_bp[0, :3] = False
    return layout, params, mask_bp, gen(params, tokens_bp, mask_bp, jax.random.key(1),
                                        micro_batches=micro_batches)


def _sequences(mask_bp, out):
    seq_mask_bs = np.concatenate([mask_bp, np.asarray(out.response_mask_bn)], axis=1)
    return np.asarray(out.sequences_bs), seq_mask_bs


def _fresh_routes(cfg, params, seq_bs, seq_mask_bs, routes_lbtk=None):
    """(logits, the experts a full forward's layers used [b, s, L, k]; traceable)."""
    positions_bs = np.maximum(np.cumsum(seq_mask_bs, axis=1) - 1, 0)
    (logits, _), sown = Transformer(cfg).apply(
        {"params": params}, seq_bs, positions_bs, seq_mask_bs.astype(np.int32),
        routes_lbtk=routes_lbtk, mutable=["intermediates"])
    return logits, replay.sown_routes(sown, jnp.int32)


@pytest.fixture(scope="module")
def fp32_rollout():
    cfg = get_size("tiny-moe", dtype=jnp.float32)
    return cfg, *_rollout(cfg, 4, PROMPT, NEW)


@pytest.mark.slow  # ~30 s each: an MoE model's generation compiles (cheaper sibling: below)
@pytest.mark.devices(4)
@pytest.mark.parametrize("how", ["at_once", "scheduled"])
def test_engine_records_each_tokens_experts(fp32_rollout, how):
    """Prompt tokens' experts from the prefill, each response token's from the step that fed
    it; in fp32 what a full forward over the rows chooses. NO_ROUTE on prompt padding and on
    each row's last token (never fed back) and after it. In one executable, or scheduled:
    12 rows through 4 slots on d2t2 (the prompts' routes written by the routed SPMD fill),
    each slot refilled as its row finishes (a fill into a busy state)."""
    if how == "at_once":
        cfg, _, params, mask_bp, out = fp32_rollout
    else:
        cfg = fp32_rollout[0]
        _, params, mask_bp, out = _rollout(cfg, 12, PROMPT, NEW, micro_batches=3,
                                           spec="0-3:d2t2")
    rows = len(mask_bp)
    routes_bslk = np.asarray(out.routes_bslk)
    assert routes_bslk.dtype == np.int8 and routes_bslk.shape == (rows, PROMPT + NEW, 2, 2)
    seq_bs, seq_mask_bs = _sequences(mask_bp, out)
    lengths_b = np.asarray(out.response_mask_bn).sum(1)
    fed_bs = seq_mask_bs.copy()
    fed_bs[np.arange(rows), PROMPT + lengths_b - 1] = False  # each row's last token
    _assert_fed_tokens_carry_their_routes(cfg, params, seq_bs, seq_mask_bs, fed_bs, routes_bslk)


def _assert_fed_tokens_carry_their_routes(cfg, params, seq_bs, seq_mask_bs, fed_bs, routes_bslk):
    """Exactly the tokens fed to the model ([b, s] `fed_bs`) have recorded routes [b, s, L, k],
    and each equals the experts a full forward of the sequences picks (as a set)."""
    recorded_bsl = routes_bslk[..., 0] >= 0
    np.testing.assert_array_equal(recorded_bsl, np.broadcast_to(fed_bs[..., None],
                                                                recorded_bsl.shape))
    fresh_bslk = np.asarray(_fresh_routes(cfg, params, seq_bs, seq_mask_bs)[1])
    same_bsl = np.all(np.sort(fresh_bslk, -1) == np.sort(routes_bslk, -1), axis=-1)
    assert same_bsl[fed_bs].all()


def _rotated(routes_bslk, num_experts: int):
    """Every recorded expert id e replaced by e + 1 (mod E): a different set for every token."""
    return np.where(routes_bslk >= 0, (routes_bslk + 1) % num_experts, routes_bslk).astype(
        routes_bslk.dtype)


@pytest.mark.slow  # ~10 s beyond the rollout's
def test_replay_uses_the_recorded_experts(fp32_rollout):
    """Given other routes than the router's (each id shifted by one), a replaying log-prob
    call computes what a forward on exactly those experts computes, and counts every
    recorded token as changed; without replay it computes the fresh forward."""
    cfg, layout, params, mask_bp, out = fp32_rollout
    seq_bs, seq_mask_bs = _sequences(mask_bp, out)
    routes_bslk = _rotated(np.asarray(out.routes_bslk), cfg.moe.num_experts)
    batch = InferenceBatch.padded(seq_bs, seq_mask_bs)
    logp = {}
    for on in (True, False):
        call = make_inference_fn(cfg, InferenceConfig(InferenceKind.LOGPROBS, replay_routing=on),
                                 layout, length_buckets=[PROMPT + NEW])
        got = call(params, batch, routes_bslk)
        logp[on] = np.asarray(got.logprobs_bt)
        recorded = np.sum((routes_bslk[..., 0, 0] >= 0) & seq_mask_bs)
        np.testing.assert_array_equal(np.asarray(got.routes_changed), [recorded, recorded])
    logits, used_bslk = _fresh_routes(cfg, params, seq_bs, seq_mask_bs,
                                      replay.model_routes(routes_bslk))
    recorded_bs = routes_bslk[..., 0, 0] >= 0
    np.testing.assert_array_equal(np.asarray(used_bslk)[recorded_bs], routes_bslk[recorded_bs])
    want = jax.nn.log_softmax(logits, -1)[:, :-1]
    want_bs = np.take_along_axis(np.asarray(want), seq_bs[:, 1:, None], -1)[..., 0]
    scored = seq_mask_bs[:, 1:] & seq_mask_bs[:, :-1]
    np.testing.assert_allclose(logp[True][:, 1:][scored], want_bs[scored], atol=2e-5)
    assert np.abs(logp[False][:, 1:] - want_bs)[scored].max() > 1e-2  # the routes matter


def test_replay_uses_the_given_experts():
    """The default suite's sibling of the two above, without a rollout: random rows and
    expert ids (NO_ROUTE on some tokens) given to a replaying log-prob call, which computes
    what a forward on exactly those experts computes (the router's own where none is given)."""
    cfg = get_size("tiny-moe", dtype=jnp.float32)
    layout, params = make_layout("0-0:d1", model=cfg), _params(cfg)
    rng = np.random.default_rng(1)
    seq_bs = rng.integers(2, cfg.vocab_size, (4, 12)).astype(np.int32)
    seq_mask_bs = np.arange(12)[None] < np.array([[12], [7], [9], [12]])
    ids_bslk = np.stack([rng.permutation(cfg.moe.num_experts)[:2] for _ in range(4 * 12 * 2)])
    routes_bslk = ids_bslk.reshape(4, 12, 2, 2).astype(np.int8)
    routes_bslk[:, 5] = replay.NO_ROUTE
    call = make_inference_fn(cfg, InferenceConfig(InferenceKind.LOGPROBS, replay_routing=True),
                             layout, length_buckets=[12])
    got = call(params, InferenceBatch.padded(seq_bs, seq_mask_bs), routes_bslk)
    forward = jax.jit(lambda r: _fresh_routes(cfg, params, seq_bs, seq_mask_bs, r))
    logits, used_bslk = forward(replay.model_routes(routes_bslk))
    given_bs = routes_bslk[..., 0, 0] >= 0
    np.testing.assert_array_equal(np.asarray(used_bslk)[given_bs], routes_bslk[given_bs])
    want = np.take_along_axis(np.asarray(jax.nn.log_softmax(logits, -1))[:, :-1],
                              seq_bs[:, 1:, None], -1)[..., 0]
    scored = seq_mask_bs[:, 1:]
    logp = np.asarray(got.logprobs_bt)[:, 1:]
    np.testing.assert_allclose(logp[scored], want[scored], atol=2e-5)
    # Random ids: nearly every token's differ from the router's own choice.
    assert float(replay.mismatch(got.routes_changed)) > 0.9


def test_routes_pack_as_every_per_token_array():
    rng = np.random.default_rng(0)
    routes_btlk = rng.integers(-1, 8, (4, 6, 3, 2)).astype(np.int8)
    segment_ids_bt = (np.arange(6)[None] < np.array([[6], [2], [3], [4]])).astype(np.int32)
    plan = packing.plan(segment_ids_bt, 1, 2, packing.Rows.PACKED)
    gather_rt = jnp.asarray(plan.gather_mrt[0])
    got = np.asarray(packing.pack(jnp.asarray(routes_btlk), gather_rt, 2))
    for layer in range(3):
        for j in range(2):
            want = packing.pack(jnp.asarray(routes_btlk[..., layer, j]), gather_rt, 2)
            np.testing.assert_array_equal(got[..., layer, j], np.asarray(want))


def test_replay_routing_config():
    """auto: replay for an RL run of a model with experts, synchronous or asynchronous, single-
    or multi-turn, nothing for a dense one; off: recorded only; on where impossible, and bad values: one line naming the key."""
    from jaxrlhf.configs import grpo_moe_tiny, grpo_tiny

    spec = run_spec(grpo_moe_tiny.get_config("smoke"))
    assert spec.routing is Routing.REPLAY
    key = routes_key("seq_tokens_bs")
    readers = sorted(m.name for m in spec.algorithm.mfcs if key in m.inputs)
    assert readers == ["actor_train", "ref_inf"]
    assert run_spec(grpo_tiny.get_config("smoke")).routing is Routing.NONE
    config = grpo_moe_tiny.get_config("smoke")
    config.models.actor.moe.replay_routing = "off"
    assert run_spec(config).routing is Routing.RECORD
    bad = [("actor", "yes", "models.actor.moe.replay_routing='yes' is not one of"),
           ("ref", "on", "models.ref.moe.replay_routing='on': only the actor's")]
    for role, value, message in bad:
        config = grpo_moe_tiny.get_config("smoke")
        config.models[role].moe.replay_routing = value
        with pytest.raises(ConfigError, match=message):
            run_spec(config)
    config = grpo_moe_tiny.get_config("smoke")  # asynchronous RL: its worker's rows carry them
    config.async_rl.max_staleness = 1
    for mode in ("auto", "on"):
        config.models.actor.moe.replay_routing = mode
        spec = run_spec(config)
        assert spec.routing is Routing.REPLAY
        (gen,) = (m for m in spec.algorithm.mfcs if m.name == "actor_gen")
        assert gen.outputs[-1] == key
    config = grpo_moe_tiny.get_config("smoke")  # multi-turn: its trajectories carry them
    config.env.name = "tools"
    spec = run_spec(config)
    assert spec.routing is Routing.REPLAY
    readers = sorted(m.name for m in spec.algorithm.mfcs if key in m.inputs)
    assert readers == ["actor_train", "ref_inf"]
    config = grpo_tiny.get_config("smoke")
    config.models.actor.moe.replay_routing = "on"
    with pytest.raises(ConfigError, match="the actor has no experts"):
        run_spec(config)


@pytest.mark.slow  # ~25 s each: an MoE train step's compile
@pytest.mark.parametrize("on", [True, False])
def test_train_step_replays_the_batchs_routes(fp32_rollout, on):
    """The train step's loss is the cross-entropy of a forward on the batch's recorded
    experts (shifted ids here) when replaying, else on the router's own; routing_mismatch
    counts every token as changed either way."""
    cfg, layout, params, mask_bp, out = fp32_rollout
    cfg = cfg.replace(moe=cfg.moe.replace(aux_loss_coef=0.0, z_loss_coef=0.0))
    seq_bs, seq_mask_bs = _sequences(mask_bp, out)
    routes_bslk = _rotated(np.asarray(out.routes_bslk), cfg.moe.num_experts)
    targets_bs = np.roll(seq_bs, -1, axis=1)
    loss_mask_bs = seq_mask_bs & np.roll(seq_mask_bs, -1, axis=1)
    loss_mask_bs[:, -1] = False
    batch = {"tokens_bt": seq_bs, "positions_bt": np.maximum(np.cumsum(seq_mask_bs, 1) - 1, 0),
             "segment_ids_bt": seq_mask_bs.astype(np.int32), "targets_bt": targets_bs,
             "loss_mask_bt": loss_mask_bs, ts.ROUTES_KEY: routes_bslk}

    def token_ce(out, batch):
        next_logp_bt = jnp.roll(out.logprobs_bt, -1, axis=1)
        mask_bt = batch["loss_mask_bt"].astype(jnp.float32)
        return -jnp.sum(next_logp_bt * mask_bt), jnp.sum(mask_bt), {}

    logits, _ = _fresh_routes(cfg, params, seq_bs, seq_mask_bs,
                              replay.model_routes(routes_bslk) if on else None)
    optimizer = opt.OptimizerConfig(lr=0.0, warmup_steps=0, total_steps=2)
    readout = InferenceConfig(InferenceKind.LOGPROBS, replay_routing=on)
    step = ts.make_train_step(cfg, layout, token_ce, optimizer, readout=readout)
    own = jax.tree.map(jnp.copy, params)  # the step donates its state's
    _, metrics = step(ts.create_train_state(own, cfg, layout, optimizer), batch)
    nll_bs = -np.take_along_axis(np.asarray(jax.nn.log_softmax(logits, -1)),
                                 targets_bs[..., None], -1)[..., 0]
    np.testing.assert_allclose(float(metrics["loss"]), nll_bs[loss_mask_bs].mean(), rtol=1e-5)
    np.testing.assert_allclose(float(metrics["routing_mismatch"]), 1.0)


@pytest.mark.slow  # ~60 s: two models' generation and log-prob calls in bf16, 3 seeds
def test_replay_keeps_an_moe_models_logprob_gap_within_a_dense_ones():
    """bf16, 3 seeds of 16 rows of 16 + 24 tokens: the rollout's behaviour log-probs against
    the log-prob call's, over the response tokens. Routing afresh, some tokens flip experts
    (routing_mismatch > 0) and their gaps stand out beyond any of the dense model's of the
    same shapes; replayed, the MoE's mean gap is no larger than the dense model's and its
    largest under half the unreplayed one. Measured (max / mean): MoE afresh 0.0199 / 0.00066,
    replayed 0.0039 / 0.00060, dense 0.0029 / 0.00069; 1, 5 and 3 of 621 tokens flipped."""
    moe_cfg = get_size("tiny-moe", dtype=jnp.bfloat16)
    gaps = {"dense": [], ("moe", False): [], ("moe", True): []}
    for name, cfg in (("moe", moe_cfg), ("dense", moe_cfg.replace(moe=None))):
        layout = make_layout("0-0:d1", model=cfg)
        gen = make_generate_fn(cfg, GenerateConfig(max_new_tokens=24, eos_token_id=1,
                                                   pad_token_id=0), layout, prompt_buckets=[16])
        calls = {on: make_inference_fn(cfg, InferenceConfig(InferenceKind.LOGPROBS,
                                                             replay_routing=on), layout)
                 for on in (False, True)}
        for seed in range(3):
            ones = jnp.ones((1, 4), jnp.int32)
            params = nn.meta.unbox(Transformer(cfg).init(jax.random.key(seed), ones, ones,
                                                         ones)["params"])
            rng = np.random.default_rng(seed)
            tokens_bp = rng.integers(2, cfg.vocab_size, (16, 16)).astype(np.int32)
            mask_bp = np.ones((16, 16), bool)
            mask_bp[0, :3] = False
            out = gen(params, tokens_bp, mask_bp, jax.random.key(1))
            seq_bs, seq_mask_bs = _sequences(mask_bp, out)
            response_bn = np.asarray(out.response_mask_bn)
            for on in ((False, True) if name == "moe" else (False,)):
                got = calls[on](params, InferenceBatch.padded(seq_bs, seq_mask_bs),
                                out.routes_bslk)
                logp_bn = np.asarray(got.logprobs_bt)[:, -response_bn.shape[1]:]
                gap = np.abs(logp_bn - np.asarray(out.logprobs_bn))[response_bn]
                gaps["dense" if name == "dense" else (name, on)].append(gap)
                if name == "moe":
                    assert float(replay.mismatch(got.routes_changed)) > 0
    gap = {key: np.concatenate(parts) for key, parts in gaps.items()}
    assert gap["moe", True].mean() <= gap["dense"].mean()
    assert gap["moe", False].max() > gap["dense"].max()  # what replay avoided
    assert gap["moe", True].max() < gap["moe", False].max() / 2


@pytest.mark.slow  # ~40 s: an MoE model's rollout engine and its recompute compile
def test_async_worker_rows_carry_each_tokens_experts_across_versions():
    """Asynchronous RL's rollout worker (run/rollout_worker.py) hands its rows' routes to the
    trainer as the generate call does. A row that goes on under new weights
    (on_new_version=continue, its cache recomputed) keeps every token's experts from when it
    was fed, under the weights that sampled the next token: in fp32 a full forward under
    version 0's weights gives those of the tokens fed before the switch, one under version 1's
    (whose keys the recompute made) those fed after; NO_ROUTE on padding and each row's last
    token."""
    from jaxrlhf.engine.rollout import Rollout
    from jaxrlhf.engine.rollout.scheduler import OnNewVersion
    from jaxrlhf.mfc import MFC, Call, Role
    from jaxrlhf.run.rollout_worker import RolloutWorker

    cfg = get_size("tiny-moe", dtype=jnp.float32)
    layout = make_layout("0-1:d2", model=cfg)
    params_a, params_b = _params(cfg), jax.tree.map(lambda x: x * 1.5, _params(cfg))
    rows, first = 4, 4  # tokens each row has at the switch: its fill's, then a chunk of 3
    gen = GenerateConfig(max_new_tokens=NEW, eos_token_id=1, pad_token_id=0,
                         force_max_length=True)
    outputs = ("seq_tokens_bs", "seq_mask_bs", "response_mask_bn", "behav_logp_bn")
    mfc = MFC("actor_gen", Role.ACTOR, Call.GENERATE, ("prompt_tokens_bp", "prompt_mask_bp"),
              (*outputs, routes_key(outputs[0])))
    worker = RolloutWorker(mfc, Rollout(cfg, gen, layout, PROMPT, rows), layout, cfg, seed=5,
                           chunk_tokens=first - 1, on_new_version=OnNewVersion.CONTINUE)
    rng = np.random.default_rng(0)
    tokens_bp = rng.integers(2, cfg.vocab_size, (rows, PROMPT)).astype(np.int32)
    mask_bp = np.ones((rows, PROMPT), bool)
    mask_bp[0, :3] = False
    worker.install(params_a, 0)
    worker.start(0, {"prompt_tokens_bp": tokens_bp, "prompt_mask_bp": mask_bp}, None, 0.0)
    assert not worker.step(lambda: 1.0)
    worker.install(params_b, 1)
    done = []
    while worker.busy:
        done += worker.step(lambda: 1.0)
    (got,) = done
    assert got.interruptions == 1
    np.testing.assert_array_equal(got.versions_bn[:, :first], 0)
    np.testing.assert_array_equal(got.versions_bn[:, first:], 1)
    seq_bs, seq_mask_bs = got.buffer["seq_tokens_bs"], got.buffer["seq_mask_bs"]
    routes_bslk = got.buffer[routes_key(outputs[0])]
    assert routes_bslk.dtype == np.int8 and routes_bslk.shape == (rows, PROMPT + NEW, 2, 2)
    fresh = {v: np.sort(np.asarray(_fresh_routes(cfg, p, seq_bs, seq_mask_bs)[1]), -1)
             for v, p in ((0, params_a), (1, params_b))}
    # Position s feeds the token that samples s + 1: the prompt's and the first first - 1
    # responses' under version 0, the rest under version 1 (the last token is never fed).
    fed_bs = seq_mask_bs.copy()
    fed_bs[:, -1] = False
    under_a_s = np.arange(PROMPT + NEW) < PROMPT + first - 1
    recorded_bsl = routes_bslk[..., 0] >= 0
    np.testing.assert_array_equal(recorded_bsl, np.broadcast_to(fed_bs[..., None],
                                                                recorded_bsl.shape))
    want_bslk = np.where(under_a_s[None, :, None, None], fresh[0], fresh[1])
    same_bsl = np.all(np.sort(routes_bslk, -1) == want_bslk, axis=-1)
    assert same_bsl[fed_bs].all()
    assert not np.all(fresh[0] == fresh[1], axis=-1)[fed_bs & ~under_a_s].all()  # they differ


@pytest.mark.slow  # ~60 s: an asynchronous GRPO job of the tiny MoE compiles every call
def test_async_run_trains_on_the_routes_its_rollout_recorded(tmp_path, monkeypatch):
    """configs/grpo_moe_tiny.py:smoke with async_rl.max_staleness=1 (replay on by default) in
    one process: every update's train step replays exactly the routes the rollout worker
    recorded for the batch it trains (batch k, update k), some batch was generated under
    weights a version old, and actor/routing_mismatch is logged every step."""
    from jaxrlhf import checkpoint
    from jaxrlhf.configs import grpo_moe_tiny
    from jaxrlhf.data import datasets, tasks
    from jaxrlhf.dataflow import executors
    from jaxrlhf.run import async_loop, build
    from jaxrlhf.run.check import check_config
    from jaxrlhf.run.rollout_worker import RolloutWorker

    config = grpo_moe_tiny.get_config("smoke")
    config.update(steps=3)
    config.rollout.update(batch_size=4, group_size=2, max_new_tokens=6)
    config.async_rl.update(max_staleness=1, chunk_tokens=2)
    config.checkpoint.update(every=0, async_save=False)
    job = check_config(config, str(tmp_path))
    assert job.spec.routing is Routing.REPLAY
    generated, trained = {}, []
    finish, train_routes = RolloutWorker._finish, executors._train_routes

    def spy_finish(worker, index, *args):
        done = finish(worker, index, *args)
        generated[index] = np.asarray(done.buffer[routes_key("seq_tokens_bs")])
        return done

    def spy_train_routes(mfc, routes_bslk, batch):
        trained.append(np.asarray(jax.device_get(routes_bslk)))
        return train_routes(mfc, routes_bslk, batch)

    monkeypatch.setattr(RolloutWorker, "_finish", spy_finish)
    monkeypatch.setattr(executors, "_train_routes", spy_train_routes)
    rows = tasks.make_reverse_task(tasks.ReverseTask(num_train=32, num_eval=4, num_sft=4)).train
    prompts = datasets.EpochIterator(rows, job.spec.rollout.batch_size, seed=job.spec.seed)
    metrics = {}
    sink = type("Sink", (), {"write": lambda self, step, m: metrics.update({step: dict(m)})})()
    checkpoints = checkpoint.Checkpointer(tmp_path / "ckpt", job.spec.checkpoint)
    with build.host_pools(job.spec) as pools:
        runner = build.fresh_runner(job, pools)
        result = async_loop.rl_loop(job, runner, prompts, sink, checkpoints, {})
        runner.close()
    checkpoints.close()
    assert not result.interrupted and sorted(metrics) == [0, 1, 2]
    assert max(metrics[s]["async/staleness_max"] for s in metrics) == 1
    assert len(trained) == 3
    for k, routes_bslk in enumerate(trained):
        assert (routes_bslk >= 0).any()
        np.testing.assert_array_equal(routes_bslk, generated[k])
    for s in metrics:
        assert 0.0 <= metrics[s]["actor/routing_mismatch"] <= 1.0


@pytest.mark.slow  # ~60 s: an MoE model's multi-turn rollouts, synchronous and asynchronous
def test_multiturn_trajectories_carry_each_tokens_experts():
    """A multi-turn trajectory's routes (dataflow/trajectories.py): the first prompt's from the
    first turn's prefill, the policy's tokens from their decode steps, the environment's and
    each turn's last token from the next turn's prefill. In fp32 under one policy those are a
    full forward's over the whole trajectory on every token but its last (never fed; NO_ROUTE,
    as padding), through the synchronous rollout and through the asynchronous worker, new
    weights (the same ones) installed every chunk so that busy rows' caches are recomputed."""
    import dataclasses
    import pathlib

    from jaxrlhf.algorithms import multiturn
    from jaxrlhf.data.environments import EnvPool
    from jaxrlhf.data.transcript import Transcript
    from jaxrlhf.dataflow.trajectories import Environment, TrajectoryLimits, rollout
    from jaxrlhf.run.rollout_worker import RolloutWorker
    from tests.test_multiturn import EarlyStops

    two_turns = f"{pathlib.Path(__file__).parent / 'fixtures/envs.py'}:TwoTurns"
    p, n, seed = 8, 48, 7
    rows = [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a, b in
            [(12, 34), (5, 6), (70, 8), (1, 99)]]
    cfg = get_size("tiny-moe", dtype=jnp.float32)
    layout = make_layout("0-1:d2", model=cfg)
    tok = EarlyStops()
    generator = make_generate_fn(cfg, GenerateConfig(max_new_tokens=n, eos_token_id=tok.stop_ids,
                                                     pad_token_id=tok.pad_id),
                                 layout, prompt_buckets=(p,))
    params = _params(cfg)
    (gen,) = [m for m in multiturn.mfcs() if m.name == "actor_gen"]
    key = routes_key("seq_tokens_bs")
    gen = dataclasses.replace(gen, outputs=(*gen.outputs, key))

    def check(seq_bs, seq_mask_bs, routes_bslk):
        assert routes_bslk.dtype == np.int8 and routes_bslk.shape == (*seq_bs.shape, 2, 2)
        last_b = seq_mask_bs.shape[1] - 1 - np.argmax(seq_mask_bs[:, ::-1], axis=1)
        fed_bs = seq_mask_bs.copy()
        fed_bs[np.arange(len(fed_bs)), last_b] = False
        _assert_fed_tokens_carry_their_routes(cfg, params, seq_bs, seq_mask_bs, fed_bs,
                                              routes_bslk)

    with EnvPool(two_turns, num_workers=2, timeout_s=5.0) as pool:
        env = Environment(pool, Transcript(tok), tok, TrajectoryLimits(3, p, n, 0.5))
        want = rollout(generator, params, jax.random.key(seed), pool, env.transcript, tok, rows,
                       env.limits)
        assert want.turns_b.min() == 2  # a reply between two policy turns
        assert ((~want.policy_bn) & want.mask_bs[:, p:]).any()  # the environment's tokens
        check(want.tokens_bs, want.mask_bs, want.routes_bslk)
        worker = RolloutWorker(gen, generator.rollout_engine(p + n, len(rows)), layout, cfg,
                               seed, chunk_tokens=2, env=env)
        batch = {"prompt_text": [r["prompt"] for r in rows], "answer": [r["answer"] for r in rows]}
        worker.start(0, batch, None, 0.0)
        done, version = [], 0
        while not done:
            worker.install(params, version)
            version += 1
            done = worker.step(lambda: 1.0)
        (got,) = done
        assert got.interruptions >= 1
        check(got.buffer["seq_tokens_bs"], got.buffer["seq_mask_bs"], got.buffer[key])


@pytest.mark.slow  # ~155 s: two processes compile an MoE job's calls
@pytest.mark.entry
def test_two_process_async_run_replays_the_routes_its_replica_sent(tmp_path):
    """`launch/local.sh 2 python -m jaxrlhf.train --config=configs/grpo_moe_tiny.py:smoke`
    with async_rl.max_staleness=1, disaggregated: the generation replica's batches reach the
    trainer through run/channel.py with their routes (the train step reads them: without,
    the job stops), staleness 1 is reached and actor/routing_mismatch is logged every step,
    0 on the batch generated under the trainer's own weights (fp32: no flips)."""
    import json
    import os
    import pathlib
    import subprocess
    import sys

    repo, workdir = pathlib.Path(__file__).parent.parent, tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env.update(JAX_PLATFORMS="cpu", LOG_DIR=str(tmp_path / "logs"))
    command = [str(repo / "launch/local.sh"), "2", sys.executable, "-m", "jaxrlhf.train",
               "--config=configs/grpo_moe_tiny.py:smoke", f"--workdir={workdir}",
               "--config.steps=3", "--config.async_rl.max_staleness=1",
               "--config.placement.kind=disaggregate", "--config.placement.strategy=",
               "--config.reward.workers=1", "--config.data.task.num_eval=8",
               "--wait_timeout=300"]
    done = subprocess.run(command, cwd=repo, env=env, capture_output=True, text=True,
                          timeout=900)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    rows = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    rl_rows = [r for r in rows if "async/staleness_max" in r]
    assert [r["step"] for r in rl_rows] == [0, 1, 2]
    assert max(r["async/staleness_max"] for r in rl_rows) == 1
    assert {r["async/replica"] for r in rl_rows} == {1}
    assert rl_rows[0]["actor/routing_mismatch"] == 0.0
    assert all(0.0 <= r["actor/routing_mismatch"] <= 1.0 for r in rl_rows)
