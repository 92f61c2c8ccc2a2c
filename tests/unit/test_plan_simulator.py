"""Algorithm 1 on hand-built graphs with known answers, and the augmented PPO-like graph."""

import pytest

from jaxrlhf.dataflow.graph import build_graph
from jaxrlhf.mfc import MFC, Call, Role
from jaxrlhf.models.sizes import get_size
from jaxrlhf.parallel.strategy import DeviceRange
from jaxrlhf.plan.choice import CallChoice, ExecutionPlan
from jaxrlhf.plan.experiment import Experiment, Workload
from jaxrlhf.plan.simulator import Skeleton, Task, TaskKind, augmented_tasks, simulate

LOW, HIGH, ALL = DeviceRange(0, 3), DeviceRange(4, 7), DeviceRange(0, 7)


def mfc(name, seconds, devices, after=(), previous=()):
    return Task(name, TaskKind.MFC, seconds, (devices,), tuple(after), tuple(previous), name)


def test_serial_chain_adds_up():
    tasks = [mfc("a", 2, LOW), mfc("b", 3, HIGH, ["a"]), mfc("c", 1, ALL, ["b"])]
    sim = simulate(tasks, 8, num_steps=2)
    assert sim.step_seconds == 6
    assert sim.mfc_spans() == {"a": (0, 2), "b": (2, 5), "c": (5, 6)}
    assert sim.makespan == 12


def test_disjoint_calls_overlap():
    sim = simulate([mfc("a", 2, LOW), mfc("b", 3, HIGH)], 8, num_steps=1)
    assert sim.step_seconds == 3
    assert sim.mfc_spans(0) == {"a": (0, 2), "b": (0, 3)}


def test_overlapping_meshes_queue_in_dispatch_order():
    # d is ready at 0 but was dispatched after c, which waits for x: JAX runs c first.
    tasks = [mfc("x", 5, HIGH), mfc("c", 1, LOW, ["x"]), mfc("d", 1, DeviceRange(0, 1))]
    sim = simulate(tasks, 8, num_steps=1)
    assert sim.mfc_spans(0) == {"x": (0, 5), "c": (5, 6), "d": (6, 7)}
    partial = simulate([mfc("a", 2, LOW), mfc("b", 1, DeviceRange(2, 5))], 8, num_steps=1)
    assert partial.mfc_spans(0)["b"] == (2, 3)  # shares devices 2-3 with a


def _versioned(version_edge: bool):
    return [
        mfc("gen", 2, LOW, previous=["train"]),
        mfc("cinf", 1, LOW, ["gen"], ["ctrain"] if version_edge else []),
        mfc("train", 3, LOW, ["gen", "cinf"]),
        mfc("ctrain", 6, HIGH, ["cinf"]),
    ]


def test_parameter_versions_across_overlapping_steps():
    sim = simulate(_versioned(True), 8, num_steps=2, overlap_steps=True)
    first, second = sim.mfc_spans(0), {iv.task: (iv.start, iv.end) for iv in sim.step(1)}
    assert first == {"gen": (0, 2), "cinf": (2, 3), "train": (3, 6), "ctrain": (3, 9)}
    assert second["gen"] == (6, 8)  # waits for step 0's train
    assert second["cinf"] == (9, 10)  # waits for step 0's critic train, not only for gen
    assert second["ctrain"] == (10, 16)
    assert sim.step_seconds == 16 - 9
    unversioned = simulate(_versioned(False), 8, num_steps=2, overlap_steps=True)
    assert [(iv.start, iv.end) for iv in unversioned.step(1) if iv.task == "cinf"] == [(8, 9)]


def test_synchronous_steps_wait_for_the_previous_step():
    sim = simulate(_versioned(True), 8, num_steps=3, overlap_steps=False)
    assert sim.step_seconds == 9
    assert min(iv.start for iv in sim.step(1)) == 9 and sim.makespan == 27


def test_tasks_must_come_in_dispatch_order():
    with pytest.raises(ValueError, match="not dispatched before it"):
        simulate([mfc("b", 1, LOW, ["a"]), mfc("a", 1, LOW)], 8)
    with pytest.raises(ValueError, match="unknown task"):
        simulate([mfc("a", 1, LOW, previous=["zz"])], 8)


def _experiment(offload_frozen=False):
    graph = build_graph([
        MFC("actor_gen", Role.ACTOR, Call.GENERATE, ("prompts",), ("seq",)),
        MFC("ref_inf", Role.REF, Call.INFERENCE, ("seq",), ("ref_logp",)),
        MFC("actor_train", Role.ACTOR, Call.TRAIN_STEP, ("seq", "ref_logp")),
    ])
    tiny = get_size("tiny")
    return Experiment.of(graph, {Role.ACTOR: tiny, Role.REF: tiny}, Workload(8, 8, 8),
                         offload_frozen=offload_frozen)


SECONDS = {"actor_gen": 2.0, "ref_inf": 1.0, "actor_train": 3.0}


def _tasks(experiment, plan, realloc=0.5, offload=0.25):
    return augmented_tasks(Skeleton(experiment), plan, SECONDS, lambda *_: realloc,
                           lambda *_: offload)


def test_reallocation_is_inserted_when_layouts_differ():
    experiment = _experiment()
    plan = ExecutionPlan.of({
        "actor_gen": CallChoice(LOW, data=4), "ref_inf": CallChoice(HIGH, data=4),
        "actor_train": CallChoice(LOW, fsdp=4),
    })
    tasks = _tasks(experiment, plan)
    assert [t.name for t in tasks] == ["realloc:actor_gen", "actor_gen", "ref_inf", "actor_train"]
    realloc = tasks[0]
    assert realloc.devices == (LOW, LOW) and realloc.after_previous == ("actor_train",)
    sim = simulate(tasks, 8, num_steps=2)
    assert sim.step_seconds == 0.5 + 2 + 1 + 3
    # Same parameter layout as the train_step (only d and micro-batches differ): no copy.
    same = plan.replace(actor_gen=CallChoice(LOW, fsdp=4, micro_batches=2))
    assert [t.kind for t in _tasks(experiment, same)] == [TaskKind.MFC] * 3


def test_reallocation_occupies_both_meshes():
    experiment = _experiment()
    plan = ExecutionPlan.of({
        "actor_gen": CallChoice(HIGH, data=4), "ref_inf": CallChoice(HIGH, data=4),
        "actor_train": CallChoice(LOW, fsdp=4),
    })
    tasks = _tasks(experiment, plan)
    assert tasks[0].devices == (LOW, HIGH)
    sim = simulate(tasks, 8, num_steps=2)
    assert sim.step_seconds == 0.5 + 2 + 1 + 3


def test_offloaded_frozen_model_moves_around_its_call():
    experiment = _experiment(offload_frozen=True)
    plan = ExecutionPlan.of({
        "actor_gen": CallChoice(ALL, data=8), "ref_inf": CallChoice(ALL, data=8),
        "actor_train": CallChoice(ALL, data=8),
    })
    tasks = _tasks(experiment, plan)
    assert [t.name for t in tasks] == ["actor_gen", "onload:ref_inf", "ref_inf",
                                       "offload:ref_inf", "actor_train"]
    assert simulate(tasks, 8).step_seconds == 2 + 0.25 + 1 + 0.25 + 3
