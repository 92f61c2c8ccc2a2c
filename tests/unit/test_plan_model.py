"""Planner cost, memory and reallocation models against exact counts and the compiler."""

import dataclasses
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrlhf.engine.optimizer import OptimizerConfig, make_optimizer
from jaxrlhf.engine import train_step
from jaxrlhf.mfc import Call
from jaxrlhf.models.config import RematPolicy
from jaxrlhf.models.sizes import abstract_params, get_size
from jaxrlhf.parallel.layout import make_layout
from jaxrlhf.parallel.strategy import Axis, DeviceRange
from jaxrlhf.plan import cost, memory, train_memory
from jaxrlhf.plan.choice import CallChoice
from jaxrlhf.plan.cluster import Calibration, Cluster, load_cluster, save_calibration
from jaxrlhf.plan.experiment import Workload
from jaxrlhf.plan.profile import profile_of

CLUSTER = Cluster(
    name="test_2x4", hosts=2, devices_per_host=4, hbm_bytes=10**9, peak_bf16_flops=1e12,
    hbm_bandwidth=1e11, intra_host_bandwidth=1e10, inter_host_bandwidth=1e9,
    host_link_bandwidth=5e8, matmul_efficiency=0.5, hbm_efficiency=0.5, comm_efficiency=0.5,
)
WORK = Workload(batch_size=16, prompt_len=32, new_tokens=32, mini_batches=2)


def choice(first, last, d=1, f=1, t=1, k=1):
    return CallChoice(DeviceRange(first, last), d, f, t, k)


def test_profile_counts_match_real_table1():
    p = profile_of(get_size("llama3-70b", param_dtype=jnp.bfloat16))
    assert p.num_params == 70553706496  # ReaL Table 1, TotalParamCount
    assert p.param_bytes == 2 * 70553706496


@pytest.mark.parametrize("spec", ["d8", "d2f2t2", "f4t2", "d2t4", "f8"])
def test_shard_bytes_equal_compiled_arguments(spec):
    """Per-device parameter bytes are what XLA allocates for the layout's shardings."""
    cfg = get_size("small")
    layout = make_layout(spec, model=cfg)
    params = nn.unbox(abstract_params(cfg))
    tokens = jax.ShapeDtypeStruct((8, 16), jnp.int32)
    compiled = jax.jit(lambda p, t: (p, t), in_shardings=(
        layout.param_shardings(abstract_params(cfg)), layout.batch_sharding(2)
    )).lower(params, tokens).compile()
    s = layout.strategy
    estimate = memory.call_memory(profile_of(cfg), Call.INFERENCE, WORK,
                                  choice(0, 7, s.data, s.fsdp, s.tensor))
    check = memory.compare_with_compiled(estimate, compiled.memory_analysis(),
                                         input_bytes=8 * 16 * 4 // s.dp_size)
    assert check.estimated_arguments == check.compiled_arguments
    assert check.arguments_ratio == 1.0


@pytest.mark.parametrize("fp32_master", [False, True])
def test_train_state_bytes_equal_compiled_arguments(fp32_master):
    cfg = get_size("small", param_dtype=jnp.bfloat16)
    layout = make_layout("d2f2t2", model=cfg)
    params = nn.unbox(abstract_params(cfg))
    opt_state = jax.eval_shape(make_optimizer(OptimizerConfig(fp32_master=fp32_master)).init,
                               params)
    # The runtime's shardings: the optimizer state sliced over data too (ZeRO-1).
    shardings = train_step.state_shardings(cfg, layout, OptimizerConfig(fp32_master=fp32_master))
    compiled = jax.jit(lambda p, o: (p, o), in_shardings=(
        shardings.params, shardings.opt_state)).lower(params, opt_state).compile()
    param_bytes, opt_bytes = train_memory.train_state_bytes(profile_of(cfg), choice(0, 7, 2, 2, 2),
                                                      fp32_master)
    p = profile_of(cfg)
    assert opt_bytes * 2 == p.shard_elements(2, 2) * ((8 + 4) if fp32_master else 4)
    scalars = compiled.memory_analysis().argument_size_in_bytes - param_bytes - opt_bytes
    assert 0 <= scalars <= 64  # Adam's step counts


def test_memory_grows_with_rows_and_remat_cuts_activations():
    cfg = get_size("small", dtype=jnp.bfloat16)
    p = profile_of(cfg)
    one = memory.call_memory(p, Call.TRAIN_STEP, WORK, choice(0, 3, 4))
    two = memory.call_memory(p, Call.TRAIN_STEP, WORK, choice(0, 3, 4, k=2))
    assert two.activations < one.activations and two.params == one.params
    full = memory.call_memory(profile_of(cfg.replace(remat=RematPolicy.FULL)), Call.TRAIN_STEP,
                              WORK, choice(0, 3, 4))
    assert full.activations < one.activations
    long = dataclasses.replace(WORK, new_tokens=64)  # more than one chunk: fills and advances
    gen = memory.call_memory(p, Call.GENERATE, long, choice(0, 3, 2, t=2))
    rows, slots = long.batch_size // 2, long.seq_len
    kv = rows * slots * 2 * cfg.num_layers * (cfg.num_kv_heads // 2) * cfg.head_dim * 2
    assert gen.state == kv  # the rollout engine's slots, at full capacity, an argument
    # 32 new tokens run as one executable: the slots' cache is one of its temporaries.
    at_once = memory.call_memory(p, Call.GENERATE, WORK, choice(0, 3, 2, t=2))
    assert at_once.state == 0 and at_once.activations > kv * WORK.seq_len // long.seq_len


def test_axis_link_is_inter_host_only_when_the_axis_spans_hosts():
    c = choice(0, 7, d=2, f=2, t=2)  # data groups {0, 4}: two hosts
    assert cost.axis_link(CLUSTER, c, Axis.DATA) == (1e9, CLUSTER.inter_host_latency)
    assert cost.axis_link(CLUSTER, c, Axis.FSDP) == (1e10, CLUSTER.intra_host_latency)
    assert cost.axis_link(CLUSTER, c, Axis.TENSOR) == (1e10, CLUSTER.intra_host_latency)
    assert cost.axis_link(CLUSTER, choice(4, 7, d=4), Axis.DATA)[0] == 1e10


def test_collectives_follow_the_ring_formulas():
    link = (1e9, 1e-5)
    ar = cost.all_reduce(8e6, 4, link)
    assert ar.comm == pytest.approx(2 * 3 / 4 * 8e6 / 1e9) and ar.fixed == pytest.approx(6e-5)
    assert cost.all_gather(8e6, 4, link).comm == pytest.approx(3 / 4 * 8e6 / 1e9)
    assert cost.all_reduce(8e6, 1, link) == cost.CallCost()


def test_pure_data_parallel_inference_has_no_communication_and_scales():
    p = profile_of(get_size("small"))
    one = cost.inference_cost(p, WORK, choice(0, 0), CLUSTER)
    four = cost.inference_cost(p, WORK, choice(0, 3, 4), CLUSTER)
    assert one.comm == four.comm == 0
    assert four.compute == pytest.approx(one.compute / 4)
    flops = p.forward_flops_per_token(WORK.seq_len) * WORK.batch_size * WORK.seq_len
    assert one.compute == pytest.approx(flops / CLUSTER.peak_bf16_flops)


def test_generation_fsdp_gathers_weights_every_decode_step():
    p = profile_of(get_size("small"))
    plain = cost.generate_cost(p, WORK, choice(0, 1, 2), CLUSTER)
    fsdp = cost.generate_cost(p, WORK, choice(0, 1, f=2), CLUSTER)
    gather = cost.all_gather(p.shard_bytes(1, 1), 2, cost.axis_link(CLUSTER, choice(0, 1, f=2),
                                                                    Axis.FSDP))
    # Prefill + every decode step pay one gather; nothing else differs.
    assert fsdp.comm - plain.comm == pytest.approx((WORK.new_tokens + 1) * gather.comm)
    longer = cost.generate_cost(p, Workload(16, 32, 64 - 32 + 32), choice(0, 1, 2), CLUSTER)
    assert longer.seconds(CLUSTER) > plain.seconds(CLUSTER)


def test_train_cost_counts_updates_and_remat():
    cfg = get_size("small")
    p, full = profile_of(cfg), profile_of(cfg.replace(remat=RematPolicy.FULL))
    c = choice(0, 3, 4)
    base = cost.train_cost(p, WORK, c, CLUSTER, False)
    rows = WORK.batch_size // WORK.mini_batches // 4
    fwd = p.forward_flops_per_token(WORK.seq_len) * rows * WORK.seq_len
    assert base.compute == pytest.approx(WORK.updates * 3 * fwd / CLUSTER.peak_bf16_flops)
    assert cost.train_cost(full, WORK, c, CLUSTER, False).compute == pytest.approx(
        base.compute * 4 / 3)


def test_realloc_same_layout_is_free_and_full_gather_counts_bytes():
    p = profile_of(get_size("small"))
    src = choice(0, 3, t=4)
    assert cost.realloc_cost(p, src, src, CLUSTER).route is cost.Route.NONE
    # d and micro-batches do not move shards: (devices, f, t) equal -> nothing moves.
    same = cost.realloc_cost(p, choice(0, 3, 1, 2, 2), choice(0, 3, 1, 2, 2, k=4), CLUSTER)
    assert same.route is cost.Route.NONE and same.bytes_moved == 0
    # t4 -> d4 on one host: each device keeps its quarter and receives the other 3/4.
    full = cost.realloc_cost(p, src, choice(0, 3, 4), CLUSTER)
    assert full.route is cost.Route.DIRECT
    assert full.bytes_moved == pytest.approx(4 * 0.75 * p.shard_bytes(1, 1), rel=1e-6)
    assert full.cost.seconds(CLUSTER) == pytest.approx(
        0.75 * p.shard_bytes(1, 1) / (1e10 * 0.5), rel=1e-6)


def test_realloc_routes_across_hosts():
    p = profile_of(get_size("small"))
    # Equal counts and shard shapes on another host: a direct cross-process copy.
    moved = cost.realloc_cost(p, choice(0, 3, 2, 1, 2), choice(4, 7, 2, 1, 2), CLUSTER)
    assert moved.route is cost.Route.DIRECT
    assert moved.cost.comm == pytest.approx(p.shard_bytes(2, 1) / 1e9)  # all of it, inter-host
    # Different counts across hosts: staged through host memory.
    staged = cost.realloc_cost(p, choice(0, 3, 4), choice(0, 7, 8), CLUSTER)
    assert staged.route is cost.Route.STAGED
    assert staged.cost.comm > p.shard_bytes(1, 1) / CLUSTER.host_link_bandwidth


def test_fit_calibration_recovers_efficiencies():
    truth = Calibration(0.4, 0.6, 0.8)
    rng = np.random.default_rng(0)
    records = []
    for _ in range(6):
        c = cost.CallCost(*rng.uniform(0.1, 2.0, size=3), fixed=0.01)
        records.append((c, c.compute / 0.4 + c.memory / 0.6 + c.comm / 0.8 + 0.01))
    fitted = cost.fit_calibration(records, default=Calibration(0.5, 0.5, 0.5))
    assert (fitted.matmul_efficiency, fitted.hbm_efficiency, fitted.comm_efficiency) == \
        pytest.approx((0.4, 0.6, 0.8), rel=1e-9)
    only_compute = [(cost.CallCost(compute=1.0), 2.0)]
    partial = cost.fit_calibration(only_compute, default=truth)
    assert partial.matmul_efficiency == pytest.approx(0.5)
    assert partial.hbm_efficiency == 0.6 and partial.comm_efficiency == 0.8


@pytest.mark.parametrize("name", ["cpu_8", "h100_1", "a100_16x8", "h800_16x8", "tpu_v5p_128"])
def test_cluster_files_load(name):
    cluster = load_cluster(f"meshes/{name}.py")
    assert cluster.name == name and cluster.num_devices >= 1
    assert cluster.usable_hbm_bytes < cluster.hbm_bytes


@pytest.mark.parametrize("field, value", [("hbm_bytes", -1), ("hbm_bytes", 0),
                                          ("peak_bf16_flops", float("nan")),
                                          ("inter_host_bandwidth", 0.0),
                                          ("usable_hbm_fraction", 1.5)])
def test_a_cluster_without_physical_figures_is_refused_naming_the_field(field, value):
    good = load_cluster("meshes/a100_2x8.py")
    with pytest.raises(ValueError, match=f"a100_2x8: {field} must be"):
        dataclasses.replace(good, **{field: value})


def test_calibration_in_workdir_overrides_defaults(tmp_path):
    save_calibration(tmp_path / "calibration" / "a100_16x8.json", Calibration(0.3, 0.4, 0.2))
    cluster = load_cluster("meshes/a100_16x8.py", workdir=str(tmp_path))
    assert (cluster.matmul_efficiency, cluster.hbm_efficiency, cluster.comm_efficiency) == \
        (0.3, 0.4, 0.2)
    assert load_cluster("meshes/a100_16x8.py").matmul_efficiency == 0.5
    with pytest.raises(ValueError, match="comm_efficiency"):
        Calibration(0.5, 0.5, 1.5)
