"""Stop signals to the whole process group (issue: Reliability III): what `timeout`, Slurm and
Kubernetes send. The trainer finishes its step, saves and exits with no traceback; the reward
workers ignore the group's signal and keep scoring until the trainer closes the pool.

The default suite runs the real command once: a second run on its workdir is refused, then
SIGTERM goes to the first run's process group in the middle of its RL steps (a slow reward
function makes the reward pool busy then). `benchmarks/term_storm.py` sends it at ten moments
of every phase (startup, warm start, evaluation, step, save).
"""

import json
import os
import pathlib
import signal
import socket
import subprocess
import sys
import time

from jaxrlhf.data.rewards import RewardPool, StartMethod

REPO = pathlib.Path(__file__).resolve().parent.parent
_SLOW_REWARD = ("import time\n\n\ndef score(prompt, completion, answer):\n"
                "    time.sleep(0.01)\n    return float(len(completion))\n")


def _command(workdir: pathlib.Path, reward: pathlib.Path) -> list[str]:
    """grpo_tiny's smoke job (the shapes tests/test_config_runs.py compiles too), for as many
    steps as it gets, with a reward pool of two workers and a reward that takes its time."""
    return [sys.executable, "-m", "jaxrlhf.train", "--config=configs/grpo_tiny.py:smoke",
            "--config.steps=1000", "--config.warm_start.sft_steps=0",
            "--config.checkpoint.every=0", f"--config.reward.function={reward}:score",
            f"--workdir={workdir}"]


def _wait(proc: subprocess.Popen, log: pathlib.Path, came, seconds: float = 300) -> None:
    deadline = time.monotonic() + seconds
    while not came():
        assert proc.poll() is None, log.read_text()[-3000:]
        assert time.monotonic() < deadline, f"not there after {seconds} s"
        time.sleep(0.05)


def _rl_steps(workdir: pathlib.Path) -> list[int]:
    path, steps = workdir / "metrics.jsonl", []
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                steps.append(json.loads(line)["step"])
            except json.JSONDecodeError:
                pass
    return steps


def test_sigterm_to_the_process_group_saves_and_a_second_run_is_refused(tmp_path):
    reward = tmp_path / "slow_reward.py"
    reward.write_text(_SLOW_REWARD)
    work = tmp_path / "work"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    log = (tmp_path / "first.log").open("w")
    first = subprocess.Popen(_command(work, reward), cwd=REPO, env=env, stdout=log,
                             stderr=subprocess.STDOUT, start_new_session=True)
    try:
        _wait(first, tmp_path / "first.log", lambda: (work / ".lock").exists()
              and (work / ".lock").read_text().strip())
        second = subprocess.run(_command(work, reward), cwd=REPO, env=env,
                                capture_output=True, text=True, timeout=120)
        assert second.returncode == 2, second.stderr[-2000:]
        assert second.stderr.startswith(f"error: workdir: in use by pid {first.pid} on "
                                        f"{socket.gethostname()} (")
        assert len(second.stderr.strip().splitlines()) == 1 and not second.stdout
        _wait(first, tmp_path / "first.log", lambda: len(_rl_steps(work)) >= 2)  # in RL steps
        time.sleep(0.1)  # into the next step
        sent = time.monotonic()
        os.killpg(first.pid, signal.SIGTERM)  # the trainer, its reward workers, their server
        first.wait(timeout=60)
        seconds = time.monotonic() - sent
    finally:
        if first.poll() is None:
            os.killpg(first.pid, signal.SIGKILL)
            first.wait()
    output = (tmp_path / "first.log").read_text()
    assert first.returncode == 0, output[-3000:]
    assert seconds < 60
    assert "Traceback" not in output and "\nerror:" not in output, output[-3000:]
    saved = int(output.split("interrupted after RL step ")[1].split(":")[0]) + 1
    assert f"checkpoint {saved} saved in {work / 'checkpoints'}; run the same" in output
    assert (work / "checkpoints" / str(saved) / "commit_success.txt").exists()
    assert json.loads(output.strip().splitlines()[-1])["interrupted"] is True
    assert _rl_steps(work) == list(range(saved))  # one run's steps, in order
    assert not _session(first.pid), "processes of the run outlived it"


def _session(sid: int) -> list[str]:
    """The processes left in session `sid`, given 10 s to go (the pool's forkserver leaves when
    it sees the trainer gone)."""
    deadline = time.monotonic() + 10
    while (left := subprocess.run(["pgrep", "-s", str(sid)], capture_output=True,
                                  text=True).stdout.split()) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


def test_reward_workers_outlive_stop_signals_until_the_pool_closes():
    for method in StartMethod:
        with RewardPool("exact_match", num_workers=2, start_method=method) as pool:
            assert pool.submit(["p"], ["1"], ["1"]).result(timeout=60).valid_b.all()
            pids = [w.process.pid for w in pool._workers]
            _stop_signals_to(pids)
            batch = pool.submit(["p"] * 4, ["1", "2", "3", "4"], ["1"] * 4).result(timeout=60)
            assert batch.errors.total == 0 and batch.rewards_b.tolist() == [1, 0, 0, 0]
            assert [w.process.pid for w in pool._workers] == pids  # none replaced
        for pid in pids:  # closing the pool ends them
            assert not os.path.exists(f"/proc/{pid}") or "zombie" in _state(pid)


_FORKSERVER_MASKS = """
import pathlib
from jaxrlhf.data.rewards import RewardPool, StartMethod
with RewardPool("exact_match", num_workers=1, start_method=StartMethod.FORKSERVER) as pool:
    pool.submit(["p"], ["1"], ["1"]).result(timeout=60)
    worker = pool._workers[0].process.pid
    status = pathlib.Path(f"/proc/{worker}/status").read_text().splitlines()
    forkserver = next(int(line.split()[1]) for line in status if line.startswith("PPid:"))
    status = pathlib.Path(f"/proc/{forkserver}/status").read_text().splitlines()
    print(*(line for line in status if line.startswith(("SigBlk:", "SigIgn:"))))
"""


def test_workers_forked_later_start_with_stop_signals_held():
    """A worker dies to a stop signal that comes before `_worker_main` ignores them (unpickling
    its arguments, importing the main module) unless it starts with them blocked; a forkserver
    worker inherits the forkserver's mask. A fresh process, because multiprocessing launches
    its resource tracker (which unblocks both signals) only once per process."""
    out = subprocess.run([sys.executable, "-c", _FORKSERVER_MASKS], capture_output=True,
                         text=True, timeout=120, cwd=REPO, check=True).stdout.split()
    held = int(out[out.index("SigBlk:") + 1], 16) | int(out[out.index("SigIgn:") + 1], 16)
    for sig in (signal.SIGTERM, signal.SIGINT):
        assert held >> (sig - 1) & 1, f"the forkserver's children start open to {sig.name}"


def _stop_signals_to(pids: list[int]) -> None:
    for pid in pids:
        os.kill(pid, signal.SIGTERM)
        os.kill(pid, signal.SIGINT)


def _state(pid: int) -> str:
    try:
        return pathlib.Path(f"/proc/{pid}/status").read_text().lower()
    except FileNotFoundError:
        return "zombie"
