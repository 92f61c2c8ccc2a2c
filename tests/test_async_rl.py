"""Asynchronous RL (jaxrlhf.run.async_loop): η = 0 through the async path reproduces the
synchronous run's metrics exactly; η > 0 trains with staleness never above η (from per-token
versions), with generation really running ahead; checkpoints drain the pipeline. The
multi-process source of the one loop (`async_procs.RemoteSource`) is tested here through
checkpoints, evaluation, SIGTERM and Ctrl-C and resume; the one-process source through resume,
stops and the NaN policy in tests/test_resume.py."""

import json
import pathlib
import re
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
from jaxrlhf.run import async_loop, async_steps, build, rollout_worker
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
    config.async_rl.max_staleness = staleness
    if staleness:  # read by the rollout workers of an asynchronous run only (else refused)
        config.async_rl.chunk_tokens = 2
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
        result = async_loop.rl_loop(job, runner, prompts, sink, checkpoints, {})
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


# grpo (no critic, ~20 s) runs by default: the suite's one run of the in-process async loop
@pytest.mark.parametrize("algorithm", [pytest.param("ppo", marks=pytest.mark.slow), "grpo"])
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
    assert async_steps.drain_limit(trained=3, steps=40, every=4) == 4
    assert async_steps.drain_limit(trained=4, steps=40, every=4) == 8
    assert async_steps.drain_limit(trained=38, steps=40, every=4) == 40
    assert async_steps.drain_limit(trained=3, steps=40, every=0) == 40


def test_generation_runs_ahead_only_to_fill_slots_of_the_batch_the_trainer_needs():
    # Update 3 runs (weights of version 3): the trainer takes batch 4 next; η = 2.
    start = lambda index, finished: async_steps.may_start(
        index, version=3, eta=2, next_needed=4, finished=finished)
    assert start(4, finished=set())  # the trainer needs it
    assert start(5, finished=set())  # batch 4 still decodes: batch 5's rows fill its slots
    assert not start(5, finished={4})  # batch 4 is ready: the trainer is the bottleneck
    assert not start(6, finished=set())  # 6 > 3 + η
    # No update running (the trainer waits for batch 4): as far ahead as η allows.
    assert async_steps.may_start(5, version=4, eta=2, next_needed=4, finished=set())


def test_stop_rewinds_to_the_first_untrained_batch(rows):
    prompts = datasets.EpochIterator(rows, 8, seed=0)
    states, batches = [], []
    for _ in range(4):
        states.append(prompts.state())
        batches.append(next(prompts))
    # batch 0 trained; 2 and 1 generated (in that order), waiting; 3 in flight: a stop drops
    # 1..3.
    ready = {k: rollout_worker.Generated(k, {}, np.zeros((1, 1), np.int32), 0, states[k],
                                         (0.0, 0.0)) for k in (2, 1)}
    async_loop._rewind(prompts, ready, (3, states[3]))
    assert not ready and prompts.state() == states[1]
    assert next(prompts) == batches[1]  # a resumed run generates batch 1 again
    async_loop._rewind(prompts, {}, None)  # nothing generated ahead: nothing moves
    assert prompts.state() == states[2]


def test_batch_metrics_from_token_versions():
    versions_bn = np.array([[3, 3, 4, 4, -1], [5, 5, -1, -1, -1], [4, 4, 4, 4, 4]], np.int32)
    done = rollout_worker.Generated(7, {}, versions_bn, 2, None, (0.0, 1.0), slots_idle=0.25)
    m = async_steps.batch_metrics(done, version=5, eta=2)
    # staleness per token: [2 2 1 1], [0 0], [1 1 1 1 1]
    assert m["async/staleness_max"] == 2 and m["async/staleness_mean"] == 1.0
    assert m["async/interrupted_sequences"] == 1  # row 0 switched from version 3 to 4
    assert m["async/interruptions"] == 2
    assert [m[f"async/staleness_frac_{k}"] for k in range(3)] == [2 / 11, 7 / 11, 2 / 11]
    assert m["async/gen_seconds"] == 1.0 and m["async/response_length_longest"] == 5
    assert m["async/decode_padding_frac"] == 0.25  # the slots' idle share, as measured


def test_the_staleness_bound_holds_for_the_oldest_token():
    """A row that went on under newer weights (on_new_version=continue) is as old as its
    oldest token: the bound refuses it though most of its tokens are fresh."""
    versions_bn = np.array([[2, 4, 4, 4], [4, 4, -1, -1]], np.int32)
    done = rollout_worker.Generated(4, {}, versions_bn, 1, None, (0.0, 1.0))
    async_steps.check_staleness(done, version=4, eta=2)
    with pytest.raises(AssertionError, match="batch 4: a token 2 versions old"):
        async_steps.check_staleness(done, version=4, eta=1)


# restart by default (~20 s on a free core): the mode whose rows leave and come back
@pytest.mark.parametrize("mode", [pytest.param("continue", marks=pytest.mark.slow), "restart",
                                  pytest.param("finish", marks=pytest.mark.slow)])
def test_partial_rollouts_train_every_batch_within_the_bound(mode, rows, tmp_path):
    """async_rl.on_new_version in the one-process loop: every batch is trained, no token
    older than η; only restart discards rows (and counts their tokens)."""
    config = _config("grpo", 1, kind="disaggregate")
    config.async_rl.on_new_version = mode
    result, got, prompts = _async(config, rows, tmp_path)
    assert sorted(got) == list(range(STEPS)) and not result.interrupted
    assert max(got[s]["async/staleness_max"] for s in range(STEPS)) <= 1
    restarted = sum(got[s]["async/restarted_rows"] for s in range(STEPS))
    discarded = sum(got[s]["async/discarded_tokens"] for s in range(STEPS))
    if mode == "restart":
        assert discarded >= restarted  # a restarted row had sampled at least its first token
    else:
        assert restarted == discarded == 0
    assert prompts.state().batch == STEPS


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

    # The trainer's block first (multi-process: process 0), then replica 1's.
    specs = resolve_placement(run_spec(_config()).graph, Placement.DISAGGREGATE, 8)
    assert {k: str(v) for k, v in specs.items()} == {
        "actor_gen": "4-7:d4", "ref_inf": "0-3:d4", "critic_inf": "0-3:d4",
        "actor_train": "0-3:d4", "critic_train": "0-3:d4"}
    grpo_config = _config("grpo", 2, kind="disaggregate")
    grpo_config.ppo.mini_batches = 2  # two updates a batch: the decoupled objective's actor_prox
    grpo = run_spec(grpo_config)
    assert str(resolve_placement(grpo.graph, Placement.DISAGGREGATE, 6)["actor_prox"]) == "0-2:d3"
    # Two replicas: three equal blocks; replica 2's (4-5) is implied.
    three = resolve_placement(grpo.graph, Placement.DISAGGREGATE, 6, gen_replicas=2)
    assert str(three["actor_gen"]) == "2-3:d2" and str(three["actor_train"]) == "0-1:d2"
    with pytest.raises(PlacementError, match="gen_replicas=2: 8 devices do not split into 3"):
        resolve_placement(grpo.graph, Placement.DISAGGREGATE, 8, gen_replicas=2)
    sft = base_config()
    sft.algorithm = "sft"
    with pytest.raises(PlacementError, match="disaggregate separates generation"):
        resolve_placement(run_spec(sft).graph, Placement.DISAGGREGATE, 8)


@pytest.mark.parametrize("update, message", [
    ({"placement.gen_replicas": 0}, "placement.gen_replicas=0: must be >= 1"),
    ({"placement.gen_replicas": 2}, "placement.gen_replicas=2: generation replicas need "
                                    "placement.kind=disaggregate and async_rl.max_staleness > 0"),
    ({"placement.gen_replicas": 2, "placement.kind": "disaggregate"},
     "placement.gen_replicas=2: generation replicas need"),
])
def test_bad_gen_replicas_is_one_line(update, message):
    from jaxrlhf.spec import ConfigError, run_spec

    config = _config("ppo", 0)
    for key, value in update.items():
        section, name = key.split(".")
        config[section][name] = value
    with pytest.raises(ConfigError) as error:
        run_spec(config)
    assert message in str(error.value) and "\n" not in str(error.value)


def test_schedule_keeps_every_batch_within_its_deadline():
    """Batches may arrive in any order; training one first is allowed only if every other
    outstanding batch can still be trained by its deadline (issue version + η)."""
    from jaxrlhf.run.async_procs import schedulable

    assert schedulable([], 5)
    assert schedulable([5, 6, 7], 5) and not schedulable([5, 5], 5)
    assert schedulable([7, 5, 6], 5)  # order does not matter
    assert not schedulable([4], 5)  # already too old
    # η = 1, two replicas: batches 0 and 1 issued at version 0 (deadlines 1, 1)? Not
    # schedulable from update 0 with a third at deadline 1; the issuer stops at two.
    assert schedulable([1, 1], 0) and not schedulable([1, 1, 1], 0)
    # Brute force: any arrival order trained by the rule keeps staleness <= η.
    rng = np.random.default_rng(0)
    for _ in range(200):
        eta = int(rng.integers(0, 4))
        version, issued, outstanding, arrived = 0, 0, {}, []
        while version < 30:
            while issued < 40 and len(outstanding) < 6 and schedulable(
                    list(outstanding.values()) + [version + eta], version):
                outstanding[issued] = version + eta
                issued += 1
            not_arrived = [k for k in outstanding if k not in arrived]
            if not_arrived and rng.random() < 0.6:
                arrived.append(int(rng.choice(not_arrived)))
            pick = next((k for k in arrived if schedulable(
                [d for j, d in outstanding.items() if j != k], version + 1)), None)
            if pick is None:
                continue
            assert version <= outstanding.pop(pick), "trained past its deadline"
            arrived.remove(pick)
            version += 1


# --- multi-process (trainer process + generation replica processes) ---------------------------

WAIT_S = 3


def _channel_worker(address: str, process_id: int) -> None:
    """One process of `test_a_batch_that_never_comes_stops_the_trainer_naming_it`."""
    from jaxrlhf import distributed
    from jaxrlhf.backend import use_cpu_devices

    cfg = distributed.from_flags(address, 2, process_id, heartbeat_timeout_s=5)
    use_cpu_devices(1)
    distributed.initialize(cfg)
    from jaxrlhf.run.async_procs import waiting_for
    from jaxrlhf.run.channel import Channel, Deadline

    chan = Channel("test")
    if process_id == 1:  # a replica that sends batch 4, then hangs before batch 5
        chan.put_arrays("batch/4", {"versions_bn": np.arange(6, dtype=np.int32).reshape(2, 3)},
                        {"replica": 1})
        import time

        time.sleep(300)
        return
    deadline = Deadline(WAIT_S, 0)
    got = None
    while got is None:
        got = chan.take_arrays("batch/4")
    arrays, meta = got
    assert meta == {"replica": 1} and arrays["versions_bn"].tolist() == [[0, 1, 2], [3, 4, 5]]
    assert chan.take_arrays("batch/4") is None  # taken: deleted
    print("got batch 4", flush=True)
    deadline.progress()
    while chan.take_arrays("batch/5") is None:
        deadline.check(lambda: waiting_for(2, {5: 1}))


def test_a_batch_that_never_comes_stops_the_trainer_naming_it(tmp_path):
    """Two real processes under jax.distributed (no model, seconds): a batch crosses the
    coordination service intact, and a wait for one that never comes ends the trainer within
    the deadline with one line naming the step, the batch, the replica and the process."""
    import os
    import time

    from jaxrlhf.distributed import reserve_port

    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env.update(JAX_PLATFORMS="cpu", PYTHONPATH=str(pathlib.Path(__file__).parent.parent))
    with reserve_port() as sock:
        address = f"127.0.0.1:{sock.getsockname()[1]}"
        procs = [subprocess.Popen([sys.executable, __file__, "channel", address, str(i)],
                                  env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                  text=True) for i in range(2)]
        try:
            first = procs[0].stdout.readline()  # after both started JAX and joined the job
            start = time.monotonic()
            out, err = procs[0].communicate(timeout=120)
            out, seconds = first + out, time.monotonic() - start
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
    assert "got batch 4" in out, err[-2000:]
    assert procs[0].returncode == 1, err[-2000:]
    line = ("jaxrlhf: process 0: step 2: finished batch(es) [5] from generation replica(s) [1] "
            f"(processes [1]) did not arrive within {WAIT_S} s; stopping the job")
    assert line in err, err[-2000:]
    assert seconds < WAIT_S + 30, seconds


def _two_process_train(workdir: pathlib.Path, extra: list[str],
                       replicas: int = 1) -> subprocess.Popen:
    """`launch/local.sh 1+replicas python -m jaxrlhf.train ...` (2 CPU devices per process with
    two replicas: 8 devices do not split in three)."""
    import os

    repo = pathlib.Path(__file__).parent.parent
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env.update(JAX_PLATFORMS="cpu", LOG_DIR=str(workdir.parent / f"{workdir.name}-logs"))
    if replicas > 1:
        extra = [f"--config.placement.gen_replicas={replicas}",
                 f"--config.cpu_devices={2 * (1 + replicas)}", *extra]
    command = [str(repo / "launch/local.sh"), str(1 + replicas), sys.executable, "-m",
               "jaxrlhf.train",
               "--config=configs/ppo_tiny.py", f"--workdir={workdir}", "--config.steps=6",
               "--config.warm_start.sft_steps=2", "--config.data.task.num_eval=8",
               "--config.reward.workers=1", "--config.async_rl.max_staleness=2",
               "--config.placement.kind=disaggregate", "--wait_timeout=300", *extra]
    return subprocess.Popen(command, cwd=repo, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)


@pytest.mark.slow
@pytest.mark.entry
@pytest.mark.parametrize("replicas", [1, 2])
def test_two_processes_trainer_and_generation_replica(tmp_path, replicas):
    """`launch/local.sh 1+R python -m jaxrlhf.train ... max_staleness=2, disaggregate,
    gen_replicas=R`: process 0 trains, processes 1..R generate; staleness stays within η (the
    trainer asserts it from the per-token versions before every update), every step is written
    once, checkpoints drain and save with every process taking part (R = 2: the save's
    cross-process hop onto two other processes, which hung before reshard._send), and the
    held-out evaluation runs every eval.every = 3 updates."""
    proc = _two_process_train(tmp_path / "run", ["--config.checkpoint.every=3",
                                                 "--config.eval.every=3"], replicas)
    try:
        out, _ = proc.communicate(timeout=1800)
    finally:
        if proc.poll() is None:
            import os
            import signal

            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, out[-3000:]
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["gen_replicas"] == replicas and 0 < summary["staleness_max"] <= 2, summary
    rows = [json.loads(line) for line in (tmp_path / "run/metrics.jsonl").read_text().splitlines()]
    rl_rows = [r for r in rows if "async/staleness_max" in r]
    assert [r["step"] for r in rl_rows] == list(range(6))  # one row per update, in order
    assert sorted(r["async/batch"] for r in rl_rows) == list(range(6))  # each batch once
    assert all(r["async/staleness_max"] <= 2 for r in rl_rows)
    assert {r["async/replica"] for r in rl_rows} == set(range(1, replicas + 1))
    evaluated = [r["step"] for r in rl_rows if "eval/accuracy" in r]
    assert evaluated == [2, 5], evaluated  # after updates 3 and 6, as the one-process loops
    assert all(0 <= r["eval/accuracy"] <= 1 for r in rl_rows if "eval/accuracy" in r)
    saved = sorted(int(p.name) for p in (tmp_path / "run/checkpoints").iterdir()
                   if p.name.isdigit())
    assert saved == [3, 6], saved


@pytest.mark.slow
@pytest.mark.entry
@pytest.mark.parametrize("signame", ["SIGTERM", "SIGINT"])
def test_sigterm_to_two_process_async_job_drains_saves_and_resumes(tmp_path, signame):
    """SIGTERM (or Ctrl-C: SIGINT) to both processes: the trainer stops issuing work, trains
    every batch already issued, saves (the replica takes part), both exit 0; the same command
    resumes there and ends with every step trained exactly once (no prompt lost, none trained
    twice)."""
    import os
    import signal
    import time

    work = tmp_path / "run"
    extra = ["--config.checkpoint.every=100"]  # only the stop saves before the end
    proc = _two_process_train(work, extra)
    try:
        deadline = time.monotonic() + 1200
        while not (work / "metrics.jsonl").exists() or '"async/staleness_max"' not in (
                work / "metrics.jsonl").read_text():
            assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read()[-3000:]
            time.sleep(0.2)
        proc.send_signal(getattr(signal, signame))  # local.sh passes it to both
        out, _ = proc.communicate(timeout=900)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, out[-3000:]
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["interrupted"], summary
    saved = [int(p.name) for p in (work / "checkpoints").iterdir() if p.name.isdigit()]
    assert len(saved) == 1 and 1 <= saved[0] < 6, saved
    assert f"interrupted after RL step {saved[0] - 1}" in out
    resumed = _two_process_train(work, extra)
    out, _ = resumed.communicate(timeout=1800)
    assert resumed.returncode == 0, out[-3000:]
    assert json.loads(out.strip().splitlines()[-1])["resumed_from"] == saved[0]
    rows = [json.loads(line) for line in (work / "metrics.jsonl").read_text().splitlines()]
    rl_rows = [r for r in rows if "async/staleness_max" in r]
    assert [r["step"] for r in rl_rows] == list(range(6))
    assert sorted(r["async/batch"] for r in rl_rows) == list(range(6))  # none lost or repeated


@pytest.mark.slow
@pytest.mark.entry
@pytest.mark.parametrize("policy", ["stop", "skip"])
def test_nan_policy_in_a_two_process_async_job(tmp_path, policy):
    """A reward gone wild (1e30: the critic's squared error overflows, every critic loss is
    inf) in a two-process job: nan_policy=stop ends the job at the trainer's first update with
    the loop's one message and no checkpoint; =skip discards every update and finishes."""
    (tmp_path / "wild.py").write_text("def reward(prompt, completion, answer):\n"
                                      "    return 1e30\n")
    proc = _two_process_train(tmp_path / "run", [
        f"--config.reward.function={tmp_path / 'wild.py'}:reward",
        f"--config.nan_policy={policy}", "--config.checkpoint.every=3"])
    try:
        out, _ = proc.communicate(timeout=1800)
    finally:
        if proc.poll() is None:
            import os
            import signal

            os.killpg(proc.pid, signal.SIGKILL)
    checkpoints = tmp_path / "run/checkpoints"
    saved = sorted(int(p.name) for p in checkpoints.iterdir() if p.name.isdigit())
    if policy == "stop":
        assert proc.returncode != 0, out[-3000:]
        assert re.search(r"stopped: RL step 0: .*critic/loss=inf", out), out[-3000:]
        assert saved == [], saved
        return
    assert proc.returncode == 0, out[-3000:]
    assert json.loads(out.strip().splitlines()[-1])["skipped_steps"] == 6
    rows = [json.loads(line) for line in (tmp_path / "run/metrics.jsonl").read_text().splitlines()]
    rl_rows = [r for r in rows if "async/staleness_max" in r]
    assert [r["step"] for r in rl_rows] == list(range(6))
    assert all(r["nan_skipped"] == 1.0 for r in rl_rows)
    assert saved == [3, 6], saved


if __name__ == "__main__":
    _channel_worker(sys.argv[2], int(sys.argv[3]))


@pytest.mark.slow  # three short jobs, one of them in two processes
def test_async_benchmark_runs_end_to_end(tmp_path):
    """benchmarks/async_rl.py at a tiny size: the synchronous run, η = 1 in one process and
    in two (trainer + a generation replica), and the JSON line of ratios (figures meaningless)."""
    script = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "async_rl.py"
    result = subprocess.run(
        [sys.executable, str(script), "--devices=4", "--steps=3", "--warmup=1",
         "--batch_size=8", "--max_new_tokens=8", "--etas=1", "--mp_etas=1", "--timeout=600"],
        capture_output=True, text=True, timeout=900, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    assert [(r["eta"], r["processes"]) for r in summary["runs"]] == [(0, 1), (1, 1), (1, 2)]
    assert all(r["tokens_per_second"] > 0 and r["staleness_max"] <= r["eta"]
               for r in summary["runs"])
    assert set(summary["ratio_vs_sync"]) == {"eta=1", "eta=1,processes=2"}
