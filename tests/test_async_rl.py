"""Asynchronous RL (jaxrlhf.run.async_loop): η = 0 through the async path reproduces the
synchronous run's metrics exactly; η > 0 trains with staleness never above η (from per-token
versions), with generation really running ahead; checkpoints drain the pipeline."""

import json
import pathlib
import subprocess
import sys

import jax
import numpy as np
import pytest

from jaxrlhf import checkpoint
from jaxrlhf.data import datasets, tasks
from jaxrlhf.data.encode import prompt_batch
from jaxrlhf.mfc import Role
from jaxrlhf.parallel.layout import init_params
from jaxrlhf.run import async_loop, build
from jaxrlhf.run.check import check_config
from jaxrlhf.schema import base_config

STEPS = 3
LEARNING = ("reward", "actor/loss", "actor/kl", "actor/grad_norm", "actor/clip_frac",
            "actor/score", "actor/response_length", "critic/loss", "critic/grad_norm",
            "critic/values", "controller/kl_coef")


class _Metrics:
    """The metrics sink the loops write to, kept in memory."""

    def __init__(self):
        self.steps = {}

    def write(self, step, metrics):
        self.steps[step] = dict(metrics)


def _config(algorithm="ppo", staleness=0, **placement):
    config = base_config()
    config.algorithm = algorithm
    config.steps = STEPS
    config.rollout.update(batch_size=8, max_prompt_len=8, max_new_tokens=6)
    if algorithm == "grpo":
        config.rollout.update(batch_size=4, group_size=2)
    config.reward.workers = 1
    config.reward.function = (f"{pathlib.Path(__file__).parent / 'fixtures/reward_fns.py'}"
                              ":digit_count")
    config.async_rl.update(max_staleness=staleness, chunk_tokens=2)
    config.checkpoint.update(every=0, async_save=False)
    config.placement.update(placement)
    return config


@pytest.fixture(scope="module")
def rows():
    return tasks.make_reverse_task(tasks.ReverseTask(num_train=64, num_eval=8, num_sft=8)).train


def _fresh(job, pools):
    params = init_params(job.spec.models[Role.ACTOR].config,
                         job.plan.home(job.spec.graph, Role.ACTOR), jax.random.key(0))
    return build.fresh_runner(job, pools, params)


def _sync(config, rows, workdir):
    job = check_config(config, str(workdir))
    prompts = datasets.EpochIterator(rows, job.spec.rollout.batch_size, seed=job.spec.seed)
    out = []
    with build.host_pools(job.spec) as pools:
        runner = _fresh(job, pools)
        for _ in range(STEPS):
            batch = prompt_batch(next(prompts), job.tokenizer, 8, job.spec.rollout.group_size)
            out.append(runner.step(batch).metrics)
        runner.close()
    return out


def _async(config, rows, workdir):
    job = check_config(config, str(workdir))
    prompts = datasets.EpochIterator(rows, job.spec.rollout.batch_size, seed=job.spec.seed)
    sink = _Metrics()
    checkpoints = checkpoint.Checkpointer(workdir / "ckpt", job.spec.checkpoint)
    with build.host_pools(job.spec) as pools:
        runner = _fresh(job, pools)
        result = async_loop.rl_loop(job, runner, prompts, sink, checkpoints, 0.0)
        runner.close()
    checkpoints.close()
    return result, sink.steps, prompts


@pytest.mark.slow  # ~1 min on a free core: two PPO runs compile every MFC
def test_eta_zero_reproduces_the_synchronous_run(rows, tmp_path):
    want = _sync(_config(), rows, tmp_path / "sync")
    result, got, prompts = _async(_config(), rows, tmp_path / "async")
    assert sorted(got) == list(range(STEPS)) and not result.interrupted
    for step in range(STEPS):
        for key in LEARNING:
            assert got[step][key] == want[step][key], f"step {step} {key}"
        assert got[step]["async/staleness_max"] == 0
        assert got[step]["async/interrupted_sequences"] == 0
    assert result.extra["staleness_max"] == 0
    assert prompts.state().batch == STEPS  # nothing generated beyond the trained batches


@pytest.mark.slow
@pytest.mark.parametrize("algorithm", ["ppo", "grpo"])
def test_staleness_bounded_and_generation_runs_ahead(algorithm, rows, tmp_path):
    eta = 1
    result, got, prompts = _async(_config(algorithm, eta, kind="disaggregate"), rows, tmp_path)
    assert sorted(got) == list(range(STEPS))
    worst = [got[s]["async/staleness_max"] for s in range(STEPS)]
    assert max(worst) <= eta and result.extra["staleness_max"] == max(worst)
    # Batch 1 was started while update 0 ran, with version-0 weights: it is stale.
    assert max(worst) == eta
    for s in range(STEPS):
        fracs = [got[s][f"async/staleness_frac_{k}"] for k in range(eta + 1)]
        np.testing.assert_allclose(sum(fracs), 1.0, rtol=1e-6)
        # the decoupled objective ran: π_prox / π_behav is reported per token
        assert got[s]["actor/behav_imp_weight"] > 0
    assert result.extra["tokens_per_second"] > 0
    assert prompts.state().batch == STEPS


def test_checkpoints_drain_the_pipeline():
    # Generation may not start a batch at or past the next checkpoint step (or the run's end).
    assert async_loop._limit(trained=3, steps=40, every=4) == 4
    assert async_loop._limit(trained=4, steps=40, every=4) == 8
    assert async_loop._limit(trained=38, steps=40, every=4) == 40
    assert async_loop._limit(trained=3, steps=40, every=0) == 40


def test_stop_rewinds_to_the_first_untrained_batch(rows):
    prompts = datasets.EpochIterator(rows, 8, seed=0)
    states, batches = [], []
    for _ in range(4):
        states.append(prompts.state())
        batches.append(next(prompts))
    # batch 0 trained; 1 and 2 generated, waiting; 3 in flight: a stop drops 1..3.
    ready = [async_loop.Generated(k, {}, np.zeros((1, 1), np.int32), 0, states[k], (0.0, 0.0))
             for k in (1, 2)]
    async_loop._rewind(prompts, ready, states[3])
    assert not ready and prompts.state() == states[1]
    assert next(prompts) == batches[1]  # a resumed run generates batch 1 again
    async_loop._rewind(prompts, [], None)  # nothing generated ahead: nothing moves
    assert prompts.state() == states[2]


def test_batch_metrics_from_token_versions():
    versions_bn = np.array([[3, 3, 4, 4, -1], [5, 5, -1, -1, -1], [4, 4, 4, 4, 4]], np.int32)
    done = async_loop.Generated(7, {}, versions_bn, 2, None, (0.0, 1.0))
    m = async_loop._batch_metrics(done, version=5, eta=2)
    # staleness per token: [2 2 1 1], [0 0], [1 1 1 1 1]
    assert m["async/staleness_max"] == 2 and m["async/staleness_mean"] == 1.0
    assert m["async/interrupted_sequences"] == 1  # row 0 switched from version 3 to 4
    assert m["async/interruptions"] == 2
    assert [m[f"async/staleness_frac_{k}"] for k in range(3)] == [2 / 11, 7 / 11, 2 / 11]


@pytest.mark.slow
@pytest.mark.entry
@pytest.mark.parametrize("config", ["configs/ppo_tiny.py", "configs/grpo_tiny.py"])
def test_async_main_learns_like_sync(config, tmp_path):
    # The bar: η = 2 learns the task within the synchronous run's step budget.
    result = subprocess.run(
        [sys.executable, "-m", "jaxrlhf.train", f"--config={config}",
         "--config.async_rl.max_staleness=2", f"--workdir={tmp_path}"],
        capture_output=True, text=True, timeout=3000)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    assert summary["accuracy_after"] >= 0.85, summary
    assert 0 < summary["staleness_max"] <= 2 and summary["tokens_per_second"] > 0, summary
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    rl_rows = [r for r in rows if "async/staleness_max" in r]
    assert [r["step"] for r in rl_rows] == list(range(40))
    assert (tmp_path / "timeline_async.png").stat().st_size > 0


def test_disaggregate_puts_generation_on_its_own_devices():
    from jaxrlhf.dataflow.placement import Placement, PlacementError, resolve_placement
    from jaxrlhf.spec import run_spec

    specs = resolve_placement(run_spec(_config()).graph, Placement.DISAGGREGATE, 8)
    assert specs == {"actor_gen": "0-3:d4", "ref_inf": "4-7:d4", "critic_inf": "4-7:d4",
                     "actor_train": "4-7:d4", "critic_train": "4-7:d4"}
    grpo = run_spec(_config("grpo", 2, kind="disaggregate"))  # with the decoupled objective
    assert resolve_placement(grpo.graph, Placement.DISAGGREGATE, 6)["actor_prox"] == "3-5:d3"
    sft = base_config()
    sft.algorithm = "sft"
    with pytest.raises(PlacementError, match="disaggregate separates generation"):
        resolve_placement(run_spec(sft).graph, Placement.DISAGGREGATE, 8)
