"""Exact resume of the RL job from checkpoints, and the NaN policy, through the real RL job.

A run that resumes from a checkpoint must repeat the uninterrupted run's steps: equal metrics
and bitwise-equal final model states. The fast tests run `rl.run` in-process on a small
PPO config, once per batch source of the one loop (`run/loop.py`): generated in the step
(synchronous) and by the one-process asynchronous source at η = 0, which computes exactly
what the synchronous step does (tests/test_async_rl.py), so every exact check holds for it
too; the slow one kills the real `python -m jaxrlhf.train` (SIGKILL, then Ctrl-C) and reruns
the same command. (The multi-process source: tests/test_async_rl.py; offline runs:
tests/test_offline_resume.py.)

The runs of this module compile the same programs again and again (every run builds new
engines); the test session's persistent compilation cache (tests/conftest.py) serves the second
run of a program the first's executable. Outputs do not depend on it.
"""

import json
import os
import pathlib
import shutil
import signal
import struct
import subprocess
import sys
import time

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

from jaxrlhf.schema import base_config
from jaxrlhf import checkpoint
from jaxrlhf.run import async_loop, rl
from jaxrlhf.run.check import check_config

REWARD = f"{pathlib.Path(__file__).parent / 'fixtures/reward_fns.py'}:digit_count"
# Metrics that measure the machine or count since process start, not the training (the
# asynchronous source's busy shares of generation and training too).
_SYSTEM_SUFFIXES = ("_seconds", "_bytes", "recompiles", "tokens_per_second", "_busy")


def _config(steps=4):
    config = base_config()
    config.steps = steps
    config.rollout.update(batch_size=16, max_prompt_len=8, max_new_tokens=6)
    config.data.task.update(num_train=64, num_eval=16, num_sft=16)
    # A graded reward, so that even the untrained model's steps carry real advantages.
    config.reward.update(function=REWARD, workers=1)
    config.checkpoint.update(every=2, keep=10)
    return config


def _rl_records(workdir: pathlib.Path) -> list[dict]:
    rows = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "reward" in r]


def _assert_same_steps(got: list[dict], want: list[dict]) -> None:
    assert [r["step"] for r in got] == [r["step"] for r in want]
    for g, w in zip(got, want):
        assert g.keys() == w.keys()
        for key in w:
            if "time/" not in key and not key.endswith(_SYSTEM_SUFFIXES):  # sft/time/ too
                np.testing.assert_allclose(g[key], w[key], rtol=0, atol=1e-6,
                                           err_msg=f"step {w['step']} {key}")


def _item(workdir: pathlib.Path, step: int, item: str):
    """One item of a checkpoint, restored on the shardings it was saved with."""
    return ocp.StandardCheckpointer().restore(workdir / "checkpoints" / str(step) / item)


def _assert_items_equal(a: pathlib.Path, step_a: int, b: pathlib.Path, step_b: int,
                        items=("actor_params", "actor_opt", "critic_params", "critic_opt",
                               "ref_params")) -> None:
    for item in items:
        got, want = _item(a, step_a, item), _item(b, step_b, item)
        assert jax.tree.structure(got) == jax.tree.structure(want), item
        for x, y in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=item)


@pytest.fixture(scope="module", params=["sync", "async"])
def run(request):
    """`rl.run` of a config in a workdir with one batch source: the synchronous step, or the
    one-process asynchronous source (`async_loop.LocalSource`, which `rl.run` takes for
    η > 0) at η = 0."""
    def run_job(config, workdir) -> dict:
        with pytest.MonkeyPatch.context() as patch:
            if request.param == "async":
                patch.setattr(rl, "rl_loop", async_loop.rl_loop)
            summary = rl.run(check_config(config, str(workdir)))
        assert ("staleness_max" in summary) == (request.param == "async")  # the source ran
        return summary

    run_job.source = request.param
    return run_job


@pytest.fixture(scope="module")
def full_run(run, tmp_path_factory):
    """An uninterrupted 4-step run with checkpoints 2 and 4."""
    workdir = tmp_path_factory.mktemp("full")
    summary = run(_config(), workdir)
    assert summary["resumed_from"] is None and not summary["interrupted"]
    assert sorted(int(p.name) for p in (workdir / "checkpoints").iterdir()) == [2, 4]
    return workdir, summary


def test_resume_repeats_the_uninterrupted_run(run, full_run, tmp_path):
    full, summary = full_run
    # A run that died after logging step 3 but before checkpoint 4 was complete.
    crashed = tmp_path / "crashed"
    shutil.copytree(full, crashed)
    shutil.rmtree(crashed / "checkpoints/4")
    with (crashed / "metrics.jsonl").open("a") as f:
        f.write('{"step": 3, "reward": 0.')  # a record cut off mid-write

    resumed = run(_config(), crashed)
    assert resumed["resumed_from"] == 2
    assert resumed["accuracy_before"] == summary["accuracy_before"]  # from the checkpoint
    _assert_same_steps(_rl_records(crashed), _rl_records(full))
    _assert_items_equal(crashed, 4, full, 4)
    assert resumed["accuracy_after"] == summary["accuracy_after"]


def test_nan_policy_stop_keeps_the_last_good_checkpoint_and_skip_discards_steps(
        run, full_run, tmp_path):
    full = full_run[0]
    work = tmp_path / "work"
    shutil.copytree(full, work)
    # A reward function gone wild: 1e30 is a finite float32 the reward pool accepts, but the
    # critic's squared error on it overflows, so RL step 4's critic loss is inf.
    (tmp_path / "wild.py").write_text("def reward(prompt, completion, answer):\n"
                                      "    return 1e30\n")
    config = _config(steps=6)
    config.reward.function = f"{tmp_path / 'wild.py'}:reward"
    # Another reward makes another run: resuming its checkpoints is the user's explicit choice.
    config.checkpoint.resume = "force"
    with pytest.raises(checkpoint.NonFiniteError,
                       match=r"RL step 4: .*critic/loss=inf.*latest checkpoint \(step 4\)"):
        run(config, work)
    assert sorted(int(p.name) for p in (work / "checkpoints").iterdir()) == [2, 4]
    _assert_items_equal(work, 4, full, 4)  # intact

    config.nan_policy = "skip"
    summary = run(config, work)
    assert summary["resumed_from"] == 4 and summary["skipped_steps"] == 2
    records = _rl_records(work)
    assert [r["step"] for r in records] == list(range(6))
    assert [r.get("nan_skipped", 0.0) for r in records] == [0.0] * 4 + [1.0, 1.0]
    assert not np.isfinite(records[4]["critic/loss"])
    # Both steps were discarded whole: the last checkpoint holds the state after step 3, and
    # the prompts moved on (4 batches per epoch: 6 taken).
    _assert_items_equal(work, 6, full, 4)
    host = checkpoint.Checkpointer(work / "checkpoints", None).restore_host()
    assert host.step == 6 and host.iterator == {"epoch": 1, "batch": 2}


def test_a_damaged_newest_checkpoint_is_skipped_for_the_older_one(run, full_run, tmp_path,
                                                                   capfd):
    full, summary = full_run
    work = tmp_path / "work"
    shutil.copytree(full, work)
    victim = max((p for p in (work / "checkpoints/4/actor_params").rglob("*") if p.is_file()),
                 key=lambda p: p.stat().st_size)
    victim.write_bytes(victim.read_bytes()[: victim.stat().st_size // 3])  # truncated
    resumed = run(_config(), work)
    assert resumed["resumed_from"] == 2
    assert f"warning: checkpoint {work / 'checkpoints/4'} cannot be restored" in (
        capfd.readouterr().err)
    _assert_same_steps(_rl_records(work), _rl_records(full))
    assert resumed["accuracy_after"] == summary["accuracy_after"]


def test_no_intact_checkpoint_is_one_error_line(run, full_run, tmp_path):
    work = tmp_path / "work"
    shutil.copytree(full_run[0], work)
    for step in (2, 4):
        shutil.rmtree(work / f"checkpoints/{step}/actor_params")
    with pytest.raises(checkpoint.CheckpointError, match=r"checkpoint: none of the checkpoints "
                       r"\[2, 4\] in .* can be restored"):
        run(_config(), work)


@pytest.mark.parametrize("change, keys", [
    (lambda c: setattr(c, "algorithm", "grpo"), ["algorithm"]),
    (lambda c: c.models.actor.update(size="small"), ["models.actor.size"]),
    (lambda c: c.data.task.update(num_train=65), ["data.task.num_train"]),
], ids=["algorithm", "model_size", "data"])
def test_a_checkpoint_of_another_run_is_refused_naming_the_keys(full_run, change, keys):
    from jaxrlhf.spec import ConfigError

    config = _config()
    change(config)
    if config.algorithm == "grpo":
        config.rollout.group_size = 2
    with pytest.raises(ConfigError, match=r"^checkpoint: .*checkpoints/4 was written by another "
                                          r"run \(" + ".*".join(keys)):
        check_config(config, str(full_run[0]))


def test_a_data_file_edited_between_runs_is_another_run(tmp_path):
    from jaxrlhf.fingerprint import differences, run_fingerprint

    data = tmp_path / "prompts.jsonl"
    config = _config()
    config.data.train_path = str(data)
    data.write_text('{"prompt": "12>", "answer": "21"}\n')
    before = run_fingerprint(config.to_json())
    data.write_text('{"prompt": "13>", "answer": "31"}\n')
    assert [d.split(":")[0] for d in differences(before, run_fingerprint(config.to_json()))] == [
        "data.train_path"]


def test_changes_that_may_come_with_a_resume_are_accepted(full_run, tmp_path, capfd):
    config = _config(steps=8)
    config.checkpoint.update(every=4, keep=3)
    config.placement.update(kind="manual", allocation=(
        "actor_gen=0-3:d4,ref_inf=4-7:d4,critic_inf=4-7:d4,actor_train=0-3:d2t2,"
        "critic_train=4-7:f4"))
    config.micro_batches = 2
    config.reward.workers = 2
    config.compile.cache_dir = ""  # a restart may compile afresh
    job = check_config(config, str(full_run[0]))  # no error: the same run
    assert job.fingerprint == check_config(_config(), str(tmp_path / "fresh")).fingerprint

    forced = _config()
    forced.algorithm, forced.rollout.group_size = "grpo", 2
    forced.checkpoint.resume = "force"
    check_config(forced, str(full_run[0]))
    assert "checkpoint.resume=force: resuming" in capfd.readouterr().err

    work = tmp_path / "never"
    shutil.copytree(full_run[0], work)
    fresh = _config()
    fresh.checkpoint.resume = "never"
    check_config(fresh, str(work))
    assert not (work / "checkpoints").exists()
    assert sorted(p.name for p in (work / "checkpoints.replaced-1").iterdir()) == ["2", "4"]


_SIGNAL_REWARD = """
import json, os, pathlib, signal

FLAG = pathlib.Path(__file__).with_name("signal.json")


def reward(prompt, completion, answer):
    # While FLAG exists: send the FLAG's signal to the trainer at its call number (SIGTERM as
    # SLURM would, SIGINT as Ctrl-C does).
    if FLAG.exists():
        flag = json.loads(FLAG.read_text())
        flag["calls"] += 1
        FLAG.write_text(json.dumps(flag))
        if flag["calls"] == flag["at"]:
            FLAG.unlink()
            os.kill(flag["pid"], flag["signal"])
    return float(sum(c.isdigit() for c in completion))
"""


# One handler (guards.StopRequest) takes both signals: each batch source meets one of them in the
# default suite, the other with -m slow.
_SIGNAL_OF = {"sync": signal.SIGTERM, "async": signal.SIGINT}
_OTHER_SIGNAL = {signal.SIGTERM: signal.SIGINT, signal.SIGINT: signal.SIGTERM}


def test_sigterm_or_ctrl_c_finishes_the_step_saves_and_a_rerun_resumes(run, full_run, tmp_path,
                                                                     capfd):
    _stop_and_resume(run, full_run, _SIGNAL_OF[run.source], tmp_path, capfd)


@pytest.mark.slow
def test_the_other_stop_signal_finishes_the_step_saves_and_a_rerun_resumes(run, full_run,
                                                                           tmp_path, capfd):
    _stop_and_resume(run, full_run, _OTHER_SIGNAL[_SIGNAL_OF[run.source]], tmp_path, capfd)


def _stop_and_resume(run, full_run, signum, tmp_path, capfd) -> None:
    """The signal during RL step 2: the step finishes, checkpoint 3 is saved, the rerun resumes
    there and repeats the uninterrupted run."""
    said = "interrupt" if signum == signal.SIGINT else "SIGTERM"
    full, summary = full_run
    (tmp_path / "term.py").write_text(_SIGNAL_REWARD)
    # One reward call per prompt: 16 for the held-out evaluation before RL (its mean reward),
    # then 16 per step: call 56 falls in RL step 2 (0-based).
    (tmp_path / "signal.json").write_text(json.dumps({"pid": os.getpid(), "at": 56, "calls": 0,
                                                      "signal": int(signum)}))
    config = _config()
    config.reward.function = f"{tmp_path / 'term.py'}:reward"
    work = tmp_path / "work"
    stopped = run(config, work)
    assert stopped["interrupted"] and stopped["accuracy_after"] is None
    out = capfd.readouterr().out
    assert f"{said}: finishing this step" in out
    assert "interrupted after RL step 2: checkpoint 3 saved" in out
    assert sorted(int(p.name) for p in (work / "checkpoints").iterdir()) == [2, 3]  # 3: the stop

    resumed = run(config, work)
    assert resumed["resumed_from"] == 3 and not resumed["interrupted"]
    _assert_same_steps(_rl_records(work), _rl_records(full))  # the same reward values
    assert resumed["accuracy_after"] == summary["accuracy_after"]


# ---- the real entry point, killed and interrupted --------------------------------------------

_TRAIN = [sys.executable, "-m", "jaxrlhf.train", "--config=configs/ppo_tiny.py",
          "--config.steps=20", "--config.warm_start.sft_steps=20",
          "--config.warm_start.batch_size=16", "--config.rollout.batch_size=16",
          "--config.data.task.num_eval=16", "--config.reward.workers=1",
          "--config.checkpoint.every=2", "--config.checkpoint.keep=2"]


def _start(workdir, env) -> subprocess.Popen:
    # A session of its own, so that a signal to its process group reaches the reward workers
    # too, like Ctrl-C in a terminal.
    return subprocess.Popen(_TRAIN + [f"--workdir={workdir}"], env=env, start_new_session=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _wait_for_step(workdir: pathlib.Path, step: int, proc: subprocess.Popen) -> None:
    """Polls metrics.jsonl until RL step `step` is logged (a checkpoint before it exists)."""
    path = workdir / "metrics.jsonl"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.stdout.read()[-3000:]
        if path.exists() and any(r["step"] >= step for r in _rl_records_lenient(path)):
            return
        time.sleep(0.02)
    raise TimeoutError(f"step {step} not logged")


def _rl_records_lenient(path: pathlib.Path) -> list[dict]:
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            pass  # being written
    return [r for r in rows if "reward" in r]


@pytest.mark.slow
@pytest.mark.entry
def test_killed_and_interrupted_train_main_resumes_exactly(tmp_path):
    env = {**os.environ, "JAX_COMPILATION_CACHE_DIR": str(tmp_path / "jax_cache"),
           "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0"}
    full = subprocess.run(_TRAIN + [f"--workdir={tmp_path / 'full'}"], env=env,
                          capture_output=True, text=True, timeout=600)
    assert full.returncode == 0, full.stderr[-3000:]
    work = tmp_path / "stopped"

    proc = _start(work, env)
    _wait_for_step(work, 5, proc)  # checkpoints 2 and 4 exist (or 4 is being written)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()

    proc = _start(work, env)
    _wait_for_step(work, 10, proc)
    os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C: finish the step, save, exit cleanly
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, out[-3000:]
    assert "resuming from checkpoint" in out and "interrupted after RL step" in out
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["interrupted"] and summary["accuracy_after"] is None

    rerun = subprocess.run(_TRAIN + [f"--workdir={work}"], env=env, capture_output=True,
                           text=True, timeout=600)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert "warm start" not in rerun.stderr  # skipped: its result is in the checkpoint
    summary = json.loads(rerun.stdout.strip().splitlines()[-1])
    full_summary = json.loads(full.stdout.strip().splitlines()[-1])
    assert summary["accuracy_before"] == full_summary["accuracy_before"]
    assert summary["accuracy_after"] == full_summary["accuracy_after"]
    _assert_same_steps(_rl_records(work), _rl_records(tmp_path / "full"))
    _assert_items_equal(work, 20, tmp_path / "full", 20)

    # A finished run's workdir resumes at its end: no step runs, the evaluation is the same.
    again = subprocess.run(_TRAIN + [f"--workdir={work}"], env=env, capture_output=True,
                           text=True, timeout=600)
    assert again.returncode == 0, again.stderr[-3000:]
    summary = json.loads(again.stdout.strip().splitlines()[-1])
    assert summary["resumed_from"] == 20
    assert summary["accuracy_after"] == full_summary["accuracy_after"]
    assert len(_rl_records(work)) == 20


# ---- the warm start inside an RL run -----------------------------------------------------------


def _warm_config():
    config = _config(steps=2)
    config.warm_start.update(sft_steps=4, batch_size=16)  # checkpoints 2 and 4 of its own
    return config


def _warm_records(workdir: pathlib.Path) -> list[dict]:
    rows = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "sft/actor/loss" in r]


def _steps(directory: pathlib.Path) -> list[int]:
    return sorted(int(p.name) for p in directory.iterdir() if p.name.isdigit())


def _tensorboard_scalars(workdir: pathlib.Path) -> list[tuple[str, int, float]]:
    """(tag, step, value) of every scalar event in workdir/tensorboard, read from the files
    (TFRecord framing: length, its CRC, an Event proto, its CRC)."""
    from tensorboardX.proto.event_pb2 import Event

    scalars = []
    for path in sorted((workdir / "tensorboard").glob("events.out.tfevents.*")):
        data, i = path.read_bytes(), 0
        while i < len(data):
            (length,) = struct.unpack("<Q", data[i:i + 8])
            event = Event.FromString(data[i + 12:i + 12 + length])
            i += 12 + length + 4
            scalars += [(v.tag, event.step, v.simple_value) for v in event.summary.value]
    return scalars


@pytest.fixture(scope="module")
def warm_run(tmp_path_factory):
    """An uninterrupted run: 4 warm-start steps (checkpoints 2, 4), then 2 RL steps."""
    workdir = tmp_path_factory.mktemp("warm")
    summary = rl.run(check_config(_warm_config(), str(workdir)))
    assert _steps(workdir / "checkpoints/warm_start") == [2, 4]
    assert _steps(workdir / "checkpoints") == [2]
    return workdir, summary


def _assert_same_run(work: pathlib.Path, full: pathlib.Path, got: dict, want: dict) -> None:
    _assert_same_steps(_warm_records(work), _warm_records(full))
    _assert_same_steps(_rl_records(work), _rl_records(full))
    _assert_items_equal(work, 2, full, 2)
    assert (got["accuracy_before"], got["accuracy_after"]) == (
        want["accuracy_before"], want["accuracy_after"])


def test_a_run_killed_in_its_warm_start_resumes_it_exactly(warm_run, tmp_path, capfd):
    full, summary = warm_run
    crashed = tmp_path / "crashed"
    shutil.copytree(full, crashed)
    # Killed during warm-start step 3: no RL checkpoint, warm-start checkpoint 4 unfinished,
    # the metrics of steps logged after checkpoint 2 are there (one cut off mid-write).
    shutil.rmtree(crashed / "checkpoints/2")
    shutil.rmtree(crashed / "checkpoints/warm_start/4")
    records = (crashed / "metrics.jsonl").read_text().splitlines()
    (crashed / "metrics.jsonl").write_text("".join(f"{r}\n" for r in records[:3]) +
                                           '{"step": 3, "sft/actor/lo')
    resumed = rl.run(check_config(_warm_config(), str(crashed)))
    assert "resuming the warm start from checkpoint 2" in capfd.readouterr().out
    _assert_same_run(crashed, full, resumed, summary)


def test_sigterm_in_the_warm_start_saves_and_the_rerun_resumes_it(warm_run, tmp_path,
                                                                  monkeypatch, capfd):
    from jaxrlhf.spec import ConfigError

    full, summary = warm_run
    real_encode, calls = rl.encode, []

    def encode_then_sigterm(*args):  # SIGTERM (as SLURM sends it) while warm-start step 2 runs
        calls.append(1)
        if len(calls) == 3:
            os.kill(os.getpid(), signal.SIGTERM)
        return real_encode(*args)

    monkeypatch.setattr(rl, "encode", encode_then_sigterm)
    work = tmp_path / "work"
    stopped = rl.run(check_config(_warm_config(), str(work)))
    assert stopped["interrupted"] and stopped["accuracy_before"] is None
    assert "interrupted after warm-start step 2: checkpoint 3 saved" in capfd.readouterr().out
    assert _steps(work / "checkpoints/warm_start") == [2, 3]
    assert _steps(work / "checkpoints") == []
    other = _warm_config()  # a warm-start checkpoint, too, resumes only its own run
    other.models.actor.size = "small"
    with pytest.raises(ConfigError, match=r"^checkpoint: .*checkpoints/warm_start/3 was written "
                                          r"by another run \(models.actor.size"):
        check_config(other, str(work))

    monkeypatch.setattr(rl, "encode", real_encode)
    resumed = rl.run(check_config(_warm_config(), str(work)))
    assert "resuming the warm start from checkpoint 3" in capfd.readouterr().out
    _assert_same_run(work, full, resumed, summary)

    # Killed in RL step 1 after the warm start: its end checkpoint skips it entirely.
    shutil.rmtree(work / "checkpoints/2")
    again = rl.run(check_config(_warm_config(), str(work)))
    assert "the warm start is done: its checkpoint 4" in capfd.readouterr().out
    _assert_same_run(work, full, again, summary)

    # TensorBoard shows every step once, as metrics.jsonl has it, after three attempts.
    scalars = _tensorboard_scalars(work)
    assert len(scalars) == len({(tag, step) for tag, step, _ in scalars})
    assert ({(tag, step) for tag, step, _ in scalars}
            == {(tag, step) for tag, step, _ in _tensorboard_scalars(full)})
    logged = {(k, r["step"]): v for r in _warm_records(work) + _rl_records(work)
              for k, v in r.items()
              if k != "step" and not isinstance(v, list) and np.isfinite(v)}  # not `rows`
    assert {(tag, step) for tag, step, _ in scalars} >= set(logged)
    for tag, step, value in scalars:
        if (tag, step) in logged:
            assert value == np.float32(logged[tag, step]), (tag, step)
