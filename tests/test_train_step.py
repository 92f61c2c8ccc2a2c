"""train_step, optimizer and micro-batching: parallel equivalence against a one-device reference,
exact micro-batch accumulation, numpy AdamW, lr schedule, clipping, fp32 master, compile counts."""

import dataclasses
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxrlhf.algorithms import losses
from jaxrlhf.algorithms.losses import LossAggregation
from jaxrlhf.engine import microbatch as mb
from jaxrlhf.engine import optimizer as opt
from jaxrlhf.engine import train_step as ts
from jaxrlhf.models.sizes import get_size
from jaxrlhf.models.transformer import Transformer
from jaxrlhf.parallel.layout import make_layout

# Four heads and four KV heads so t4 divides; hidden 64, mlp 256, vocab 272 all divide by 8.
MODEL = get_size("tiny", num_kv_heads=4, dtype=jnp.float32)
BATCH, LENGTH = 16, 16
# Clipping engages (the tiny model's first gradient norm is ~1.3) and weight decay is on.
# eps bounds Adam's sensitivity to gradient noise by lr/eps: with 1e-8, a near-zero gradient
# entry turns fp32 summation-order noise (which differs between layouts) into an lr-sized jump.
OPT = opt.OptimizerConfig(lr=1e-3, warmup_steps=0, total_steps=4, min_lr_ratio=0.1,
                          eps=1e-6, weight_decay=0.1, max_grad_norm=0.5)


def token_ce(out, batch):
    """Token-level cross-entropy of the next token under `loss_mask_bt`, from the train step's
    readout (log-probs; entry t belongs to token t): (Σnll, Σmask, {prob: Σp(next token)})."""
    next_logp_bt = jnp.roll(out.logprobs_bt, -1, axis=1)  # entry t: log p(token t + 1)
    mask_bt = batch["loss_mask_bt"].astype(jnp.float32)
    return (-jnp.sum(next_logp_bt * mask_bt), jnp.sum(mask_bt),
            {"prob": jnp.sum(jnp.exp(next_logp_bt) * mask_bt)})


def logits_ce(logits_btv, batch):
    """`token_ce`'s (Σnll, Σmask) from the logits, by plain log-softmax (the reference)."""
    logp_btv = jax.nn.log_softmax(logits_btv, axis=-1)
    nll_bt = -jnp.take_along_axis(logp_btv, batch["targets_bt"][..., None], axis=-1)[..., 0]
    mask_bt = batch["loss_mask_bt"].astype(jnp.float32)
    return jnp.sum(nll_bt * mask_bt), jnp.sum(mask_bt)


def make_batch(seed: int, batch: int = BATCH, length: int = LENGTH, pad_token: int | None = 0):
    """Right-padded rows of random lengths; loss on tokens after a 3-token prompt.

    `pad_token=None` fills padding with random ids, which must not change anything.
    """
    rng = np.random.default_rng(seed)
    lengths = rng.integers(5, length + 1, size=batch)
    lengths[0] = length  # at least one full row
    valid_bt = np.arange(length)[None, :] < lengths[:, None]
    tokens_bt = rng.integers(1, MODEL.vocab_size, size=(batch, length)).astype(np.int32)
    if pad_token is not None:
        tokens_bt = np.where(valid_bt, tokens_bt, pad_token).astype(np.int32)
    targets_bt = np.roll(tokens_bt, -1, axis=1)
    loss_mask_bt = (valid_bt & np.roll(valid_bt, -1, axis=1) & (np.arange(length) >= 2)
                    & (np.arange(length) < length - 1))
    return dict(
        tokens_bt=tokens_bt,
        positions_bt=np.where(valid_bt, np.arange(length), 0).astype(np.int32),
        segment_ids_bt=valid_bt.astype(np.int32),
        targets_bt=targets_bt.astype(np.int32),
        loss_mask_bt=loss_mask_bt.astype(np.int32),
    )


@pytest.fixture(scope="module")
def host_params():
    """fp32 parameters as numpy arrays, so that no test's donation can free them."""
    tokens = jnp.zeros((1, 1), jnp.int32)
    init = jax.jit(lambda key: nn.unbox(Transformer(MODEL).init(key, tokens, tokens, tokens + 1)))
    return jax.tree.map(np.asarray, init(jax.random.key(0))["params"])


def _reference_steps(params, batches, opt_cfg):
    """One device, no micro-batching: loss = Σloss_sum/Σweight on the whole batch, then optax."""
    optimizer = opt.make_optimizer(opt_cfg)
    model = Transformer(MODEL)

    def objective(p, batch):
        logits, _ = model.apply({"params": p}, batch["tokens_bt"], batch["positions_bt"],
                                batch["segment_ids_bt"])
        loss_sum, weight = logits_ce(logits, batch)
        return loss_sum / weight

    @jax.jit
    def step(p, state, batch):
        loss, grads = jax.value_and_grad(objective)(p, batch)
        updates, state = optimizer.update(grads, state, p)
        return optax.apply_updates(p, updates), state, loss, optax.tree.norm(grads)

    opt_state = optimizer.init(params)
    losses, norms = [], []
    for batch in batches:
        params, opt_state, loss, norm = step(params, opt_state, batch)
        losses.append(float(loss))
        norms.append(float(norm))
    return jax.tree.map(np.asarray, params), losses, norms


@pytest.fixture(scope="module")
def reference(host_params):
    batches = [make_batch(1), make_batch(2)]
    return _reference_steps(host_params, batches, OPT)


def _assert_tree_close(actual, expected, atol):
    jax.tree.map(lambda a, e: np.testing.assert_allclose(a, e, rtol=0, atol=atol),
                 actual, expected)


# (strategy, micro-batching, expected k): count and token-budget splits under every parallelism.
LAYOUT_CASES = [
    ("0-7:d8", mb.MicrobatchConfig.by_count(2), 2),
    ("0-7:f8", mb.MicrobatchConfig.by_token_budget(8 * LENGTH), 2),
    ("0-7:d2f2t2", mb.MicrobatchConfig.by_count(4), 4),
    ("0-3:t4", mb.MicrobatchConfig.by_token_budget(4 * LENGTH + 3), 4),
]


@pytest.mark.devices(8)
@pytest.mark.parametrize("spec,micro_cfg,expected_k", LAYOUT_CASES)
def test_layouts_match_one_device_big_batch(host_params, reference, spec, micro_cfg, expected_k):
    ref_params, ref_losses, ref_norms = reference
    layout = make_layout(spec, model=MODEL)
    state = ts.create_train_state(host_params, MODEL, layout, OPT)
    step = ts.make_train_step(MODEL, layout, token_ce, OPT, micro_cfg)
    # Random ids in the padding: masking must make them irrelevant.
    batches = [make_batch(1, pad_token=None), make_batch(2, pad_token=None)]
    assert step.num_microbatches(batches[0]) == expected_k
    metrics = []
    with jax.transfer_guard("disallow"):
        for batch in batches:
            state, m = step(state, batch)
            metrics.append(jax.device_get(m))

    assert step.compiles == 1
    assert int(jax.device_get(state.step)) == 2
    for i, m in enumerate(metrics):
        np.testing.assert_allclose(m["loss"], ref_losses[i], rtol=1e-6)
        np.testing.assert_allclose(m["grad_norm"], ref_norms[i], rtol=1e-5)
        assert m["grad_norm"] > OPT.max_grad_norm  # clipping engaged
        np.testing.assert_allclose(m["lr"], opt.make_schedule(OPT)(i), rtol=1e-7)
        expected_tokens = batches[i]["segment_ids_bt"].sum()
        assert m["num_tokens"] == expected_tokens
        assert m["weight"] == batches[i]["loss_mask_bt"].sum()
        assert 0.0 < m["prob"] < 1.0
    _assert_tree_close(jax.device_get(state.params), ref_params, atol=1e-5)
    expected_shardings = ts.state_shardings(MODEL, layout, OPT)
    jax.tree.map(_assert_sharded_as, state.params, expected_shardings.params)
    adam = state.opt_state[1][0]
    jax.tree.map(lambda a, p: _assert_sharded_as(a, p.sharding), adam.mu, state.params)


def _assert_sharded_as(array, sharding):
    assert array.sharding.is_equivalent_to(sharding, array.ndim), (array.sharding, sharding)


@pytest.mark.devices(8)
def test_opt_state_shardings_follow_params():
    layout = make_layout("0-7:d2f2t2", model=MODEL)
    shardings = ts.state_shardings(MODEL, layout, opt.OptimizerConfig(fp32_master=True))
    master = shardings.opt_state.master
    inner_adam = shardings.opt_state.inner[1][0]
    for tree in (master, inner_adam.mu, inner_adam.nu):
        assert jax.tree.map(lambda s: s.spec, tree) == jax.tree.map(
            lambda s: s.spec, shardings.params)
    assert inner_adam.count.spec == jax.sharding.PartitionSpec()
    # The MLP kernel really is split (fsdp on embed, tensor on mlp), not replicated.
    gate = shardings.params["layers"]["mlp"]["gate_proj"]["kernel"]
    assert gate.spec == jax.sharding.PartitionSpec(None, "fsdp", "tensor")


@pytest.mark.devices(8)
@pytest.mark.parametrize("aggregation", list(LossAggregation) + ["sequence"])
def test_data_parallel_step_all_reduces_once(host_params, aggregation):
    """Loss weights (token or sequence counts) travel with the gradients in one all-reduce.

    A count summed in another element type (an s32 sum of a bool mask) gets an all-reduce of
    its own, which XLA schedules first: each device's worker thread then waits there for the
    slowest device before it has computed anything (on W-cpu at d2, 36 ms of a 0.98 s step).
    """
    def loss_fn(out, batch):
        nll_bt = -jnp.roll(out.logprobs_bt, -1, axis=1)
        if aggregation == "sequence":
            return losses._sequence_reduce(jnp.mean(nll_bt, axis=1), {},
                                           batch["segment_ids_bt"][:, 0])
        return (*losses.aggregate(nll_bt, batch["loss_mask_bt"], aggregation), {})

    # Unrolled layers, as W-cpu's actor trains: a scanned stack all-reduces inside its loop too.
    model = dataclasses.replace(MODEL, scan_layers=False)
    step = ts.make_train_step(model, make_layout("0-7:d8", model=model), loss_fn, OPT)
    state = ts.create_train_state(host_params, model, step.layout, OPT)
    batch = jax.tree.map(jnp.asarray, make_batch(3))
    hlo = step._lower(state, batch).compile().as_text()
    assert hlo.count(" all-reduce(") + hlo.count(" all-reduce-start(") == 1


@pytest.mark.devices(2)
def test_bf16_params_with_fp32_master(host_params):
    model = MODEL.replace(param_dtype=jnp.bfloat16)
    cfg = opt.OptimizerConfig(lr=1e-3, total_steps=10, fp32_master=True)
    layout = make_layout("0-1:f2", model=model)
    params_bf16 = jax.tree.map(lambda x: x.astype(jnp.bfloat16), host_params)
    state = ts.create_train_state(params_bf16, model, layout, cfg)
    step = ts.make_train_step(model, layout, token_ce, cfg, mb.MicrobatchConfig.by_count(2))
    for seed in (1, 2):
        state, metrics = step(state, make_batch(seed))
    assert step.compiles == 1
    # A different shape bucket compiles once more.
    state, metrics = step(state, make_batch(3, batch=4, length=8))
    assert step.compiles == 2

    params, opt_state = jax.device_get((state.params, state.opt_state))
    assert {x.dtype for x in jax.tree.leaves(params)} == {jnp.dtype(jnp.bfloat16)}
    float_leaves = [x for x in jax.tree.leaves(opt_state) if jnp.issubdtype(x.dtype, jnp.floating)]
    assert {x.dtype for x in float_leaves} == {jnp.dtype(jnp.float32)}
    # The parameters are the rounded master, and the master moved by sub-bf16-ulp amounts too.
    rounded = jax.tree.map(lambda m: m.astype(jnp.bfloat16), opt_state.master)
    jax.tree.map(np.testing.assert_array_equal, params, rounded)
    moved = jax.tree.map(lambda m, p0: np.abs(m - p0.astype(np.float32)).max(),
                         opt_state.master, params_bf16)
    assert min(jax.tree.leaves(moved)) > 0
    assert np.isfinite(float(metrics["loss"]))


# --- optimizer against numpy -------------------------------------------------------------------


def _numpy_schedule(cfg: opt.OptimizerConfig, step: int) -> float:
    end = cfg.lr * cfg.min_lr_ratio
    if step < cfg.warmup_steps:
        return cfg.lr * step / cfg.warmup_steps
    if step >= cfg.total_steps:
        return end
    frac = (step - cfg.warmup_steps) / (cfg.total_steps - cfg.warmup_steps)
    return end + (cfg.lr - end) * 0.5 * (1 + math.cos(math.pi * frac))


def test_schedule_matches_optax_and_closed_form():
    cfg = opt.OptimizerConfig(lr=3e-4, warmup_steps=3, total_steps=10, min_lr_ratio=0.1)
    optax_schedule = optax.warmup_cosine_decay_schedule(0.0, 3e-4, 3, 10, 3e-5)
    ours = opt.make_schedule(cfg)
    for step in range(13):
        np.testing.assert_allclose(ours(step), optax_schedule(step), rtol=1e-7)
        np.testing.assert_allclose(ours(step), _numpy_schedule(cfg, step), rtol=1e-6, atol=1e-12)


def _numpy_adamw(params, grads_seq, cfg: opt.OptimizerConfig):
    """Plain-loop AdamW with global-norm clipping; no decay on 'scale' and 'bias' leaves."""
    p = {k: v.astype(np.float64) for k, v in params.items()}
    m = {k: np.zeros_like(v) for k, v in p.items()}
    v = {k: np.zeros_like(x) for k, x in p.items()}
    for t, grads in enumerate(grads_seq, start=1):
        norm = math.sqrt(sum(float(np.sum(g.astype(np.float64) ** 2)) for g in grads.values()))
        scale = min(1.0, cfg.max_grad_norm / norm)
        lr = _numpy_schedule(cfg, t - 1)
        for k in p:
            g = grads[k].astype(np.float64) * scale
            m[k] = cfg.b1 * m[k] + (1 - cfg.b1) * g
            v[k] = cfg.b2 * v[k] + (1 - cfg.b2) * g * g
            m_hat, v_hat = m[k] / (1 - cfg.b1**t), v[k] / (1 - cfg.b2**t)
            decay = 0.0 if k in ("scale", "bias") else cfg.weight_decay
            p[k] = p[k] - lr * (m_hat / (np.sqrt(v_hat) + cfg.eps) + decay * p[k])
    return p


@pytest.mark.parametrize("fp32_master", [False, True])
def test_optimizer_matches_numpy_adamw(fp32_master):
    cfg = opt.OptimizerConfig(lr=1e-2, warmup_steps=1, total_steps=5, min_lr_ratio=0.2,
                              weight_decay=0.3, max_grad_norm=0.7, fp32_master=fp32_master)
    rng = np.random.default_rng(0)
    params = {"kernel": rng.normal(size=(3, 4)).astype(np.float32),
              "scale": rng.normal(size=(4,)).astype(np.float32)}
    grads_seq = [{k: rng.normal(size=x.shape).astype(np.float32) for k, x in params.items()}
                 for _ in range(4)]
    optimizer = opt.make_optimizer(cfg)
    state, p = optimizer.init(params), params
    update = jax.jit(optimizer.update)
    for grads in grads_seq:
        updates, state = update(grads, state, p)
        p = optax.apply_updates(p, updates)
    expected = _numpy_adamw(params, grads_seq, cfg)
    for k in params:
        np.testing.assert_allclose(p[k], expected[k], rtol=0, atol=2e-6)


def test_clipping_engages():
    cfg = opt.OptimizerConfig(max_grad_norm=1.0)
    grads = {"kernel": np.full((2, 2), 5.0, np.float32)}  # global norm 10
    optimizer = opt.make_optimizer(cfg)
    _, state = jax.jit(optimizer.update)(grads, optimizer.init(grads), grads)
    mu = state[1][0].mu["kernel"]
    np.testing.assert_allclose(mu, (1 - cfg.b1) * grads["kernel"] / 10.0, rtol=1e-6)


def test_fp32_master_keeps_sub_ulp_updates():
    cfg = opt.OptimizerConfig(lr=1e-4, total_steps=100, min_lr_ratio=1.0, fp32_master=True)
    params = {"kernel": jnp.ones((4,), jnp.bfloat16)}
    grads = {"kernel": jnp.ones((4,), jnp.bfloat16)}
    optimizer = opt.make_optimizer(cfg)
    state, update = optimizer.init(params), jax.jit(optimizer.update)
    for _ in range(10):
        updates, state = update(grads, state, params)
        params = optax.apply_updates(params, updates)
    # Ten steps of ~lr each: far below bf16's spacing at 1.0 (2^-8), so the bf16 view stays 1.
    np.testing.assert_allclose(state.master["kernel"], 1.0 - 10 * cfg.lr, rtol=1e-5)
    assert params["kernel"].dtype == jnp.bfloat16
    np.testing.assert_array_equal(params["kernel"], np.ones(4))


def test_decay_mask_skips_norms_and_biases():
    params = {"layers": {"input_layernorm": {"scale": 0}, "q_proj": {"kernel": 0, "bias": 0}},
              "lm_head": 0}
    assert opt.decay_mask(params) == {
        "layers": {"input_layernorm": {"scale": False}, "q_proj": {"kernel": True, "bias": False}},
        "lm_head": True,
    }


# --- micro-batching ----------------------------------------------------------------------------


def test_num_microbatches():
    count, budget = mb.MicrobatchConfig.by_count, mb.MicrobatchConfig.by_token_budget
    assert mb.num_microbatches(count(4), 16, 32, shards=4) == 4
    assert mb.num_microbatches(budget(16 * 32), 16, 32) == 1
    assert mb.num_microbatches(budget(5 * 32), 16, 32) == 4  # 4 rows = 128 tokens; 8 rows = 256
    assert mb.num_microbatches(budget(100), 12, 32) == 4  # 3 rows = 96 tokens
    assert mb.num_microbatches(budget(100), 12, 32, shards=2) == 6  # 2 rows, multiple of 2
    with pytest.raises(ValueError, match="valid counts"):
        mb.num_microbatches(count(3), 16, 32)
    with pytest.raises(ValueError, match="valid counts"):
        mb.num_microbatches(count(4), 16, 32, shards=8)
    with pytest.raises(ValueError, match="token budget"):
        mb.num_microbatches(budget(31), 16, 32)


def test_split_is_strided_and_minibatches_cover_rows():
    x = np.arange(12 * 2).reshape(12, 2)
    split = mb.split({"x": jnp.asarray(x)}, 3)["x"]
    assert split.shape == (3, 4, 2)
    for j in range(3):
        np.testing.assert_array_equal(split[j], x[j::3])
    minis = mb.minibatches({"x": x, "y": x[:, 0]}, 4)
    assert [m["x"].shape for m in minis] == [(3, 2)] * 4
    np.testing.assert_array_equal(np.sort(np.concatenate([m["y"] for m in minis])), x[:, 0])
    with pytest.raises(ValueError):
        mb.minibatches({"x": x}, 5)


def test_accumulate_sums_in_fp32():
    """bf16 micro-batch gradients summed in fp32. Small integers make every product and sum
    exact in fp32 on any backend and in any order, and the bf16 casts round the same everywhere:
    the fp32 sum is exact, where a bf16 running sum would differ ([2032, 1952, 1064])."""
    rng = np.random.default_rng(0)
    w = rng.integers(-8, 9, 3).astype(np.float32)
    x = rng.integers(-8, 9, (8, 3)).astype(np.float32)

    def grad_fn(w, micro):
        loss = lambda w: jnp.sum((micro["x"] @ w) ** 2)
        return jax.grad(loss)(w).astype(jnp.bfloat16), {"n": jnp.float32(micro["x"].shape[0])}

    grads, aux = jax.jit(lambda w, b: mb.accumulate(grad_fn, w, mb.split(b, 4)))(w, {"x": x})
    assert grads.dtype == jnp.float32
    expected = sum(
        np.asarray(jnp.asarray(2 * x[j::4].T @ (x[j::4] @ w)).astype(jnp.bfloat16), np.float32)
        for j in range(4)
    )
    np.testing.assert_array_equal(grads, expected)
    np.testing.assert_array_equal(expected, [2036.0, 1948.0, 1064.0])
    assert float(aux["n"]) == 8.0
