"""`placement.compile_check`: a `placement.kind=auto` run compiles its best few searched plans
for its own devices after the input checks and runs the first that XLA says fits
(`calibration/compile_check.py`).

Resolving the candidates compiles nothing (a bad input is still one line first:
`test_bad_inputs.py`); grpo_tiny's calls compile in seconds, ppo_tiny's two plans in about half
a minute (-m slow).
"""

import dataclasses

import jax
import pytest

from jaxrlhf.configs import grpo_tiny, ppo_tiny
from jaxrlhf.data import tasks
from jaxrlhf.data.encode import prompt_batch
from jaxrlhf.parallel.layout import Platform
from jaxrlhf.plan import memory as memory_lib
from jaxrlhf.run import build
from jaxrlhf.run.check import check_config
from jaxrlhf.calibration.compile_check import choose
from jaxrlhf.run.layouts import COMPILE_CHECK_PLANS, searched_plans
from test_plan_auto import runtime_plan

ROWS = 16


def _config(module, compile_check: bool):
    config = module.get_config()
    config.rollout.batch_size = ROWS // config.rollout.group_size
    config.warm_start.sft_steps = 0
    config.placement.update(kind="auto", cluster="meshes/cpu_8.py", compile_check=compile_check)
    return config


def test_the_check_resolves_the_next_searched_plans_compiling_nothing(tmp_path):
    compiles = []
    listener = lambda event, *_, **__: compiles.append(event) if event in (
        "/jax/core/compile/backend_compile_duration",
        "/jax/compilation_cache/cache_retrieval_time_sec") else None
    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        config = _config(grpo_tiny, compile_check=True)
        job = check_config(config, str(tmp_path))
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    assert compiles == []
    plans = [job.plan.plan, *(j.plan.plan for j in job.fallbacks)]
    # the search's best plans, fastest first, each its own, each run as checked
    assert plans == searched_plans(job.spec, 8, COMPILE_CHECK_PLANS)
    assert len(set(plans)) == len(plans) == COMPILE_CHECK_PLANS
    assert all(not j.fallbacks and j.spec is job.spec for j in job.fallbacks)
    # Without the key the run is what it was: one plan, and nothing compiled after the checks.
    config.placement.compile_check = False
    plain = check_config(config, str(tmp_path))
    assert plain.plan.plan == plans[0] and plain.fallbacks == ()
    assert choose(plain) is plain


def _one_step(job) -> None:
    """A step of `job` on its plan; the plan the runner ran must be the job's."""
    rows = tasks.make_reverse_task(tasks.ReverseTask(num_train=ROWS, num_eval=8, num_sft=8))
    with build.host_pools(job.spec) as pools:
        runner = build.fresh_runner(job, pools)
        runner.step(prompt_batch(rows.train, job.tokenizer, job.spec.rollout.max_prompt_len))
        runner.close()
    assert runtime_plan(runner, ROWS) == job.plan.plan


def test_a_run_with_the_key_compiles_its_best_plan_and_trains_with_it(tmp_path):
    """grpo_tiny's three calls compiled for the 8 CPU devices (seconds), all within the
    cluster file's usable memory: the best plan runs, after plan --compile's table."""
    job = check_config(_config(grpo_tiny, compile_check=True), str(tmp_path))
    lines = []
    chosen = choose(job, log=lambda text: lines.extend(text.splitlines()))
    assert lines[0].startswith("compile check: 3 searched plans, best first, compiled for this "
                               "job's 8 CPU devices until one fits 1.68 GiB a device")
    header = next(i for i, line in enumerate(lines) if line.startswith("MFC"))
    assert lines[header].split()[:4] == ["MFC", "layout", "XLA", "GiB"]
    assert [line.split()[0] for line in lines[header + 2:header + 5]] == [
        "actor_gen", "ref_inf", "actor_train"]
    assert all(line.split()[6] == "yes" for line in lines[header + 2:header + 5])
    assert lines[-1] == "compile check: running plan 1"
    assert chosen.plan.plan == job.plan.plan and chosen.fallbacks == ()
    _one_step(chosen)


def _largest_model_bytes(job) -> float:
    """The memory model's largest call of the job's plan (own memory, batch left out)."""
    experiment = job.spec.experiment()
    return max(memory_lib.own_memory(experiment, job.spec.graph.mfc(name), choice,
                                     Platform.CPU).total for name, choice in job.plan.plan.items())


@pytest.mark.slow  # compiles two plans' calls (about 40 s on 2 loaded cores), then a step
def test_a_plan_xla_says_does_not_fit_falls_to_the_next_which_trains(tmp_path):
    """ppo_tiny's best searched plan puts the critic's train step on two devices, the next on
    four: with a limit between the two plans' largest calls, the first does not fit by XLA's
    account and the run trains with the second."""
    job = check_config(_config(ppo_tiny, compile_check=True), str(tmp_path))
    first, second = job, job.fallbacks[0]
    high, low = _largest_model_bytes(first), _largest_model_bytes(second)
    assert low < 0.85 * high  # room for the model's error (a few % on these calls)
    lines = []
    chosen = choose(job, limit=int((high + low) / 2),
                    log=lambda text: lines.extend(text.splitlines()))
    assert chosen.plan.plan == second.plan.plan and chosen.fallbacks == ()
    tables = [line for line in lines if line.startswith("MFC")]
    assert len(tables) == 2  # plan --compile's table, per plan tried
    text = "\n".join(lines)
    assert " NO " in text.split("plan 2:")[0] and " NO " not in text.split("plan 2:")[1]
    assert lines[-1] == "compile check: running plan 2"
    _one_step(chosen)


@pytest.mark.slow  # compiles grpo_tiny's three calls (about 25 s on 2 loaded cores)
def test_no_plan_that_fits_by_xla_is_one_line(tmp_path):
    from jaxrlhf.schema import ConfigError

    job = check_config(_config(grpo_tiny, compile_check=True), str(tmp_path))
    job = dataclasses.replace(job, fallbacks=())  # the best plan alone
    with pytest.raises(ConfigError, match=r"placement.compile_check: none of the 1 best searched "
                       r"plans fits 1.0 MiB a device \(meshes/cpu_8.py's usable memory\): in "
                       r"the best, actor_train \(.*\) needs \d+.\d MiB") as info:
        choose(job, limit=1 << 20, log=lambda line: None)
    assert "\n" not in str(info.value)
