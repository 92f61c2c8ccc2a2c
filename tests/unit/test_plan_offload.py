"""The planner knows `placement.offload_trainable`: a trained model that shares its devices
waits in host memory between its calls (its parameters and optimizer state off the devices),
so a plan that only fits that way is found, and the host<->device transfers it costs are
priced over the cluster's host link (`Cluster.host_link_bandwidth`) in the simulated step.
"""

import dataclasses

import jax.numpy as jnp
import pytest

from jaxrlhf.dataflow.graph import build_graph
from jaxrlhf.mfc import MFC, Call, Role
from jaxrlhf.models.sizes import get_size
from jaxrlhf.parallel.strategy import DeviceRange
from jaxrlhf.plan.choice import CallChoice, ExecutionPlan
from jaxrlhf.plan.cluster import Cluster
from jaxrlhf.plan.evaluate import Evaluator
from jaxrlhf.plan.experiment import Experiment, Workload
from jaxrlhf.plan.train_memory import train_state_bytes
from jaxrlhf.plan.search import SearchOptions, search
from jaxrlhf.schema import base_config
from jaxrlhf.spec import run_spec

SMALL = get_size("small", dtype=jnp.bfloat16)
HOST_LINK = 5e9  # bytes/s each way, achieved at the cluster's comm_efficiency
# One device: actor and critic colocate. Usable 108 MB: one model's train step with its state
# fits (~100 MB by the memory model), not beside the other model's resident state (~148 MB).
ONE = Cluster(name="t1x1", hosts=1, devices_per_host=1, hbm_bytes=int(120e6),
              peak_bf16_flops=1e12, hbm_bandwidth=1e11, intra_host_bandwidth=1e10,
              inter_host_bandwidth=1e9, host_link_bandwidth=HOST_LINK)
TWO = dataclasses.replace(ONE, name="t1x2", devices_per_host=2)


def two_trainers(offload_trainable: bool) -> Experiment:
    graph = build_graph([
        MFC("actor_gen", Role.ACTOR, Call.GENERATE, ("prompts",), ("seq",)),
        MFC("actor_train", Role.ACTOR, Call.TRAIN_STEP, ("seq",)),
        MFC("critic_train", Role.CRITIC, Call.TRAIN_STEP, ("seq",)),
    ])
    critic = SMALL.replace(head=SMALL.head.SCALAR)
    return Experiment.of(graph, {Role.ACTOR: SMALL, Role.CRITIC: critic},
                         Workload(16, 64, 64, mini_batches=2),
                         offload_trainable=offload_trainable)


def test_the_run_spec_passes_offload_trainable_to_the_planner():
    config = base_config()
    assert not run_spec(config).experiment().offload_trainable
    config.placement.offload_trainable = True
    assert run_spec(config).experiment().offload_trainable


@pytest.fixture(scope="module")
def searched():
    options = SearchOptions(iterations=200, time_limit_s=10.0)
    return {flag: search(two_trainers(flag), ONE, options).searched for flag in (False, True)}


def test_a_plan_that_only_fits_with_offload_is_found(searched):
    assert searched[False].plan is None and "does not fit" in searched[False].reason
    found = searched[True].evaluation
    assert found.fits and found.step_seconds < float("inf")
    assert max(found.memory.peak.values()) <= ONE.usable_hbm_bytes


def test_offload_transfers_are_priced_over_the_host_link(searched):
    evaluation, plan = searched[True].evaluation, searched[True].plan
    experiment = two_trainers(True)
    moves = evaluation.movement_seconds
    rate = HOST_LINK * ONE.comm_efficiency
    for role, train in ((Role.ACTOR, "actor_train"), (Role.CRITIC, "critic_train")):
        state = sum(train_state_bytes(experiment.profile(role), plan[train], False))
        # The whole state comes back for the train step and goes to host after it.
        assert moves[f"onload:{train}"] == pytest.approx(state / rate, rel=1e-9)
        assert moves[f"offload:{train}"] == pytest.approx(state / rate, rel=1e-9)
    home = plan["actor_train"]  # generation reads the parameters only, onloaded on home
    params = experiment.profile(Role.ACTOR).shard_bytes(home.tensor, home.fsdp, home.pipeline)
    assert moves["onload:actor_gen"] == pytest.approx(params / rate, rel=1e-9)
    assert set(moves) <= {"onload:actor_gen", "realloc:actor_gen", "onload:actor_train",
                          "offload:actor_train", "onload:critic_train", "offload:critic_train"}
    # One device: everything runs one after the other, the transfers included.
    assert evaluation.step_seconds == pytest.approx(
        sum(evaluation.mfc_seconds.values()) + sum(moves.values()), rel=1e-9)
    # The same plan without offload is faster by exactly those transfers (it just does not fit).
    plain = Evaluator(two_trainers(False), ONE).evaluate(plan)
    assert not plain.fits and not plain.movement_seconds.keys() - {"realloc:actor_gen"}
    assert plain.sim is None


def test_a_model_alone_on_its_devices_stays_put():
    """As the runtime (`run.build.runtimes`): offload only where the devices are shared."""
    one, two = DeviceRange(0, 0), DeviceRange(1, 1)
    plan = ExecutionPlan.of({"actor_gen": CallChoice(one), "actor_train": CallChoice(one),
                             "critic_train": CallChoice(two)})
    experiment = two_trainers(True)
    devices = {name: choice.devices for name, choice in plan.items()}
    assert not experiment.offloads_state(Role.ACTOR, devices)
    evaluation = Evaluator(experiment, TWO).evaluate(plan)
    assert not evaluation.movement_seconds
    plain = Evaluator(two_trainers(False), TWO).evaluate(plan)
    assert evaluation.memory.peak == plain.memory.peak
    assert evaluation.step_seconds == plain.step_seconds
