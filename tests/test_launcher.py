"""`launch/slurm.sbatch` on a real one-node Slurm cluster (`tests/slurm_cluster.py`), and
`launch/tpu_pod.sh --dry-run`.

* A 2-process job stopped by `scancel --signal=TERM --full` (every process of the job, the
  batch shell included, gets SIGTERM: what `--signal=B:TERM@180` amounts to for the shell; an
  srun among them would SIGKILL its tasks) saves a checkpoint after its last finished RL step
  and exits within 60 s; `scontrol requeue` resumes it there, and it ends with the metrics of
  one uninterrupted process.
* The other ways Slurm stops a job (slow): a signal to the job's steps (`scancel
  --signal=TERM`, what `#SBATCH --signal=TERM@180` sends) and cancellation (`scancel`: SIGTERM
  to everything, SIGKILL after KillWait), each followed by a resubmission that resumes.
* A job whose process hangs (SIGSTOP: no heartbeat) ends within the heartbeat timeout of a
  cancel (slow).
* `launch/tpu_pod.sh --dry-run run` prints the 16 commands of a v5p-128 slice's workers, whose
  settings `jaxrlhf.distributed` accepts.

Needs `sbatch`, `slurmctld`, `slurmd` and `munged` (Debian: `apt-get install slurm-wlm munge`,
which `.ci/run` does); skipped where they are absent. `-m 'launcher and not slow'` runs the
default part alone; `-m launcher` runs the slow ones too (a `-m` replaces pyproject's).
"""

import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest

from slurm_cluster import Cluster, missing_binaries

REPO = pathlib.Path(__file__).resolve().parent.parent
STEPS = 10
HEARTBEAT_S = 5
COMPARED = ("reward", "actor/loss", "actor/kl", "actor/grad_norm", "critic/loss",
            "critic/values")

pytestmark = pytest.mark.launcher


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    if missing := missing_binaries():
        pytest.skip(f"Slurm is not installed (no {', '.join(missing)}; apt-get install "
                    "slurm-wlm munge)")
    with Cluster.start(tmp_path_factory.mktemp("slurm")) as running:
        yield running


def _submit(cluster: Cluster, workdir: pathlib.Path, processes: int, extra_env=None) -> int:
    """`sbatch --ntasks-per-node=P ... launch/slurm.sbatch --config=ppo_tiny:smoke ...`.

    Cheaper than the smoke run where the launcher is not concerned: 2 devices (one per process
    of a 2-process job), no warm start, 32 held-out prompts. A job and its resubmissions share
    a compilation cache (`JAX_COMPILATION_CACHE_DIR`, as a user's would): process 0 of a
    resubmission loads the programs its first run compiled (JAX writes entries from process 0
    only, and on CPU process 1's keys differ: it compiles again). The 1- and 2-process runs
    share nothing (each has its workdir's cache, and their keys differ).
    """
    env = {"PATH": f"{pathlib.Path(sys.executable).parent}:{os.environ['PATH']}",
           "PYTHONPATH": str(REPO), "JAX_PLATFORMS": "cpu",
           "XLA_FLAGS": "--xla_backend_optimization_level=0",  # not conftest's 8 devices
           "JAX_COMPILATION_CACHE_DIR": str(workdir.parent / f"{workdir.name}-compiled"),
           "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",  # at O0 most compile in < 1 s
           "LOG_DIR": str(workdir.parent / f"{workdir.name}-logs"), **(extra_env or {})}
    return cluster.sbatch(
        ["--nodes=1", f"--ntasks-per-node={processes}", "--gpus-per-node=0",
         "--cpus-per-task=1", f"--output={workdir}.out", "--open-mode=append",
         "launch/slurm.sbatch", "--config=configs/ppo_tiny.py:smoke", f"--workdir={workdir}",
         f"--config.steps={STEPS}", "--config.checkpoint.every=100",  # only a stop saves
         "--config.cpu_devices=2", "--config.warm_start.sft_steps=0",
         "--config.eval.max_prompts=32", "--config.reward.workers=1",
         # A graded reward: with all-zero rewards, whitening would amplify float noise.
         "--config.reward.function=tests/fixtures/reward_fns.py:digit_count",
         f"--heartbeat_timeout={HEARTBEAT_S}"],
        cwd=REPO, env=env)


def _rl_rows(workdir: pathlib.Path) -> list[dict]:
    path, rows = workdir / "metrics.jsonl", []
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            pass  # being written
    return [r for r in rows if "reward" in r]


def _when_training(cluster: Cluster, job: int, workdir: pathlib.Path, first: int = 0) -> None:
    """Returns once the job has finished RL step `first` (its first one: the warm start and
    compiles are behind)."""
    deadline, checked = time.monotonic() + 600, 0.0
    while not any(r["step"] >= first for r in _rl_rows(workdir)):
        if time.monotonic() - checked > 1:  # a client call: CPU on the daemons' side too
            state = cluster.job(job)["JobState"]
            assert state in ("PENDING", "RUNNING") and time.monotonic() < deadline, (
                f"job {job} {state} before its first RL step:\n{_output(workdir)}")
            checked = time.monotonic()
        time.sleep(0.1)


def _output(workdir: pathlib.Path, tail: int = 4000) -> str:
    """The job's output (`--output`: the batch script, local.sh and process 0), its end."""
    path = workdir.parent / f"{workdir.name}.out"
    return path.read_text(errors="replace")[-tail:] if path.exists() else "(no output)"


def _summary(workdir: pathlib.Path) -> dict:
    """The last JSON line the job printed (process 0's summary)."""
    lines = [line for line in _output(workdir).splitlines() if line.startswith("{")]
    assert lines, _output(workdir)
    return json.loads(lines[-1])


def _saved_steps(workdir: pathlib.Path) -> list[int]:
    path = workdir / "checkpoints"
    return sorted(int(p.name) for p in path.iterdir() if p.name.isdigit()) if path.exists() else []


def _stop_and_check(cluster: Cluster, job: int, workdir: pathlib.Path, *scancel: str,
                    state: str = "COMPLETED") -> int:
    """Signals the job once it trains; asserts it saved after its last finished RL step and
    ended in `state` with exit code 0 within 60 s of the step under way; the checkpoint's step."""
    resumed_from = _saved_steps(workdir)
    _when_training(cluster, job, workdir, first=max(resumed_from, default=0))
    cluster.run("scancel", *scancel, str(job))
    start = time.monotonic()
    fields = cluster.wait(job, timeout_s=600)
    seconds = time.monotonic() - start
    assert (fields["JobState"], fields["ExitCode"]) == (state, "0:0"), (
        fields["JobState"], fields["ExitCode"], _output(workdir))
    rows = _rl_rows(workdir)
    # The step under way when the signal came is finished first (on 2 busy cores it alone can
    # take long); saving and exiting after it take < 60 s.
    assert seconds < max(r["time/step_seconds"] for r in rows) + 60, seconds
    saved = [s for s in _saved_steps(workdir) if s not in resumed_from]
    assert saved == [rows[-1]["step"] + 1] and saved[0] < STEPS, (saved, rows[-1]["step"])
    assert f"interrupted after RL step {saved[0] - 1}" in _output(workdir)
    assert _summary(workdir)["interrupted"]
    return saved[0]


def _check_resumed(cluster: Cluster, job: int, workdir: pathlib.Path, saved: int) -> dict:
    fields = cluster.wait(job, timeout_s=600)
    assert (fields["JobState"], fields["ExitCode"]) == ("COMPLETED", "0:0"), _output(workdir)
    summary = _summary(workdir)
    assert summary["resumed_from"] == saved and not summary["interrupted"], summary
    return summary


def _assert_same_steps(got_dir: pathlib.Path, want_dir: pathlib.Path) -> None:
    import numpy as np

    got, want = _rl_rows(got_dir), _rl_rows(want_dir)
    assert [r["step"] for r in got] == [r["step"] for r in want] == list(range(STEPS))
    for g, w in zip(got, want):
        for key in COMPARED:
            np.testing.assert_allclose(g[key], w[key], rtol=1e-5, atol=1e-6,
                                       err_msg=f"step {w['step']} {key}")


def test_scancel_full_saves_a_two_process_job_and_a_requeue_resumes_it_like_one_process(
        cluster, tmp_path):
    one = _submit(cluster, tmp_path / "one", processes=1)
    work = tmp_path / "two"
    job = _submit(cluster, work, processes=2)
    saved = _stop_and_check(cluster, job, work, "--signal=TERM", "--full")
    cluster.run("scontrol", "requeue", str(job))
    resumed = _check_resumed(cluster, job, work, saved)
    fields = cluster.wait(one, timeout_s=600)
    assert fields["ExitCode"] == "0:0", _output(tmp_path / "one")
    assert resumed["accuracy_after"] == _summary(tmp_path / "one")["accuracy_after"]
    _assert_same_steps(work, tmp_path / "one")


@pytest.mark.slow
def test_a_signal_to_the_steps_and_a_cancel_save_and_a_resubmission_resumes(cluster, tmp_path):
    """`scancel --signal=TERM JOB` (what `#SBATCH --signal=TERM@180` sends before the time
    limit), then `scancel JOB` (preemption: SIGTERM, SIGKILL KillWait s later)."""
    work = tmp_path / "run"
    saved = _stop_and_check(cluster, _submit(cluster, work, 2), work, "--signal=TERM")
    job = _submit(cluster, work, 2)
    saved_again = _stop_and_check(cluster, job, work, state="CANCELLED")
    assert saved_again > saved
    _check_resumed(cluster, _submit(cluster, work, 2), work, saved_again)


def _process_pid(workdir: pathlib.Path, process_id: int) -> int:
    """The pid of the job's process `process_id` (same machine: the one-node cluster)."""
    for entry in pathlib.Path("/proc").iterdir():
        try:
            environ = (entry / "environ").read_bytes().split(b"\0")
            cmdline = (entry / "cmdline").read_bytes()
        except (OSError, ValueError):
            continue
        if (f"--workdir={workdir}".encode() in cmdline
                and f"JAXRLHF_PROCESS_ID={process_id}".encode() in environ):
            return int(entry.name)
    raise AssertionError(f"no process {process_id} of {workdir}")


@pytest.mark.slow
def test_a_job_whose_process_hangs_ends_within_the_heartbeat_timeout_of_a_cancel(
        cluster, tmp_path):
    work = tmp_path / "run"
    job = _submit(cluster, work, 2, extra_env={"GRACE_S": "1"})
    _when_training(cluster, job, work)
    hung = _process_pid(work, 1)
    os.kill(hung, signal.SIGSTOP)  # alive, silent: no heartbeat, never reaches the stop
    try:
        cluster.run("scancel", "--signal=TERM", "--full", str(job))
        start = time.monotonic()
        fields = cluster.wait(job, timeout_s=120)
        seconds = time.monotonic() - start
    finally:
        try:
            os.kill(hung, signal.SIGCONT)
        except ProcessLookupError:
            pass
    assert fields["JobState"] == "FAILED", (fields["JobState"], _output(work))
    assert seconds < HEARTBEAT_S + 30, seconds
    assert "tasks are unhealthy (stopped sending heartbeats)" in _output(work, tail=10**7)


def test_tpu_pod_dry_run_prints_each_worker_of_a_v5p_128_slice_its_command(monkeypatch):
    from jaxrlhf import distributed

    ips = [f"10.130.0.{i + 2}" for i in range(16)]  # a v5p-128 slice: 16 hosts x 4 chips
    env = {**os.environ, "TPU_NAME": "my-v5p-128", "ZONE": "us-east5-a",
           "WORKER_IPS": " ".join(ips)}
    out = subprocess.run(
        [str(REPO / "launch/tpu_pod.sh"), "--dry-run", "run", "--config=configs/ppo_70b.py",
         "--workdir=/mnt/shared/runs/ppo 70b"], env=env, capture_output=True, text=True,
        check=True).stdout
    assert out.splitlines() == [
        f"gcloud compute tpus tpu-vm ssh my-v5p-128 --zone us-east5-a --worker={i} --command "
        f"'set -o pipefail; cd jaxrlhf && JAXRLHF_COORDINATOR_ADDRESS=10.130.0.2:8476 "
        f"JAXRLHF_NUM_PROCESSES=16 JAXRLHF_PROCESS_ID={i} python -m jaxrlhf.train "
        "--config=configs/ppo_70b.py --workdir=/mnt/shared/runs/ppo\\ 70b 2>&1 | "
        "tee ~/jaxrlhf-run.log'" for i in range(16)]
    # What each worker's process makes of its settings, on the TPU backend.
    monkeypatch.setenv("JAX_PLATFORMS", "tpu")
    for i in (0, 15):
        monkeypatch.setenv(distributed.ENV_COORDINATOR, "10.130.0.2:8476")
        monkeypatch.setenv(distributed.ENV_NUM_PROCESSES, "16")
        monkeypatch.setenv(distributed.ENV_PROCESS_ID, str(i))
        cfg = distributed.from_flags(None, None, None)
        assert (cfg.kind, cfg.num_processes, cfg.process_id) == (
            distributed.LaunchKind.EXPLICIT, 16, i)
        assert distributed.cpu_devices_per_process(8, cfg) == 8  # not split off the CPU
