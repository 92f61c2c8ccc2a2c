"""Plan search: annealing against exhaustive optima, baselines, memory rejection, the CLI."""

import dataclasses
import json
import math
import subprocess
import sys
import textwrap

import jax.numpy as jnp
import pytest

from jaxrlhf.dataflow.graph import build_graph
from jaxrlhf.dataflow.placement import Placement
from jaxrlhf.mfc import MFC, Call, Role
from jaxrlhf.models.sizes import get_size
from jaxrlhf.parallel.strategy import DeviceRange
from jaxrlhf.plan import report
from jaxrlhf.plan.choice import CallChoice, ExecutionPlan
from jaxrlhf.plan.cluster import Cluster, load_cluster
from jaxrlhf.plan.evaluate import Evaluator, SimOptions
from jaxrlhf.plan.experiment import Experiment, Workload
from jaxrlhf.spec import run_spec
from jaxrlhf.plan.search import SearchOptions, anneal, baseline, exhaustive, search
from jaxrlhf.plan.simulator import dispatch_order
from jaxrlhf.plan.space import Menu, SpaceOptions

SMALL = get_size("small", dtype=jnp.bfloat16)
# Tight memory: colocating everything must pick a slow strategy to fit (55 MB: with the
# optimizer state sliced over data parallelism, 60 MB left colocation 1.16x the optimum).
TWO_BY_TWO = Cluster(
    name="t2x2", hosts=2, devices_per_host=2, hbm_bytes=int(55e6), peak_bf16_flops=1e12,
    hbm_bandwidth=1e11, intra_host_bandwidth=1e10, inter_host_bandwidth=1e9,
    host_link_bandwidth=5e9,
)
# Slow links: the trainers scale badly, so running them side by side on disjoint devices wins.
ROOMY = Cluster(
    name="t1x4", hosts=1, devices_per_host=4, hbm_bytes=int(400e6), peak_bf16_flops=1e12,
    hbm_bandwidth=1e11, intra_host_bandwidth=2e8, inter_host_bandwidth=2e8,
    host_link_bandwidth=5e9,
)
MICRO = SpaceOptions(micro_batches=(1, 2), max_pipeline=2)


def gen_ref_train() -> Experiment:
    graph = build_graph([
        MFC("actor_gen", Role.ACTOR, Call.GENERATE, ("prompts",), ("seq",)),
        MFC("ref_inf", Role.REF, Call.INFERENCE, ("seq",), ("ref_logp",)),
        MFC("actor_train", Role.ACTOR, Call.TRAIN_STEP, ("seq", "ref_logp")),
    ])
    return Experiment.of(graph, {Role.ACTOR: SMALL, Role.REF: SMALL},
                         Workload(16, 64, 64, mini_batches=2))


def two_trainers() -> Experiment:
    graph = build_graph([
        MFC("actor_gen", Role.ACTOR, Call.GENERATE, ("prompts",), ("seq",)),
        MFC("actor_train", Role.ACTOR, Call.TRAIN_STEP, ("seq",)),
        MFC("critic_train", Role.CRITIC, Call.TRAIN_STEP, ("seq",)),
    ])
    critic = SMALL.replace(head=SMALL.head.SCALAR)
    return Experiment.of(graph, {Role.ACTOR: SMALL, Role.CRITIC: critic},
                         Workload(16, 64, 64, mini_batches=2))


@pytest.mark.parametrize("make, cluster, micro, stages, margin", [
    (gen_ref_train, TWO_BY_TWO, (1, 2, 4), 1, 1.5),
    (two_trainers, ROOMY, (1,), 1, 1.5),
    # Pipelines in the space: colocating everything with the best (d, f, t, p) comes close.
    (gen_ref_train, TWO_BY_TWO, (1, 2, 4), 4, 1.05),
])
def test_annealing_finds_the_exhaustive_optimum(make, cluster, micro, stages, margin):
    evaluator = Evaluator(make(), cluster)
    menu = Menu(evaluator, SpaceOptions(micro_batches=micro, max_pipeline=stages))
    optimum = evaluator.evaluate(exhaustive(menu)).step_seconds
    start = baseline(menu, Placement.COLOCATE)
    assert start.feasible and start.step_seconds > margin * optimum  # the search has work to do
    found = anneal(menu, start.plan, SearchOptions(iterations=3000, seed=1))
    assert evaluator.evaluate(found).step_seconds == pytest.approx(optimum, rel=1e-12)


def test_the_two_trainers_optimum_runs_them_side_by_side():
    evaluator = Evaluator(two_trainers(), ROOMY)
    best = exhaustive(Menu(evaluator, SpaceOptions(micro_batches=(1,), max_pipeline=1)))
    assert not best["actor_train"].overlaps(best["critic_train"])
    spans = evaluator.evaluate(best).sim.mfc_spans()
    assert spans["critic_train"][0] < spans["actor_train"][1]  # they overlap in time


def test_pareto_pruning_keeps_the_optimum():
    pruned, full = Evaluator(gen_ref_train(), TWO_BY_TWO), Evaluator(gen_ref_train(), TWO_BY_TWO)
    pruned_menu = Menu(pruned, MICRO)
    full_menu = Menu(full, SpaceOptions(micro_batches=MICRO.micro_batches,
                                        max_pipeline=MICRO.max_pipeline, prune=False))
    assert sum(map(full_menu.count, full_menu.configs)) > sum(
        map(pruned_menu.count, pruned_menu.configs))
    best = pruned.evaluate(exhaustive(pruned_menu)).step_seconds
    assert full.evaluate(exhaustive(full_menu)).step_seconds == pytest.approx(best, rel=1e-12)


def test_overlapping_steps_hide_a_long_critic_train():
    experiment = two_trainers()
    sync, overlap = Evaluator(experiment, ROOMY), Evaluator(
        experiment, ROOMY, SimOptions(num_steps=3, overlap_steps=True))
    plan = ExecutionPlan.of({
        "actor_gen": CallChoice(DeviceRange(0, 0)),
        "actor_train": CallChoice(DeviceRange(0, 0)),
        "critic_train": CallChoice(DeviceRange(2, 3), data=2),  # slow links: slower than one
    })
    seconds = sync.evaluate(plan).mfc_seconds
    assert seconds["critic_train"] > seconds["actor_train"]
    # Synchronous: gen, then both trainers; overlapped: the next gen starts after actor_train.
    assert sync.evaluate(plan).step_seconds == pytest.approx(
        seconds["actor_gen"] + seconds["critic_train"])
    assert overlap.evaluate(plan).step_seconds == pytest.approx(
        max(seconds["actor_gen"] + seconds["actor_train"], seconds["critic_train"]))


def test_memory_model_rejects_with_the_reason():
    evaluator = Evaluator(gen_ref_train(), TWO_BY_TWO)
    plan = ExecutionPlan.of({
        "actor_gen": CallChoice(DeviceRange(0, 1), data=2),
        "ref_inf": CallChoice(DeviceRange(2, 3), data=2),
        "actor_train": CallChoice(DeviceRange(0, 1), fsdp=2),
    })
    result = evaluator.evaluate(plan)
    assert not result.fits and math.isinf(result.step_seconds)
    (violation,) = [v for v in result.memory.violations if v.mfc == "actor_train"]
    assert violation.needed > violation.available == TWO_BY_TWO.usable_hbm_bytes
    assert violation.device in (0, 1)
    assert "MFC actor_train does not fit on device" in str(violation)
    assert "optimizer" in str(violation) and "usable" in str(violation)
    menu = Menu(evaluator, MICRO)
    split = baseline(menu, Placement.SPLIT)  # actor on 2 devices cannot train
    assert not split.feasible and "actor_train" in split.reason


def test_baselines_follow_resolve_placement():
    experiment = gen_ref_train()
    menu = Menu(Evaluator(experiment, ROOMY), MICRO)
    inter = baseline(menu, Placement.INTERLEAVE)
    assert inter.plan["actor_gen"].devices == DeviceRange(0, 3)
    assert inter.plan["ref_inf"].devices == DeviceRange(0, 1)
    colo = baseline(menu, Placement.COLOCATE)
    degrees = {(c.data, c.fsdp, c.tensor) for _, c in colo.plan.items()}
    assert len(degrees) == 1 and {c.devices for _, c in colo.plan.items()} == {DeviceRange(0, 3)}


def test_a_whole_slice_cluster_places_calls_on_one_device_or_all():
    """On a `whole_slice` cluster (libtpu's v5e) every searched and baseline call spans one
    device or all of them; the part-slice baselines are refused with the reason."""
    whole = dataclasses.replace(ROOMY, whole_slice=True)
    assert {r.size for r in whole.device_ranges()} == {1, 4}
    with pytest.raises(ValueError, match="whole_slice"):
        whole.check_devices(DeviceRange(0, 1))
    experiment = gen_ref_train()
    result = search(experiment, whole, SearchOptions(iterations=300), space=MICRO)
    assert result.searched.feasible
    assert {c.devices.size for _, c in result.searched.plan.items()} <= {1, 4}
    split = result.baselines["split"]
    assert split.plan is None and "whole_slice" in split.reason


def test_search_report_tables():
    experiment = gen_ref_train()
    result = search(experiment, TWO_BY_TWO, SearchOptions(iterations=500), space=MICRO)
    assert result.searched.step_seconds <= result.best_baseline.step_seconds
    table = report.plan_table(result.searched, TWO_BY_TWO, dispatch_order(experiment))
    assert table.splitlines()[1].split() == ["MFC", "device", "mesh", "strategy",
                                            "#micro-batches", "est.", "seconds",
                                            "peak", "GiB/device"]
    assert "actor_train" in table and "step time:" in table
    assert "searched speedup" in report.summary(result)
    assert report.allocation(result.searched).count("=") == 3


def test_experiment_from_the_config_schema():
    from jaxrlhf.schema import base_config

    config = base_config()
    experiment = run_spec(config).experiment()
    assert experiment.graph.mfc("reward").host  # reward.kind == "function"
    assert Role.REWARD not in dict(experiment.models)
    assert experiment.workload.batch_size == config.rollout.batch_size
    config.reward.kind = "model"
    config.ppo.mini_batches = 4
    experiment = run_spec(config).experiment()
    assert not experiment.graph.mfc("reward").host and experiment.workload.updates == 4
    assert experiment.model(Role.CRITIC).head is SMALL.head.SCALAR


PPO_70B = textwrap.dedent("""
    from jaxrlhf.schema import base_config

    def get_config(arg=None):
        config = base_config()
        sizes = dict(actor="llama3-70b", ref="llama3-70b", critic="llama3-7b",
                     reward="llama3-7b")
        for role, size in sizes.items():
            model = config.models[role]
            model.size, model.dtype, model.param_dtype, model.remat = (
                size, "bfloat16", "bfloat16", "full")
        config.reward.kind = "model"
        config.rollout.batch_size = 512
        config.rollout.max_prompt_len = 1024
        config.rollout.max_new_tokens = 1024
        config.ppo.mini_batches = 8
        config.optimizer.actor.fp32_master = True
        config.optimizer.critic.fp32_master = True
        return config
""")


def test_cli_plans_70b_on_a100_16x8(tmp_path):
    config = tmp_path / "ppo_70b.py"
    config.write_text(PPO_70B)
    out = subprocess.run(
        [sys.executable, "-m", "jaxrlhf.plan", f"--config={config}",
         "--cluster=meshes/a100_16x8.py", "--json", "--iterations=3000", "--seed=3",
         "--config.placement.kind=manual", f"--config.placement.allocation={CONFIGURED}"],
        capture_output=True, text=True, timeout=300, check=True,
    )
    result = json.loads(out.stdout)
    plans = result["plans"]
    assert set(plans) == {"searched", "colocate", "standalone", "split", "interleave",
                          "heuristic", "configured"}
    usable = load_cluster("meshes/a100_16x8.py").usable_hbm_bytes
    searched = plans["searched"]
    assert set(searched["mfcs"]) == {"actor_gen", "reward", "ref_inf", "critic_inf",
                                     "actor_train", "critic_train"}
    for mfc in searched["mfcs"].values():
        assert 0 < mfc["peak_bytes_per_device"] <= usable and mfc["seconds"] > 0
    for name in ("colocate", "standalone", "split", "interleave", "heuristic"):
        assert plans[name]["step_seconds"] is not None, plans[name]
        assert searched["step_seconds"] < plans[name]["step_seconds"], name
    # Under 60 s of this process's CPU (the wall clock of a shared machine counts others' work).
    assert result["search_cpu_seconds"] < 60 and result["search_seconds"] > 0
    configured = plans["configured"]  # the allocation, priced: every MFC, `@N` honoured
    assert configured["allocation"] == CONFIGURED
    assert set(configured["mfc_seconds"]) == set(searched["mfcs"])
    assert configured["mfc_seconds"] == {k: v["seconds"] for k, v in configured["mfcs"].items()}
    assert configured["step_seconds"] > 0


# An interleaved plan that fits, micro-batches as written.
CONFIGURED = ("actor_gen=0-127:d16t8@1,actor_train=0-127:d2f8t8@2,critic_inf=0-127:d128@1,"
              "critic_train=0-127:d16f2t4@1,ref_inf=0-63:d8f8@1,reward=64-127:f32t2@16")


def test_cli_configured_allocation_that_does_not_split_is_a_config_error(tmp_path):
    config = tmp_path / "ppo_70b.py"
    config.write_text(PPO_70B)
    out = subprocess.run(
        [sys.executable, "-m", "jaxrlhf.plan", f"--config={config}",
         "--cluster=meshes/a100_16x8.py", "--config.placement.kind=manual",
         "--config.placement.allocation=" + CONFIGURED.replace("d16t8@1", "d128@8")],
        capture_output=True, text=True, timeout=300)
    assert out.returncode == 2, out.stderr
    assert out.stderr.strip().splitlines() == [  # the run's own check (run.layouts), word for word
        "error: placement.allocation: MFC 'actor_gen': 8 micro-batches do not split 512 rows "
        "into equal parts with a multiple of 128 rows each; valid counts: [1, 2, 4]"]
