"""Multi-process runs (jax.distributed on one machine, 2 processes × 4 CPU devices).

* The same PPO steps give the same metrics with 2 processes as with 1 process of 8 devices,
  also under a plan whose actor generation (devices 0-3, process 0) and training (4-7, process
  1) sit in different processes, so parameters cross processes every step; both processes
  compute the same metrics.
* When one process is SIGKILLed, the other exits non-zero within 60 s, naming the dead one.
* The real `train` entry point runs as 2 processes and matches 1 process (slow).
* Each process's XLA:CPU client gets two pool threads per local device (`backend.
  cpu_client_threads`: one per device hung the run above about one time in two on 2 busy
  cores).

This file is also the worker: `python tests/test_multiprocess.py worker ...` is one process.
"""

import json
import os
import pathlib
import select
import signal
import subprocess
import sys
import time

import pytest

REPO = pathlib.Path(__file__).resolve().parent.parent
ROWS = 32
STALL_TIMEOUT_S = 5
STEPS = 2
BATCH = 8
# Generation in process 0, training in process 1; the ref model moves from 4 devices of
# process 1 to 2 of process 0, its log-probs from 2 devices back to 4.
CROSS = ("actor_gen=0-3:d4,ref_inf=0-1:t2,actor_train=4-7:d2t2,critic_inf=4-7:d4,"
         "critic_train=4-7:f2t2")
COMPARED = ("reward", "actor/loss", "actor/kl", "actor/grad_norm", "actor/clip_frac",
            "actor/score", "critic/loss", "critic/grad_norm", "critic/values", "critic/returns")


def _config(allocation: str):
    from jaxrlhf.schema import base_config

    config = base_config()
    config.rollout.update(batch_size=BATCH, max_prompt_len=8, max_new_tokens=6)
    if allocation:
        config.placement.update(kind="manual", allocation=allocation)
    config.reward.workers = 1
    # A graded reward: with all-zero rewards, whitening would amplify float noise.
    config.reward.function = f"{REPO / 'tests/fixtures/reward_fns.py'}:digit_count"
    return config


def run_steps(allocation: str, workdir: pathlib.Path) -> list[dict]:
    """STEPS PPO steps from a fixed init on fixed prompts; the metrics of each step."""
    import jax

    from jaxrlhf.data import tasks
    from jaxrlhf.data.encode import prompt_batch
    from jaxrlhf.mfc import Role
    from jaxrlhf.parallel.layout import init_params
    from jaxrlhf.run import build
    from jaxrlhf.run.check import check_config

    rows = tasks.make_reverse_task(tasks.ReverseTask(num_train=ROWS, num_eval=8, num_sft=8)).train
    job = check_config(_config(allocation), str(workdir))
    params = init_params(job.spec.models[Role.ACTOR].config,
                         job.plan.home(job.spec.graph, Role.ACTOR), jax.random.key(0))
    metrics = []
    with build.host_pools(job.spec) as pools:
        runner = build.fresh_runner(job, pools, params)
        for step in range(STEPS):
            batch = prompt_batch(rows[BATCH * step:BATCH * (step + 1)], job.tokenizer, 8)
            metrics.append({k: runner.step(batch).metrics[k] for k in COMPARED})
        runner.close()
    return metrics


READY = "jaxrlhf-test-worker-ready"  # what a worker prints once it is in its loop


def _worker(mode: str, address: str, process_id: int, out: str, allocation: str) -> None:
    import faulthandler

    # SIGUSR1 prints every thread's Python stack to stderr: a test that gives up waiting for
    # this worker sends it first, so its failure message shows where the worker was stuck.
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    from jaxrlhf import distributed
    from jaxrlhf.backend import use_cpu_devices

    cfg = distributed.from_flags(address, 2, process_id, heartbeat_timeout_s=5,
                                 wait_timeout_s=STALL_TIMEOUT_S if mode == "stall" else 600)
    use_cpu_devices(distributed.cpu_devices_per_process(8, cfg))
    distributed.initialize(cfg)
    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    if mode == "steps":
        out = pathlib.Path(out)
        out.write_text(json.dumps(run_steps(allocation, out.with_suffix(".workdir"))))
        return
    if mode == "stall":  # process 1 never arrives at a cross-process transfer
        from jaxrlhf.parallel import watchdog
        from jaxrlhf.parallel.reshard import reshard

        devices = np.asarray(jax.devices())
        src = NamedSharding(Mesh(devices[:4], ("d",)), PartitionSpec("d"))
        dst = NamedSharding(Mesh(devices[4:], ("d",)), PartitionSpec("d"))
        x = jax.make_array_from_callback((8,), src, lambda i: np.ones(8, np.float32)[i])
        print(READY, flush=True)
        if process_id == 1:
            time.sleep(300)
        with watchdog.label(step=7, mfc="actor_train"):
            reshard(x, dst)
        return
    # mode "loop": collectives across both processes until one of them is killed.
    mesh = Mesh(np.asarray(jax.devices()), ("d",))
    total = jax.jit(lambda x: x.sum(), out_shardings=NamedSharding(mesh, PartitionSpec()))
    x = jax.device_put(np.ones(8, np.float32), NamedSharding(mesh, PartitionSpec("d")))
    print(READY, flush=True)
    while True:
        total(x).block_until_ready()


@pytest.fixture
def coordinator_port():
    """A port for the workers' coordinator, held (reserved) until the test ends.

    Not "pick a free port and release it": the coordinator's gRPC server binds with
    SO_REUSEPORT, so a released port can end up shared with another test's server (see
    `distributed.reserve_port`).
    """
    from jaxrlhf.distributed import reserve_port

    with reserve_port() as sock:
        yield sock.getsockname()[1]


def _spawn(mode: str, out: pathlib.Path, port: int, allocation: str = "") -> list[subprocess.Popen]:
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # not conftest's 8 devices
    env.update(JAX_PLATFORMS="cpu", PYTHONPATH=str(REPO),
               XLA_FLAGS="--xla_backend_optimization_level=0")  # compiles faster
    address = f"127.0.0.1:{port}"
    return [subprocess.Popen(
        [sys.executable, __file__, mode, address, str(i), str(out.with_suffix(f".{i}.json")),
         allocation],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for i in range(2)]


def _finish(procs, timeout: float) -> list[str]:
    """Waits for every worker to succeed; kills them all if one fails or time runs out."""
    try:
        errors = [p.communicate(timeout=timeout)[1] for p in procs]
        for p, err in zip(procs, errors):
            assert p.returncode == 0, err[-3000:]
        return errors
    finally:
        _kill(procs)


def _kill(procs) -> None:
    for p in procs:
        if p.poll() is None:
            p.kill()  # SIGKILL: JAX's preemption notifier swallows SIGTERM
            p.wait()


def test_two_processes_match_one_with_generation_and_training_in_different_processes(
        tmp_path, coordinator_port):
    import numpy as np

    procs = _spawn("steps", tmp_path / "cross", coordinator_port, CROSS)
    try:
        reference = run_steps(CROSS, tmp_path / "one")  # this process: 8 devices, meanwhile
    except BaseException:
        _kill(procs)
        raise
    _finish(procs, timeout=600)
    got = [json.loads((tmp_path / f"cross.{i}.json").read_text()) for i in range(2)]
    assert got[0] == got[1], "the two processes computed different metrics"
    for step, (g, want) in enumerate(zip(got[0], reference)):
        for key in COMPARED:
            np.testing.assert_allclose(g[key], want[key], rtol=1e-5, atol=1e-6,
                                       err_msg=f"step {step} {key}")


def test_the_cpu_client_gets_two_threads_per_local_device_unless_the_user_chose(monkeypatch):
    from jaxrlhf import backend

    assert backend.cpu_client_threads(local_devices=4, cores=2) == 8
    assert backend.cpu_client_threads(local_devices=1, cores=64) == 64
    for name in ("PJRT_NPROC", "NPROC"):
        monkeypatch.setenv(name, "")  # unset for the function; restored after the test
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=4")
    backend.give_cpu_client_threads()
    assert int(os.environ["PJRT_NPROC"]) == max(8, len(os.sched_getaffinity(0)))
    monkeypatch.setenv("PJRT_NPROC", "3")
    backend.give_cpu_client_threads()
    assert os.environ["PJRT_NPROC"] == "3"
    # Every entry point's `use_cpu_devices` does it too: one process deadlocked the same way.
    monkeypatch.setenv("PJRT_NPROC", "")
    monkeypatch.setenv("XLA_FLAGS", "")
    backend.use_cpu_devices(6)
    assert int(os.environ["PJRT_NPROC"]) == max(12, len(os.sched_getaffinity(0)))


def _wait_ready(proc, timeout: float) -> None:
    """Reads the worker's stdout until its READY token has come.

    Gloo's threads print "[Gloo] Rank r is connected ..." lines to the same stdout while the
    worker prints READY, in pieces that can land mid-line around it, so READY is looked for as
    a substring of the raw bytes (one small write, so never split), not as a line of its own:
    matching whole lines lost the token under load ("worker not ready after 300 s" with both
    workers busy in their loop).
    """
    fd, seen = proc.stdout.fileno(), b""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if select.select([fd], [], [], 1.0)[0]:
            chunk = os.read(fd, 1 << 16)
            assert chunk, f"the worker ended before it was ready: {proc.stderr.read()[-2000:]}"
            seen += chunk
            if READY.encode() in seen:
                return
    raise TimeoutError(f"the worker was not ready after {timeout} s")


def _stderr_tails(procs) -> str:
    """Each worker's Python stacks and last stderr lines, then kills them all (for a failure)."""
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGUSR1)  # faulthandler: the stacks go to stderr
    time.sleep(2.0)
    _kill(procs)
    return "\n".join(f"[worker {i}] {p.stderr.read()[-4000:]}" for i, p in enumerate(procs))


def _kill_one(tmp_path, port: int, victim: int) -> tuple[str, float, int]:
    procs = _spawn("loop", tmp_path / "loop", port)
    try:
        try:
            # Generous: on 2 busy cores (the other pytest worker runs a multi-process test too)
            # starting JAX, joining the job and gloo's first collective take minutes.
            _wait_ready(procs[victim], timeout=300)
        except TimeoutError as error:
            raise TimeoutError(f"{error}\n{_stderr_tails(procs)}") from None
        time.sleep(1.0)  # both inside the collective loop
        procs[victim].send_signal(signal.SIGKILL)
        start = time.monotonic()
        survivor = procs[1 - victim]
        _, err = survivor.communicate(timeout=60)
        return err, time.monotonic() - start, survivor.returncode
    finally:
        _kill(procs)


@pytest.mark.slow  # the soak runs it (benchmarks/multiprocess_soak.py)
def test_killing_process_1_stops_process_0_within_60s_naming_it(tmp_path, coordinator_port):
    err, seconds, code = _kill_one(tmp_path, coordinator_port, victim=1)
    assert code != 0 and seconds < 60, (code, seconds)
    assert "stopped sending heartbeats" in err and "\n1\n" in err, err[-2000:]


@pytest.mark.slow
def test_killing_process_0_stops_process_1_within_60s_naming_it(tmp_path, coordinator_port):
    err, seconds, code = _kill_one(tmp_path, coordinator_port, victim=0)
    assert code != 0 and seconds < 60, (code, seconds)
    assert "leader task" in err, err[-2000:]  # process 0 hosts the coordination service


def test_a_transfer_whose_peer_never_arrives_stops_the_job_naming_it(tmp_path,
                                                                    coordinator_port):
    """No hang, ever: a cross-process wait past its deadline ends the job with one line."""
    procs = _spawn("stall", tmp_path / "stall", coordinator_port)
    try:
        _wait_ready(procs[0], timeout=120)
        start = time.monotonic()
        _, err = procs[0].communicate(timeout=60)
        seconds = time.monotonic() - start
        assert procs[0].returncode != 0, err[-2000:]
        line = ("jaxrlhf: process 0: cross-process transfer of 1 array(s) (process 0 -> process "
                f"1) (step 7, mfc actor_train) did not complete within {STALL_TIMEOUT_S} s")
        assert line in err, err[-2000:]
        assert seconds < STALL_TIMEOUT_S + 30, seconds
        # The peer, asleep, is stopped by the coordination service (its leader is gone).
        _, err1 = procs[1].communicate(timeout=60)
        assert procs[1].returncode != 0, err1[-2000:]
    finally:
        _kill(procs)


def _train_command(launcher: list[str], workdir: pathlib.Path, extra: list[str]
                   ) -> tuple[list[str], dict]:
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env.update(JAX_PLATFORMS="cpu", LOG_DIR=str(workdir.parent / f"{workdir.name}-logs"))
    args = ["--config=configs/ppo_tiny.py", f"--workdir={workdir}", "--config.steps=3",
            "--config.warm_start.sft_steps=5", "--config.data.task.num_eval=16",
            "--config.reward.workers=1",
            "--config.reward.function=tests/fixtures/reward_fns.py:digit_count", *extra]
    return [*launcher, sys.executable, "-m", "jaxrlhf.train", *args], env


def _train(launcher: list[str], workdir: pathlib.Path, extra: list[str]) -> dict:
    command, env = _train_command(launcher, workdir, extra)
    result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def _rl_rows(workdir: pathlib.Path) -> list[dict]:
    rows = []
    for line in (workdir / "metrics.jsonl").read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            pass  # being written
    return [r for r in rows if "reward" in r]


@pytest.mark.slow
@pytest.mark.entry
@pytest.mark.parametrize("extra", [[], ["--config.placement.kind=manual",
                                        f"--config.placement.allocation={CROSS}"]],
                         ids=["colocate", "generation_and_training_in_different_processes"])
def test_train_entry_point_two_processes_match_one(tmp_path, extra):
    """`launch/local.sh 2 python -m jaxrlhf.train ...` against the same command alone."""
    import numpy as np

    one = _train([], tmp_path / "one", extra)
    two = _train([str(REPO / "launch/local.sh"), "2"], tmp_path / "two", extra)
    assert two["accuracy_before"] == one["accuracy_before"]
    assert two["accuracy_after"] == one["accuracy_after"]
    rows = {name: [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").open()]
            for name in ("one", "two")}
    assert [r["step"] for r in rows["two"]] == [r["step"] for r in rows["one"]]  # written once
    for got, want in zip(rows["two"], rows["one"]):
        for key in set(COMPARED + ("sft/actor/loss",)) & set(want):
            np.testing.assert_allclose(got[key], want[key], rtol=1e-5, atol=1e-6,
                                       err_msg=f"step {want['step']} {key}")
    assert sorted(p.name for p in (tmp_path / "two/data").iterdir()) == ["process_0",
                                                                         "process_1"]


@pytest.mark.slow
@pytest.mark.entry
def test_sigterm_to_a_two_process_job_saves_and_a_rerun_resumes(tmp_path):
    """SLURM's SIGTERM reaches both processes: they agree on a step, save it, exit 0 in < 60 s.

    Rerunning the same command resumes from that checkpoint and ends where one uninterrupted
    process ends.
    """
    import numpy as np

    extra = ["--config.steps=6", "--config.checkpoint.every=100"]  # only the SIGTERM saves
    one = _train([], tmp_path / "one", extra)
    work = tmp_path / "two"
    command, env = _train_command([str(REPO / "launch/local.sh"), "2"], work, extra)
    proc = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 600
        while not ((work / "metrics.jsonl").exists() and _rl_rows(work)):
            assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read()[-3000:]
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)  # to local.sh, which passes it to both processes
        start = time.monotonic()
        out, _ = proc.communicate(timeout=900)
        seconds = time.monotonic() - start
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, out[-3000:]
    # The step under way when SIGTERM came is finished first (on 2 busy cores that alone can
    # take minutes); saving and exiting after it take < 60 s.
    step_seconds = max(r["time/step_seconds"] for r in _rl_rows(work))
    assert seconds < step_seconds + 60, (seconds, step_seconds)
    saved = [int(p.name) for p in (work / "checkpoints").iterdir() if p.name.isdigit()]
    assert len(saved) == 1 and 1 <= saved[0] < 6, saved
    assert f"interrupted after RL step {saved[0] - 1}" in out  # process 0 (1 prints no stdout)
    assert json.loads(out.strip().splitlines()[-1])["interrupted"]

    resumed = _train([str(REPO / "launch/local.sh"), "2"], work, extra)
    assert resumed["resumed_from"] == saved[0] and not resumed["interrupted"]
    assert resumed["accuracy_after"] == one["accuracy_after"]
    got, want = _rl_rows(work), _rl_rows(tmp_path / "one")
    assert [r["step"] for r in got] == [r["step"] for r in want]
    for g, w in zip(got, want):
        for key in COMPARED:
            np.testing.assert_allclose(g[key], w[key], rtol=1e-5, atol=1e-6,
                                       err_msg=f"step {w['step']} {key}")


if __name__ == "__main__":
    _worker(sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4], sys.argv[5])
