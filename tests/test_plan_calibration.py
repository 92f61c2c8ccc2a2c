"""The planner against this machine: memory vs the compiler, calibrated times vs real steps.

The memory test compiles the tiny PPO graph's calls (generate, log-prob and value inference,
actor and critic train_step) through the real runner and holds the memory model to XLA's
`memory_analysis()`. The calibration test fits cpu_8's efficiencies and overheads on timed MFCs
and then predicts a tiny PPO step at a batch size it did not see.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from jaxrlhf.configs.ppo_tiny import get_config
from jaxrlhf.mfc import Call, Role
from jaxrlhf.models.sizes import get_size
from jaxrlhf.parallel.strategy import DeviceRange
from jaxrlhf.calibration import calibrate, measure, validate
from jaxrlhf.plan import cost
from jaxrlhf.plan.choice import CallChoice
from jaxrlhf.plan.cluster import Calibration, load_cluster, save_calibration
from jaxrlhf.plan.experiment import Workload
from jaxrlhf.spec import run_spec
from jaxrlhf.plan.profile import profile_of

CPU_8 = "meshes/cpu_8.py"


def test_fit_recovers_efficiencies_and_overheads():
    truth = (0.3, 0.6, 0.8, 2e-4, 3e-3, 5e-4)  # efficiencies, layer/call/transfer overheads
    rng = np.random.default_rng(0)
    records = []
    for _ in range(16):
        compute, memory, comm = rng.uniform(1e-3, 0.2, size=3)
        launches, calls, arrays = rng.integers(0, 60, size=3).astype(float)
        c = cost.CallCost(compute, memory, comm, 1e-3, launches, calls, arrays)
        seconds = (compute / truth[0] + memory / truth[1] + comm / truth[2] + 1e-3
                   + launches * truth[3] + calls * truth[4] + arrays * truth[5])
        records.append((c, seconds))
    fitted = cost.fit_calibration(records, Calibration(0.5, 0.5, 0.5))
    assert (fitted.matmul_efficiency, fitted.hbm_efficiency, fitted.comm_efficiency,
            fitted.layer_overhead, fitted.call_overhead, fitted.array_overhead) == \
        pytest.approx(truth, rel=1e-6)
    # Terms no record exercises keep the defaults, overheads included.
    only_compute = cost.fit_calibration([(cost.CallCost(compute=1.0), 4.0)],
                                        Calibration(0.5, 0.7, 0.9, layer_overhead=1e-5))
    assert only_compute.matmul_efficiency == pytest.approx(0.25)
    assert (only_compute.hbm_efficiency, only_compute.comm_efficiency) == (0.7, 0.9)
    assert (only_compute.layer_overhead, only_compute.call_overhead) == (1e-5, None)
    with pytest.raises(ValueError, match="positive"):
        cost.fit_calibration([(cost.CallCost(compute=1.0), 0.0)], Calibration(0.5, 0.5, 0.5))


def test_calibration_file_sets_efficiencies_overheads_and_source(tmp_path):
    calibration = Calibration(0.2, 0.3, 0.4, source="fit on 3 MFC timings",
                              layer_overhead=5e-4, call_overhead=2e-3, array_overhead=1e-4)
    save_calibration(tmp_path / "calibration" / "cpu_8.json", calibration)
    cluster = load_cluster(CPU_8, workdir=str(tmp_path))
    assert cluster.calibration() == calibration
    assert (cluster.layer_overhead, cluster.call_overhead, cluster.array_overhead) == (
        5e-4, 2e-3, 1e-4)
    # None overheads keep the cluster file's.
    kept = load_cluster(CPU_8).calibrated(Calibration(0.2, 0.3, 0.4))
    assert kept.layer_overhead == load_cluster(CPU_8).layer_overhead
    with pytest.raises(ValueError, match="call_overhead"):
        Calibration(0.5, 0.5, 0.5, call_overhead=-1.0)


def test_costs_count_layer_launches_and_jit_calls():
    p = profile_of(get_size("tiny"))
    cluster = load_cluster(CPU_8)
    work = Workload(batch_size=32, prompt_len=16, new_tokens=8, mini_batches=2, epochs=3)
    on_8 = CallChoice(DeviceRange(0, 7), 8)
    per_pass = p.config.num_layers + 1
    gen = cost.generate_cost(p, work, on_8, cluster)
    assert (gen.launches, gen.calls) == (per_pass * (1 + work.new_tokens), 1)
    inf = cost.inference_cost(p, work, CallChoice(DeviceRange(0, 7), 8, micro_batches=2),
                              cluster)
    assert (inf.launches, inf.calls) == (2 * per_pass, 2)
    train = cost.train_cost(p, work, CallChoice(DeviceRange(0, 3), 4, micro_batches=2), cluster,
                            False)
    # Forward + backward per micro-batch, micro-batches inside one jit call per update.
    assert (train.launches, train.calls) == (work.updates * 2 * 2 * per_pass, work.updates)
    assert train.arrays == work.updates * len(p.leaves)  # the optimizer, array by array
    # A parameter movement moves each array on its own too.
    assert cost.offload_cost(p, on_8, cluster).arrays == len(p.leaves)
    realloc = cost.realloc_cost(p, on_8, CallChoice(DeviceRange(0, 7), 4, tensor=2), cluster)
    assert realloc.cost.arrays == len(p.leaves)
    priced = cost.CallCost(launches=10, calls=2, arrays=3).seconds(cluster)
    assert priced == pytest.approx(10 * cluster.layer_overhead + 2 * cluster.call_overhead
                                   + 3 * cluster.array_overhead)


def test_default_probes_cover_data_tensor_fsdp_and_pipeline_at_two_batch_sizes():
    probes = calibrate.default_probes(get_config(), load_cluster(CPU_8))
    assert [str(p) for p in probes] == ["d8@32", "d8@128", "d4t2@32", "d4t2@128", "f8@32",
                                        "f8@128", "d4p2@32", "d4p2@128"]
    assert calibrate.parse_probes("d8@32, d4t2@128") == (calibrate.Probe("d8", 32),
                                                         calibrate.Probe("d4t2", 128))
    with pytest.raises(ValueError, match="STRATEGY@PROMPTS"):
        calibrate.Probe.parse("d8")
    probed = calibrate.probe_config(get_config(), calibrate.Probe("d4t2", 128))
    assert (probed.placement.kind, probed.placement.strategy, probed.rollout.batch_size) == (
        "colocate", "d4t2", 128)


def test_batch_argument_bytes_counts_each_devices_shard():
    mesh = jax.make_mesh((4, 2), ("data", "tensor"), devices=jax.devices()[:8])
    rows = NamedSharding(mesh, PartitionSpec("data"))
    everywhere = NamedSharding(mesh, PartitionSpec())
    fn = jax.jit(lambda params, tokens_bt, rng: (params * 2, tokens_bt + 1, rng),
                 in_shardings=(everywhere, rows, everywhere))
    compiled = fn.lower(jnp.zeros((64, 64)), jnp.zeros((32, 16), jnp.int32),
                        jax.random.key(0)).compile()
    # tokens: 32/4 rows of 16 int32 per device; a threefry key is 8 bytes.
    assert validate.batch_argument_bytes(compiled) == 8 * 16 * 4 + 8
    # A donated argument (the rollout engine's slot state) is the model's `state`, not batch.
    donating = jax.jit(lambda params, state_bt, tokens_bt: (state_bt + tokens_bt, params),
                       in_shardings=(everywhere, rows, rows), donate_argnums=(1,))
    compiled = donating.lower(jnp.zeros((64, 64)), jnp.zeros((32, 16), jnp.int32),
                              jnp.zeros((32, 16), jnp.int32)).compile()
    assert validate.batch_argument_bytes(compiled) == 8 * 16 * 4


@pytest.fixture(scope="module")
def tiny_ppo_run():
    """The tiny PPO config's runner (frozen ref offloaded between calls) after one step."""
    config = get_config()
    config.placement.offload_frozen = True
    with measure.live_run(config) as run:
        run.steps(1)
        yield run


def test_memory_model_within_20_percent_of_compiled_calls(tiny_ppo_run):
    checks = validate.memory_checks(tiny_ppo_run, tiny_ppo_run.spec.experiment())
    calls = {tiny_ppo_run.spec.graph.mfc(name).call for name in checks}
    assert calls == set(Call) and len(checks) == 5  # gen, ref/critic inference, two trainers
    for name, (estimate, check) in checks.items():
        assert 0.8 <= check.arguments_ratio <= 1.2, (name, check)
        assert 0.8 <= check.temporaries_ratio <= 1.2, (name, check, estimate)


def test_live_run_plan_is_the_configured_colocated_plan(tiny_ppo_run):
    plan = tiny_ppo_run.plan
    assert {name: choice.spec() for name, choice in plan.items()} == {
        name: "0-7:d8" for name in ("actor_gen", "ref_inf", "critic_inf", "actor_train",
                                    "critic_train")}
    times, offloads = tiny_ppo_run.time_rounds(2)
    assert set(times) == set(plan)
    assert all(len(t.samples) == 2 and t.median > 0 for t in times.values())
    # The config offloads the frozen ref between its calls: that time is the ref_inf call's but
    # not its own. Only the frozen ref makes the timed trip to host memory and back.
    assert times["ref_inf"].moved_median > 0 and times["critic_inf"].moved_median == 0
    assert list(offloads) == [Role.REF] and offloads[Role.REF].median > 0


def test_validation_lines_up_every_mfc_and_the_step(tiny_ppo_run):
    result = validate.validate_run(tiny_ppo_run, load_cluster(CPU_8), steps=2)
    assert [c.name for c in result.mfcs] == ["actor_gen", "ref_inf", "critic_inf",
                                            "actor_train", "critic_train"]
    assert [(name, predicted) for name, predicted, _ in result.host] == [("reward", 0.0)]
    assert len(result.measured_steps) == 2 and result.measured_step > 0
    # ref_inf's prediction carries the onload and offload the runtime makes inside the call.
    ev = result.evaluation
    ref = next(c for c in result.mfcs if c.name == "ref_inf")
    assert ref.predicted == pytest.approx(ev.mfc_seconds["ref_inf"] + ev.movement_seconds[
        "onload:ref_inf"] + ev.movement_seconds["offload:ref_inf"])
    # Colocated on the same devices, the step is every call and movement one after the other.
    assert result.predicted_step == pytest.approx(sum(c.predicted for c in result.mfcs))
    table = validate.time_table(result)
    assert "not modelled" in table and table.count("\n") == 1 + 5 + 1 + 1
    assert validate.memory_table(result).count("\n") == 1 + 5


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["d4t2", "f8", "d2f2t2"])
def test_memory_model_within_20_percent_on_sharded_layouts(strategy):
    config = calibrate.probe_config(get_config(), calibrate.Probe(strategy, 32))
    with measure.live_run(config) as run:
        run.steps(1)
        checks = validate.memory_checks(run, run_spec(config).experiment())
    for name, (estimate, check) in checks.items():
        assert 0.8 <= check.arguments_ratio <= 1.2, (name, check)
        assert 0.8 <= check.temporaries_ratio <= 1.2, (name, check, estimate)


@pytest.mark.slow
def test_calibrated_step_estimate_within_30_percent_of_measured():
    """Calibrate on d8 at 32 and 128 prompts, then predict a 64-prompt step (not probed)."""
    cluster = load_cluster(CPU_8)
    probes = (calibrate.Probe("d8", 32), calibrate.Probe("d8", 128))
    config = get_config()
    config.rollout.batch_size = 64
    config.placement.offload_frozen = True
    with measure.live_run(config) as target:
        # Compiled first, so that its steps follow the probes' timings closely: the machine is
        # shared and its load drifts.
        target.steps(1)
        calibration, _ = calibrate.calibrate(get_config(), cluster, probes, repeats=7,
                                             interleave=True, log=lambda line: None)
        result = validate.validate_run(target, cluster.calibrated(calibration), steps=9)
    print(validate.time_table(result))
    assert math.isfinite(result.predicted_step)
    assert abs(result.step_error) < 0.3, validate.time_table(result)
