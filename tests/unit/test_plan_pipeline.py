"""The planner with pipeline stages: bubble, stage-to-stage sends, per-stage memory, the
Megatron-rule heuristic, and ReaL's searched 70B plan priced beside jaxrlhf's."""

import dataclasses
import importlib.util
import math
import pathlib
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest

from jaxrlhf.mfc import Call
from jaxrlhf.models.sizes import abstract_params, get_size
from jaxrlhf.parallel.strategy import Axis, DeviceRange, Strategy
from jaxrlhf.plan import cost, memory
from jaxrlhf.plan.allocation import format_allocation
from jaxrlhf.plan.choice import CallChoice, ExecutionPlan
from jaxrlhf.plan.cluster import Cluster, load_cluster
from jaxrlhf.plan.evaluate import Evaluator
from jaxrlhf.plan.experiment import DecodeSchedule, Workload
from jaxrlhf.plan.profile import profile_of
from jaxrlhf.plan.search import PlanResult, SearchOptions, SearchReport, heuristic, search
from jaxrlhf.spec import run_spec

ROOT = pathlib.Path(__file__).resolve().parents[2]
CLUSTER = Cluster(
    name="test_2x4", hosts=2, devices_per_host=4, hbm_bytes=10**9, peak_bf16_flops=1e12,
    hbm_bandwidth=1e11, intra_host_bandwidth=1e10, inter_host_bandwidth=1e9,
    host_link_bandwidth=5e8, matmul_efficiency=0.5, hbm_efficiency=0.5, comm_efficiency=0.5,
)
# Only matmuls cost anything: the schedule's shape shows in the compute term alone.
COMPUTE_ONLY = dataclasses.replace(
    CLUSTER, hbm_bandwidth=1e30, intra_host_bandwidth=1e30, inter_host_bandwidth=1e30,
    intra_host_latency=0.0, inter_host_latency=0.0)
WORK = Workload(batch_size=32, prompt_len=32, new_tokens=32, mini_batches=2)
SMALL = get_size("small", dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)


def _load(name: str, path: pathlib.Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up while it executes
    spec.loader.exec_module(module)
    return module


real_check = _load("real_check", ROOT / "benchmarks" / "real_check.py")


def _config(path: str, batch: int | None = None):
    config = _load(f"_cfg_{pathlib.Path(path).stem}", ROOT / path).get_config()
    if batch:
        config.rollout.batch_size = batch
    return config


def test_bubble_fraction():
    choice = CallChoice(DeviceRange(0, 7), tensor=2, micro_batches=8, pipeline=4)
    assert cost.schedule_slots(choice) == 11
    assert cost.bubble_fraction(choice) == pytest.approx(3 / 11)
    assert cost.bubble_fraction(CallChoice(DeviceRange(0, 7), data=8, micro_batches=8)) == 0


@pytest.mark.parametrize("micro", [1, 4, 16])
def test_pipelined_compute_is_the_stage_share_times_the_schedule(micro):
    """The executor runs M calls of 1/M of the rows; the pipeline streams each in g = gcd(M,
    its rows) pieces, a call g + p - 1 slots of a stage's share (1/p) of a piece (1/g of the
    call): compute = C (g+p-1)/(g p). 16 calls of 2 rows stream 2 pieces each, and idle in
    3 of their 5 slots."""
    p = profile_of(SMALL)
    stage = CallChoice(DeviceRange(0, 1), tensor=2)  # the whole batch on one stage's devices
    whole = cost.inference_cost(p, WORK, stage, COMPUTE_ONLY).compute
    piped = CallChoice(DeviceRange(0, 7), tensor=2, micro_batches=micro, pipeline=4)
    pieces = memory.streamed_micro_batches(WORK, Call.INFERENCE, piped)
    assert pieces == {1: 1, 4: 4, 16: 2}[micro]
    got = cost.inference_cost(p, WORK, piped, COMPUTE_ONLY).compute
    assert got == pytest.approx(whole * (pieces + 3) / (pieces * 4), rel=1e-12)


def test_decode_schedules():
    """jaxrlhf pays the bubble every token, ReaL keeps the pipeline full across tokens."""
    p = profile_of(SMALL)
    piped = CallChoice(DeviceRange(0, 7), tensor=2, micro_batches=4, pipeline=4)
    step = cost.decode_step_cost(p, WORK, piped, COMPUTE_ONLY).compute
    per_token, across = (cost.generate_cost(p, WORK, piped, COMPUTE_ONLY, schedule).compute
                         for schedule in (DecodeSchedule.PER_TOKEN, DecodeSchedule.ACROSS_TOKENS))
    # M + p - 1 = 7 slots against max(M, p) = 4, each a quarter of a micro-batch's step.
    assert per_token - across == pytest.approx(WORK.new_tokens * step * (7 - 4) / 4, rel=1e-9)
    unpiped = CallChoice(DeviceRange(0, 1), tensor=2, micro_batches=4)
    assert len({cost.generate_cost(p, WORK, unpiped, COMPUTE_ONLY, schedule).compute
                for schedule in DecodeSchedule}) == 1


def test_stage_remat_prices_one_more_forward_for_the_stage_inputs_only():
    """`Pipeline.remat_stages`: a stage keeps each iteration's input instead of its layers'
    saved activations, and recomputes its forward once more in the backward pass."""
    p = profile_of(SMALL)
    piped = CallChoice(DeviceRange(0, 7), tensor=2, micro_batches=4, pipeline=4)
    gpipe, staged = (memory.call_memory(p, Call.TRAIN_STEP, WORK, piped, remat_stages=r)
                     for r in (False, True))
    rows = WORK.rows_per_device(Call.TRAIN_STEP, piped.dp_size, piped.micro_batches)
    tokens = rows * WORK.seq_len
    per_stage = memory.saved_activation_bytes(p, tokens, WORK.seq_len, piped.tensor) / 4
    inputs = (4 + 3) * tokens * SMALL.hidden_size * p.act_itemsize
    assert gpipe.activations - staged.activations == pytest.approx(
        per_stage * 7 - (inputs + per_stage), abs=2)
    assert staged.activations < gpipe.activations
    flat = CallChoice(DeviceRange(0, 7), data=4, tensor=2, micro_batches=4)  # no stages: same
    assert (memory.call_memory(p, Call.TRAIN_STEP, WORK, flat, remat_stages=True)
            == memory.call_memory(p, Call.TRAIN_STEP, WORK, flat))
    plain, again = (cost.train_cost(p, WORK, piped, COMPUTE_ONLY, False, remat_stages=r).compute
                    for r in (False, True))
    assert again > plain and again - plain < plain / 3  # one forward of ~3 (+ the head's)


def test_the_planner_prices_the_runtimes_decode_schedule():
    """Generation on a pipelined layout decodes across tokens (engine/pipelined_decode.py);
    the planner prices that schedule unless told otherwise, and says so in its JSON."""
    from jaxrlhf.engine.pipelined_decode import runs_across_tokens
    from jaxrlhf.models.transformer import Transformer
    from jaxrlhf.parallel.layout import make_layout
    from jaxrlhf.parallel.pipeline import layer_stack
    from jaxrlhf.plan import report as report_lib

    stack = layer_stack(make_layout("0-1:p2", model=SMALL))
    assert runs_across_tokens(Transformer(SMALL, stack))
    assert stack.decode is DecodeSchedule.ACROSS_TOKENS
    experiment = run_spec(_config("configs/ppo_tiny.py")).experiment()
    assert experiment.decode is stack.decode
    p = profile_of(SMALL)
    piped = CallChoice(DeviceRange(0, 7), tensor=2, micro_batches=4, pipeline=4)
    assert (cost.generate_cost(p, WORK, piped, COMPUTE_ONLY).compute
            == cost.generate_cost(p, WORK, piped, COMPUTE_ONLY, stack.decode).compute)
    nothing = SearchReport(PlanResult("searched", None, None, "not searched"), {}, 0.0, 0)
    got = report_lib.to_json(nothing, CLUSTER, experiment.decode)
    assert got["decode_schedule"] == "across_tokens"


def test_stage_sends_use_the_inter_host_link_only_when_stages_span_hosts():
    across = CallChoice(DeviceRange(0, 7), data=4, micro_batches=2, pipeline=2)  # a host each
    inside = CallChoice(DeviceRange(0, 3), tensor=2, micro_batches=2, pipeline=2)
    assert cost.axis_link(CLUSTER, across, Axis.PIPELINE)[0] == CLUSTER.inter_host_bandwidth
    assert cost.axis_link(CLUSTER, inside, Axis.PIPELINE)[0] == CLUSTER.intra_host_bandwidth
    assert cost.axis_link(CLUSTER, across, Axis.DATA)[0] == CLUSTER.intra_host_bandwidth
    p = profile_of(SMALL)
    send = cost.stage_send(p, CLUSTER, across, tokens=100)
    assert send.comm == pytest.approx(100 * SMALL.hidden_size * 2 / CLUSTER.inter_host_bandwidth)
    assert cost.stage_send(p, CLUSTER, CallChoice(DeviceRange(0, 3), data=4), 100) == cost.ZERO


def test_stage_memory():
    """A stage holds 1/p of the layers (embedding and head whole) and GPipe keeps every
    iteration's saved activations."""
    p = profile_of(SMALL)
    layers = sum(leaf.size * leaf.itemsize for leaf in p.leaves if leaf.names[0] == "layers")
    rest = p.param_bytes - layers
    assert p.shard_bytes(1, 1, 2) == layers // 2 + rest
    stack = p.layer_shard_bytes(2) * SMALL.num_layers  # the layers, tensor-sharded
    assert p.shard_bytes(2, 1, 2) == p.shard_bytes(2, 1) - stack // 2
    one = memory.call_memory(p, Call.TRAIN_STEP, WORK, CallChoice(DeviceRange(0, 1), data=2,
                                                                   micro_batches=2))
    two = memory.call_memory(p, Call.TRAIN_STEP, WORK, CallChoice(
        DeviceRange(0, 3), data=2, micro_batches=2, pipeline=2))
    assert two.params < one.params and two.optimizer < one.optimizer
    saved = memory.saved_activation_bytes(p, WORK.rows(Call.TRAIN_STEP) // 4 * WORK.seq_len,
                                          WORK.seq_len, 1)
    assert two.activations - one.activations > saved * 3 / 2 - saved  # 3 iterations of 1/2


@pytest.mark.skipif("pipeline" not in {f.name for f in dataclasses.fields(Strategy)},
                    reason="the runtime's strategies have no pipeline axis yet")
@pytest.mark.parametrize("spec", ["p2t2f2", "d2p4", "p4t2"])
def test_pipelined_shard_bytes_equal_compiled_arguments(spec):
    from jaxrlhf.parallel.layout import make_layout

    cfg = get_size("small")
    layout = make_layout(spec, model=cfg)
    compiled = jax.jit(lambda p: p, in_shardings=(
        layout.param_shardings(abstract_params(cfg)),)).lower(
        nn.unbox(abstract_params(cfg))).compile()
    s = layout.strategy
    assert profile_of(cfg).shard_bytes(s.tensor, s.fsdp, s.pipeline) == \
        compiled.memory_analysis().argument_size_in_bytes


def test_heuristic_follows_megatrons_rules_for_70b_on_h100():
    """Megatron's rules: TP8 inside a host, the fewest pipeline stages that fit, DP over the
    rest, the fewest micro-batches (>= 2p) that fit. ReaL's Table 3 took PP4 × DP4 with 8
    micro-batches; with the optimizer state sliced over DP (ZeRO-1, as Megatron's
    distributed optimizer) and XLA:GPU's gradients priced in their two phases
    (`train_memory.gradient_phases`), one stage fits here: DP16 × TP8, one micro-batch. XLA agrees:
    compiled for 128 H100s (`plan --compile`), the actor's train step on 0-127:d16t8 needs
    57.39 GiB of the 67.06 usable (the model 55.45), the critic's 6.67 (6.92)."""
    experiment = run_spec(_config("configs/ppo_70b.py")).experiment()
    evaluator = Evaluator(experiment, load_cluster("meshes/h100_16x8.py"))
    result = heuristic(evaluator, (1, 2, 4, 8, 16, 32, 64))
    assert result.feasible
    for _, choice in result.plan.items():
        assert (choice.data, choice.fsdp, choice.tensor, choice.pipeline,
                choice.micro_batches) == (16, 1, 8, 1, 1)
        assert choice.devices == DeviceRange(0, 127)


def test_searched_70b_is_at_least_as_fast_as_reals_searched_plan():
    """Both priced by the same model (configs/ppo_70b.py on meshes/h100_16x8.py)."""
    cluster = load_cluster("meshes/h100_16x8.py")
    experiment = run_spec(_config("configs/ppo_70b.py")).experiment()
    report = search(experiment, cluster, SearchOptions(iterations=1500, seed=0))
    real = real_check.real_plan(experiment, "70B+7B", "searched")
    real_seconds = Evaluator(experiment, cluster).simulate(real).step_seconds
    assert report.searched.feasible
    assert report.searched.step_seconds <= real_seconds, format_allocation(report.searched.plan)


def test_real_check_prints_every_mfc_of_every_plan(capsys):
    result = real_check.main([])
    out = capsys.readouterr().out
    assert set(result["pricings"]) == {"file", "fit7B"}
    for name, pricing in result["pricings"].items():
        rows = pricing["rows"]
        assert len(rows) == 4 * 7  # four plans × (six MFCs + the step)
        for (case, kind), table in real_check.TABLES.items():
            mine = [r for r in rows if (r["case"], r["plan"]) == (case, kind)]
            assert [r["measured"] for r in mine[:6]] == [row.seconds for row in table]
            assert mine[6]["mfc"] == "End2End"
            assert mine[6]["measured"] == real_check.END2END[case, kind][0]
            for r in mine:
                assert math.isfinite(r["predicted"]) and r["predicted"] > 0
                assert r["error"] == pytest.approx(r["predicted"] / r["measured"] - 1)
        assert set(pricing["speedup_heuristic_over_searched"]) == {"7B+7B", "70B+7B"}
        assert f"pricing {name}" in out
    assert result["pricings"]["fit7B"]["calibration"]["source"].startswith("fit on ReaL's 7B")
    assert "70B+7B  heuristic  End2End" in out


def test_pipelined_allocation_round_trips():
    from jaxrlhf.plan.allocation import parse_allocation, plan_of

    plan = ExecutionPlan.of({
        "actor_train": CallChoice(DeviceRange(0, 127), data=4, tensor=2, micro_batches=64,
                                  pipeline=16),
        "actor_gen": CallChoice(DeviceRange(0, 15), data=4, tensor=2, micro_batches=2,
                                pipeline=2),
        "reward": CallChoice(DeviceRange(0, 7), data=4, tensor=2, micro_batches=16)})
    text = format_allocation(plan)
    assert "actor_train=0-127:d4p16t2@64" in text and "reward=0-7:d4t2@16" in text
    assert plan_of(parse_allocation(text)) == plan
