"""A run that stops for a reason (issue: Reliability III): a reward function failing (None, an
array, 1e300, NaN, `sys.exit`, a segfault, a hang) or a non-finite step ends the run with one or
two lines naming the reason and what stays saved, exit code 1, no traceback; and the code
sandbox starts its programs from a fresh interpreter, never a fork of the trainer.
"""

import os
import pathlib
import subprocess
import sys

import pytest

from jaxrlhf.configs import grpo_tiny
from jaxrlhf.checkpoint import NonFiniteError
from jaxrlhf.data import sandbox
from jaxrlhf.run import lock, rl
from jaxrlhf.run.check import check_config
from jaxrlhf.run.loop import Stopped

REPO = pathlib.Path(__file__).resolve().parent.parent
BAD_REWARDS = {
    "none": "return None",
    "array": "import numpy\n    return numpy.ones(3)",
    "huge": "return 1e300",
    "nan": "return float('nan')",
    "exit": "import sys\n    sys.exit(3)",
    "segfault": "import ctypes\n    ctypes.string_at(0)",
    "hang": "import time\n    time.sleep(60)",
}


def _reward(tmp_path: pathlib.Path, kind: str) -> str:
    path = tmp_path / f"reward_{kind}.py"
    path.write_text(f"def score(prompt, completion, answer):\n    {BAD_REWARDS[kind]}\n")
    return f"{path}:score"


def _config(**overrides):
    """grpo_tiny's smoke job (the shapes tests/test_config_runs.py compiles), no warm start."""
    config = grpo_tiny.get_config("smoke")
    config.warm_start.sft_steps = 0
    config.reward.timeout = 2.0
    for key, value in overrides.items():
        section, _, leaf = key.rpartition(".")
        (config[section] if section else config)[leaf] = value
    return config


@pytest.mark.slow  # two runs of the tiny GRPO job in-process
def test_a_failing_reward_or_a_non_finite_step_stops_naming_the_reason_and_the_state(tmp_path):
    work = tmp_path / "none"
    with pytest.raises(Stopped) as info:
        rl.run(check_config(_config(**{"reward.function": _reward(tmp_path, "none")}),
                            str(work)))
    reason, saved = str(info.value).splitlines()
    assert reason.startswith("RL step 0: reward function failed on 32 of 32 samples this step "
                             "(reward.max_error_rate=0.5): 0: bad_value: returned a NoneType")
    assert saved == "no RL checkpoint was saved (a rerun starts RL afresh)"
    lock.release(work)

    work = tmp_path / "nan"
    with pytest.raises(NonFiniteError, match=r"^RL step 0: .*Stopped without saving; no "
                       r"checkpoint was saved before it \(a rerun starts afresh\)\. Lower"):
        rl.run(check_config(_config(**{"optimizer.actor.lr": 1e39}), str(work)))
    lock.release(work)


@pytest.mark.slow  # the real command once per kind of failure
@pytest.mark.parametrize("kind", sorted(BAD_REWARDS))
def test_the_train_command_prints_why_it_stopped_without_a_traceback(kind, tmp_path):
    reward = _reward(tmp_path, kind)
    result = subprocess.run(
        [sys.executable, "-m", "jaxrlhf.train", "--config=configs/grpo_tiny.py:smoke",
         "--config.warm_start.sft_steps=0", "--config.data.task.num_eval=8",
         "--config.reward.timeout=2.0", "--config.checkpoint.every=1",
         f"--config.reward.function={reward}", f"--workdir={tmp_path / 'work'}"],
        cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True,
        timeout=600)
    assert result.returncode == 1, result.stderr[-3000:]
    assert "Traceback" not in result.stderr + result.stdout, result.stderr[-3000:]
    tail = result.stderr.strip().splitlines()[-2:]
    assert tail[0].startswith("stopped: RL step 0: reward function failed on "), tail
    assert tail[1] == "no RL checkpoint was saved (a rerun starts RL afresh)", tail


def test_the_sandbox_never_forks_the_trainer(monkeypatch, bwrap):
    """Its setup (bubblewrap's namespaces; the limits and the program's own uid) runs in the
    bwrap and the fresh interpreter it execs, not in a `preexec_fn` or an `os.fork` of this
    multi-threaded process."""
    def no_fork():
        raise AssertionError("os.fork of the trainer")

    started = []
    popen_init = subprocess.Popen.__init__

    def recorded(self, *args, **kwargs):
        started.append(kwargs.get("preexec_fn"))
        popen_init(self, *args, **kwargs)

    monkeypatch.setattr(os, "fork", no_fork)
    monkeypatch.setattr(subprocess.Popen, "__init__", recorded)
    sandbox.probe.cache_clear()
    result = sandbox.run_python("import sys\nprint(sys.stdin.read()[::-1])", stdin="abc")
    assert result.status is sandbox.RunStatus.OK and result.stdout == "cba\n"
    assert started and all(fn is None for fn in started)
    forked = sandbox.run_python("import os\nif os.fork() == 0:\n    os._exit(3)\n"
                                "print(os.waitstatus_to_exitcode(os.wait()[1]))")
    assert forked.status is sandbox.RunStatus.OK and forked.stdout == "3\n"  # a fork inside
