"""Expert parallelism (strategy letter `e`, models/expert_parallel.py) and experts split over
`t`: layouts with e and t give the one-device block, train step and log-probs within 1e-5 in
float32; each device holds 1/(e*t) of the expert weights; the compiled program moves tokens by
all-to-all (with e) and builds no [tokens, experts, hidden] array; parameters move bitwise
between e and non-e layouts."""

import math
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrlhf.engine import microbatch as mb
from jaxrlhf.engine import optimizer as opt
from jaxrlhf.engine import train_step as ts
from jaxrlhf.engine.inference import (
    InferenceBatch, InferenceConfig, InferenceKind, make_inference_fn,
)
from jaxrlhf.models import expert_parallel
from jaxrlhf.models.moe import MoeBlock, MoeConfig
from jaxrlhf.models.sizes import abstract_params, get_size
from jaxrlhf.parallel.layout import make_layout
from jaxrlhf.parallel.reshard import reshard
from test_train_step import make_batch, token_ce

MODEL = get_size("tiny", num_kv_heads=4, dtype=jnp.float32, num_layers=2,
                 moe=MoeConfig(num_experts=8, top_k=2, expert_intermediate_size=32,
                               aux_loss_coef=0.5, z_loss_coef=0.1))
OPT = opt.OptimizerConfig(lr=1e-2, warmup_steps=0, total_steps=2, eps=1e-3, max_grad_norm=1e9)
# 12 rows of 10 tokens: no token count of a device (120, 60, 30, and twice that: the k=2
# assignments) or row count (12, 6, 3) equals an expert count (8, 4 local on e2), the hidden
# size (64) or expert width (32), so a [tokens, experts, hidden] shape is told apart in HLO.
ROWS, LENGTH = 12, 10


def _host_params():
    rng = np.random.default_rng(0)  # random values on the abstract tree: no init to compile
    return jax.tree.map(lambda a: (0.2 * rng.standard_normal(a.shape)).astype(np.float32),
                        nn.meta.unbox(abstract_params(MODEL)))


def _assert_close_to_scale(actual, desired):
    """Within 1e-5 of the array's largest entry: a gradient of sum(sin(y)) over 120 tokens
    reaches ~50, and an entry near zero is a sum of such terms in another order (fp32)."""
    desired = np.asarray(desired)
    np.testing.assert_allclose(actual, desired, rtol=0, atol=1e-5 * np.max(np.abs(desired)))


def _devices(spec: str) -> str:
    sizes = [int(n) for n in re.findall(r"\d+", spec)]
    return f"0-{int(np.prod(sizes)) - 1}:{spec}"


def _block_loss_and_grads(spec: str | None):
    """A sparse block's (loss, grads wrt its weights and input) on `spec` (None: no mesh in
    scope, the local path), with the compiled program's HLO."""
    block = MoeBlock(MODEL)
    rng = np.random.default_rng(1)
    x_btd = rng.standard_normal((ROWS, LENGTH, MODEL.hidden_size)).astype(np.float32)
    valid_bt = np.ones((ROWS, LENGTH), bool)
    params = jax.tree.map(
        lambda a: (0.2 * rng.standard_normal(a.shape)).astype(np.float32),
        nn.meta.unbox(jax.eval_shape(block.init, jax.random.key(0), x_btd, valid_bt)))

    def loss(p, x):
        y_btd = block.apply(p, x, valid_bt)[0]
        return jnp.sum(jnp.sin(y_btd))  # a non-linear readout: every output entry matters

    fn = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
    if spec is None:
        return fn(params, x_btd), None, params
    layout = make_layout(_devices(spec), model=MODEL)
    boxed = jax.eval_shape(block.init, jax.random.key(0), x_btd, valid_bt)
    params = jax.device_put(params, layout.param_shardings(boxed))
    x_btd = jax.device_put(x_btd, layout.batch_sharding(3))
    with layout.activation_context():
        compiled = fn.lower(params, x_btd).compile()
    return compiled(params, x_btd), compiled.as_text(), params


def _token_expert_hidden_shapes(hlo: str, ways: int) -> list[str]:
    """HLO array shapes with a token dim, an expert dim (all E or the E/e local ones) and the
    hidden size: what a dense dispatch ([T, E, D] one-hot products) would build."""
    experts = {MODEL.moe.num_experts, MODEL.moe.num_experts // ways}
    tokens = {ROWS * LENGTH // n * k for n in (1, 2, 4) for k in (1, MODEL.moe.top_k)}
    found = []
    for dims in re.findall(r"f32\[([\d,]+)\]", hlo):
        shape = [int(n) for n in dims.split(",")]
        if (MODEL.hidden_size in shape and tokens & set(shape) and experts & set(shape)
                and len(shape) >= 3):
            found.append(dims)
    return found


def _expert_shard_shapes(spec: str, params) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The shard shapes one device holds of a block's gate [E, D, F] and down [E, F, D], and
    what 1/(e*t) of them is: E/e experts, F/t of each one's width (and D/f, fsdp's cut)."""
    strategy = make_layout(_devices(spec)).strategy
    moe = MODEL.moe
    local = moe.num_experts // strategy.expert
    width = moe.expert_intermediate_size // strategy.tensor
    embed = MODEL.hidden_size // strategy.fsdp
    gate, down = params["params"]["gate_proj"], params["params"]["down_proj"]
    held = (gate.sharding.shard_shape(gate.shape), down.sharding.shard_shape(down.shape))
    return held, ((local, embed, width), (local, width, embed))


@pytest.mark.devices(8)
@pytest.mark.parametrize("spec", ["e2", "d2e2", "t2", "e2t2", "d2e2t2", "f2e2t2"])
def test_block_splits_experts_and_equals_one_device(spec):
    """e splits the experts and moves tokens by all-to-all, t splits each expert's width."""
    (ref_loss, ref_grads), _, _ = _block_loss_and_grads(None)
    (loss, grads), hlo, params = _block_loss_and_grads(spec)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
    jax.tree.map(_assert_close_to_scale, grads, ref_grads)
    held, one_over_et = _expert_shard_shapes(spec, params)
    assert held == one_over_et
    ways = make_layout(_devices(spec)).strategy.expert
    assert ("all-to-all" in hlo) == (ways > 1)
    assert _token_expert_hidden_shapes(hlo, ways) == []


def test_hlo_shape_check_finds_a_dense_dispatch():
    """The shape check of the test above can fail: a one-hot dispatch [T, E, D] is found."""
    def dense_dispatch(x_td, experts_t):
        onehot_te = jax.nn.one_hot(experts_t, MODEL.moe.num_experts)
        return jnp.sum(jnp.sin(onehot_te[:, :, None] * x_td[:, None, :]), axis=1)

    tokens = ROWS * LENGTH
    hlo = jax.jit(dense_dispatch).lower(
        jnp.zeros((tokens, MODEL.hidden_size)), jnp.zeros(tokens, jnp.int32)).compile().as_text()
    assert f"{tokens},8,64" in _token_expert_hidden_shapes(hlo, 1)
    assert expert_parallel.expert_axis(8) is None  # no mesh in scope: the local path


def _train_and_logprobs(spec: str):
    params = _host_params()
    batch = make_batch(3, batch=ROWS, length=16)
    layout = make_layout(_devices(spec), model=MODEL)
    state = ts.create_train_state(params, MODEL, layout, OPT)
    infer = make_inference_fn(MODEL, InferenceConfig(InferenceKind.LOGPROBS), layout,
                              length_buckets=(16,))
    out = infer(state.params, InferenceBatch.padded(batch["tokens_bt"],
                                                    batch["segment_ids_bt"].astype(bool)))
    logprobs = np.asarray(out.logprobs_bt)
    down = state.params["layers"]["moe"]["down_proj"]  # [L, E, F, D]
    expert_shard = down.sharding.shard_shape(down.shape)
    moments = [leaf for path, leaf in jax.tree_util.tree_leaves_with_path(state.opt_state)
               if "down_proj" in jax.tree_util.keystr(path) and leaf.shape == down.shape]
    assert moments and all(  # Adam's moments: as the weights, or ZeRO-1 split further
        math.prod(m.sharding.shard_shape(m.shape)) <= math.prod(expert_shard) for m in moments)
    step = ts.make_train_step(MODEL, layout, token_ce, OPT, mb.MicrobatchConfig())
    new_state, metrics = step(state, batch)  # (the step may donate the state)
    return (jax.device_get(new_state.params), jax.device_get(metrics), logprobs,
            expert_shard)


@pytest.fixture(scope="module")
def one_device():
    return _train_and_logprobs("d1")


@pytest.mark.devices(8)
@pytest.mark.slow  # ~14 s each and the one-device fixture's 12 s; the block test above is
@pytest.mark.parametrize("spec", ["e2", "e4", "d2e2", "e2t2", "t2", "d2e2t2"])  # their sibling
def test_train_step_and_logprobs_equal_one_device(one_device, spec):
    ref_params, ref_metrics, ref_logprobs, _ = one_device
    new_params, metrics, logprobs, expert_shard = _train_and_logprobs(spec)
    for name in ("loss", "moe_balance_loss", "moe_z_loss", "moe_min_load"):
        np.testing.assert_allclose(metrics[name], ref_metrics[name], rtol=1e-5, err_msg=name)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-5, rtol=0),
                 new_params, ref_params)
    np.testing.assert_allclose(logprobs, ref_logprobs, atol=1e-5, rtol=0)
    strategy = make_layout(_devices(spec)).strategy
    moe = MODEL.moe
    assert expert_shard == (MODEL.num_layers, moe.num_experts // strategy.expert,
                            moe.expert_intermediate_size // strategy.tensor, MODEL.hidden_size)


@pytest.mark.devices(8)
@pytest.mark.slow  # ~15 s each
@pytest.mark.parametrize("spec", ["d2e2p2", "e2p2t2"])
def test_pipelined_logprobs_equal_one_device(one_device, spec):
    """Inference on a pipeline: the block's shard_map inside the pipeline's stage vmap."""
    params, batch = _host_params(), make_batch(3, batch=ROWS, length=16)
    layout = make_layout(_devices(spec), model=MODEL)
    params = jax.device_put(params, layout.param_shardings(abstract_params(MODEL)))
    infer = make_inference_fn(MODEL, InferenceConfig(InferenceKind.LOGPROBS), layout,
                              length_buckets=(16,))
    out = infer(params, InferenceBatch.padded(batch["tokens_bt"],
                                              batch["segment_ids_bt"].astype(bool)))
    np.testing.assert_allclose(np.asarray(out.logprobs_bt), one_device[2], atol=1e-5, rtol=0)


@pytest.mark.devices(8)
def test_reallocation_between_expert_layouts_is_bitwise():
    params = _host_params()
    abstract = abstract_params(MODEL)
    train = make_layout("0-7:d2e4", model=MODEL).param_shardings(abstract)
    on_train = jax.device_put(params, train)
    gate = on_train["layers"]["moe"]["gate_proj"]
    assert gate.sharding.shard_shape(gate.shape)[1] == MODEL.moe.num_experts // 4
    for spec in ("0-3:d2t2", "4-7:e2t2", "0-0:d1", "0-7:f2e4"):
        there, _ = reshard(on_train, make_layout(spec, model=MODEL).param_shardings(abstract))
        back, _ = reshard(there, train)
        for moved in (there, back):
            jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), b),
                         moved, params)
        assert jax.tree.leaves(back)[0].sharding == jax.tree.leaves(on_train)[0].sharding


@pytest.mark.slow  # ~70 s: an RL job's programs on three layouts
def test_rl_job_moves_weights_between_expert_and_tensor_layouts(tmp_path):
    """configs/grpo_moe_tiny.py:smoke with generation on d4t2, training on d2e4 and the
    reference on e8: the actor's weights move between the e and non-e layouts every step."""
    import json

    from jaxrlhf.configs import grpo_moe_tiny
    from jaxrlhf.run import rl
    from jaxrlhf.run.check import check_config

    config = grpo_moe_tiny.get_config("smoke")
    config.placement.kind, config.placement.strategy = "manual", ""
    config.placement.allocation = "actor_gen=0-7:d4t2,actor_train=0-7:d2e4,ref_inf=0-7:e8"
    summary = rl.run(check_config(config, str(tmp_path)))
    assert summary["steps"] == 2 and not summary["interrupted"], summary
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    moved = [r["actor/realloc_bytes"] for r in records if "actor/realloc_bytes" in r]
    assert len(moved) == 2 and min(moved) > 0, moved
