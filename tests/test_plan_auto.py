"""Plans stay objects: `placement.kind=auto` runs exactly the searched plan, every placement kind
becomes its plan through one function (`run.layouts.execution_plan`), and the allocation text
of a plan (micro-batches included) round-trips."""

import jax
import numpy as np
import pytest

from jaxrlhf.configs.ppo_tiny import get_config
from jaxrlhf.data import tasks
from jaxrlhf.data.encode import prompt_batch
from jaxrlhf.mfc import Call
from jaxrlhf.plan.allocation import AllocationError, format_allocation, parse_allocation, plan_of
from jaxrlhf.plan.choice import CallChoice, ExecutionPlan
from jaxrlhf.run import build
from jaxrlhf.run.check import check_config
from jaxrlhf.run.layouts import execution_plan
from jaxrlhf.spec import run_spec

ROWS = 16


def _rows_per_call(engine) -> int:
    """Rows of the token batch one call of a generate/inference engine takes: the most rows
    of any int32 [rows, length] argument of its executables (the rollout engine's slots)."""
    return max(a.shape[0] for compiled in engine.compile_cache.executables()
               for a in jax.tree.leaves(compiled.args_info)
               if a.dtype == np.int32 and len(a.shape) == 2)


def runtime_plan(runner, batch_rows: int) -> ExecutionPlan:
    """What the runner ran, read off its engines: each MFC's layout and micro-batch count."""
    choices = {}
    for name, engine in runner.engines.items():
        if runner.graph.mfc(name).call is Call.TRAIN_STEP:
            micro = engine.microbatch_cfg.value
        else:
            micro = batch_rows // _rows_per_call(engine)
        choices[name] = CallChoice.of(engine.layout.strategy, micro_batches=micro)
    return ExecutionPlan.of(choices)


def test_auto_placement_runs_the_searched_plan(tmp_path):
    config = get_config()
    config.rollout.batch_size = ROWS
    config.warm_start.sft_steps = 0
    config.placement.update(kind="auto", cluster="meshes/cpu_8.py")
    job = check_config(config, str(tmp_path))  # searches once
    searched = job.plan.plan
    assert set(searched) == {m.name for m in job.spec.graph.mfcs if not m.host}
    rows = tasks.make_reverse_task(tasks.ReverseTask(num_train=ROWS, num_eval=8, num_sft=8))
    with build.host_pools(job.spec) as pools:
        runner = build.fresh_runner(job, pools)
        runner.step(prompt_batch(rows.train, job.tokenizer, config.rollout.max_prompt_len))
        runner.close()
    assert runtime_plan(runner, ROWS) == searched
    # The plan prints as text that a manual placement runs as the same plan.
    config.placement.update(kind="manual", allocation=format_allocation(searched), cluster="")
    assert check_config(config, str(tmp_path)).plan.plan == searched


@pytest.mark.slow  # the suite's time; test_placement_equivalence runs @2 micro-batches by default
def test_manual_micro_batches_reach_every_call_kind(tmp_path):
    config = get_config()
    config.rollout.batch_size = ROWS
    config.placement.update(kind="manual", allocation=(
        "actor_gen=0-7:d4t2@2,ref_inf=0-3:d4@4,critic_inf=4-7:d2t2@2,actor_train=0-7:d8@2,"
        "critic_train=4-7:d4"))
    job = check_config(config, str(tmp_path))
    assert job.plan.plan.micro_batches() == {"actor_gen": 2, "ref_inf": 4, "critic_inf": 2,
                                             "actor_train": 2, "critic_train": 1}
    rows = tasks.make_reverse_task(tasks.ReverseTask(num_train=ROWS, num_eval=8, num_sft=8))
    with build.host_pools(job.spec) as pools:
        runner = build.fresh_runner(job, pools)
        metrics = runner.step(prompt_batch(rows.train, job.tokenizer,
                                           config.rollout.max_prompt_len)).metrics
        runner.close()
    assert np.isfinite(metrics["actor/loss"])
    assert runtime_plan(runner, ROWS) == job.plan.plan


def test_allocation_text_round_trips():
    text = "actor_gen=0-3:d2t2@2,actor_train=0-7:d2f2t2@4,ref_inf=4-7:d4@1"
    plan = plan_of(parse_allocation(text))
    assert plan["actor_train"].micro_batches == 4 and plan["ref_inf"].dp_size == 4
    assert format_allocation(plan) == text
    assert plan_of(parse_allocation(format_allocation(plan))) == plan
    entry = parse_allocation("a=0-1:d2")["a"]
    assert entry.micro_batches is None and str(entry) == "0-1:d2"  # the run's default
    with pytest.raises(AllocationError, match=r"MFC 'a' \(0-1:d2\) has no micro-batch count"):
        plan_of({"a": entry})  # without the run's default, a count is needed


def test_every_placement_kind_becomes_the_plan_the_run_runs():
    """An MFC without `@N` gets the run's default: the configured train_step count; one for
    generate and inference, or on a pipeline up to its stage count."""
    config = get_config()
    config.micro_batches = 2
    config.placement.update(kind="manual", allocation=(
        "actor_gen=0-7:d8,ref_inf=0-3:d2p2,critic_inf=4-7:d4@2,actor_train=0-7:d8,"
        "critic_train=4-7:d4@1"))
    plan = execution_plan(run_spec(config), 8)
    assert plan.micro_batches() == {"actor_gen": 1, "ref_inf": 2, "critic_inf": 2,
                                    "actor_train": 2, "critic_train": 1}
    assert plan["ref_inf"].pipeline == 2 and plan["actor_train"].devices.size == 8
    config.placement.update(kind="colocate", strategy="d4t2", allocation="")
    colocated = execution_plan(run_spec(config), 8)
    assert {str(c) for _, c in colocated.items()} == {"0-7:d4t2@1", "0-7:d4t2@2"}
    assert colocated["actor_train"].micro_batches == 2


@pytest.mark.parametrize("text,message", [
    ("actor_gen0-3:d4", "is not MFC=RANGE:STRATEGY"),
    ("actor_gen=0-3:d4@0", "micro-batches '0' is not a count >= 1"),
    ("actor_gen=0-3:d4@x", "micro-batches 'x' is not a count >= 1"),
    ("actor_gen=0-3:x4", r"MFC 'actor_gen' \(0-3:x4\): unknown axis letter 'x'"),
    ("actor_gen=0-3:d2", r"MFC 'actor_gen' \(0-3:d2\): strategy '0-3:d2' uses 2 devices"),
    ("actor_gen=d4@2", r"MFC 'actor_gen' \(d4\): strategy d4 has no device range"),
])
def test_bad_allocation_text(text, message):
    with pytest.raises(AllocationError, match=message):
        parse_allocation(text)
