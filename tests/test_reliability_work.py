"""Work lost or mixed (issue: Reliability III): one run per workdir, damaged checkpoints moved
aside and their step saved again, export and resume of the newest intact checkpoint, a full
disk in one line with the last good checkpoint intact, export refusing to mix its files into
an existing `--out`.

A second run on a busy workdir through the real command, and SIGTERM to a run's process
group: tests/test_reliability_signals.py.
"""

import os
import pathlib
import shutil
import subprocess
import sys

import jax
import numpy as np
import pytest

from jaxrlhf import checkpoint, export
from jaxrlhf.checkpoint import CHECKPOINT_DIR, Checkpointer, CheckpointConfig
from jaxrlhf.mfc import Role
from jaxrlhf.parallel.layout import make_layout
from jaxrlhf.run import lock, rl
from jaxrlhf.run.check import check_config
from jaxrlhf.schema import ConfigError, base_config
from test_checkpoint import ACTOR, host_state, random_params

REPO = pathlib.Path(__file__).resolve().parent.parent


def _truncate_largest(step_dir: pathlib.Path) -> None:
    victim = max((p for p in step_dir.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    victim.write_bytes(victim.read_bytes()[: victim.stat().st_size // 3])


def _ref_state(seed: int) -> dict:
    """A frozen model's state (parameters only, 0.6 MiB): small enough for a tiny disk."""
    return {Role.REF: random_params(ACTOR, make_layout("0-7:d8", model=ACTOR), seed)}


def _target() -> dict:
    return {Role.REF: checkpoint.abstract_state(ACTOR, make_layout("0-7:d8", model=ACTOR))}


def _saved(directory: pathlib.Path, steps, **cfg) -> Checkpointer:
    checkpoints = Checkpointer(directory, CheckpointConfig(1, 10, async_save=False, **cfg))
    for step in steps:
        assert checkpoints.save(_ref_state(step), host_state(step, trained=(), frozen=("ref",)))
    return checkpoints


# --- one run per workdir ---------------------------------------------------------------------


def test_a_second_run_on_a_workdir_is_refused_until_the_first_is_gone(tmp_path):
    holder = subprocess.Popen(
        [sys.executable, "-c", "import pathlib, sys, time\nfrom jaxrlhf.run import lock\n"
         "lock.hold(pathlib.Path(sys.argv[1]))\nprint('held', flush=True)\ntime.sleep(600)",
         str(tmp_path)], cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)},
        stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(ConfigError, match=rf"^workdir: in use by pid {holder.pid} on "
                                              rf"{os.uname().nodename} \("):
            check_config(base_config(), str(tmp_path))
    finally:
        holder.kill()  # SIGKILL: its lock file stays, the kernel drops its lock
        holder.wait()
    assert (tmp_path / lock.LOCK_FILE).exists()
    try:
        check_config(base_config(), str(tmp_path))  # a stale lock: the run goes on
        check_config(base_config(), str(tmp_path))  # again in the process that holds it
        assert (tmp_path / lock.LOCK_FILE).read_text().split()[0] == str(os.getpid())
    finally:
        lock.release(tmp_path)


# --- checkpoint integrity --------------------------------------------------------------------


def test_a_damaged_checkpoint_is_moved_aside_and_its_step_saved_again(tmp_path, capfd):
    directory = tmp_path / CHECKPOINT_DIR
    _saved(directory, (1, 2)).close()
    _truncate_largest(directory / "2")

    checkpoints = Checkpointer(directory, CheckpointConfig(1, 10, async_save=False))
    host, _ = checkpoints.restore_intact(_target())
    assert host.step == 1
    err = capfd.readouterr().err
    assert err.count("\n") == 1 and f"warning: checkpoint {directory / '2'} cannot be " \
        "restored" in err and "moved to 2.damaged-1" in err
    assert (directory / "2.damaged-1").is_dir() and checkpoints.all_steps() == [1]
    # The rerun trains step 2 again: it is saved, not skipped as existing.
    assert checkpoints.save(_ref_state(22), host_state(2, trained=(), frozen=("ref",)))
    checkpoints.close()

    again = Checkpointer(directory, CheckpointConfig(1, 10, async_save=False))
    host, states = again.restore_intact(_target())
    assert host.step == 2 and not capfd.readouterr().err
    np.testing.assert_array_equal(
        np.asarray(states[Role.REF]["norm"]["scale"]),
        np.asarray(_ref_state(22)[Role.REF]["norm"]["scale"]))
    again.close()


def _sft_config():
    config = base_config()
    config.algorithm = "sft"
    config.steps = 4
    config.rollout.update(batch_size=8, max_prompt_len=8, max_new_tokens=6)
    config.data.task.update(num_train=32, num_eval=8, num_sft=32)
    config.checkpoint.update(every=2, keep=5)
    return config


@pytest.mark.slow  # three short in-process runs and an export
def test_a_truncated_newest_checkpoint_reruns_twice_then_resumes_the_last_step(tmp_path):
    work = tmp_path / "work"
    assert rl.run(check_config(_sft_config(), str(work)))["resumed_from"] is None
    _truncate_largest(work / "checkpoints/4")
    first = rl.run(check_config(_sft_config(), str(work)))
    assert first["resumed_from"] == 2 and not first["interrupted"]
    assert (work / "checkpoints/4.damaged-1").is_dir() and (work / "checkpoints/4").is_dir()
    second = rl.run(check_config(_sft_config(), str(work)))
    assert second["resumed_from"] == 4  # the retrained step was saved
    assert export.export(work, tmp_path / "out").step == 4
    lock.release(work)


def test_export_picks_the_newest_intact_checkpoint_and_names_a_damaged_step(tmp_path, capfd):
    directory = tmp_path / CHECKPOINT_DIR
    _saved(directory, (7, 9)).close()
    _truncate_largest(directory / "9")
    result = export.export(tmp_path, tmp_path / "out", Role.REF)
    assert result.step == 7 and (tmp_path / "out/model.safetensors").stat().st_size > 0
    assert f"warning: checkpoint {directory / '9'} cannot be restored" in capfd.readouterr().err
    assert (directory / "9").is_dir()  # export only reads: nothing moved
    with pytest.raises(FileNotFoundError, match=r"checkpoint 9 in .* cannot be restored "
                                                r"\(.*\); --step= one of \[7\]"):
        export.export(tmp_path, tmp_path / "out9", Role.REF, step=9)


# --- a full disk -----------------------------------------------------------------------------


@pytest.fixture
def tiny_disk(tmp_path):
    """A 1 MiB tmpfs (root only: skipped elsewhere); `remount(options)` changes its limits."""
    where = tmp_path / "disk"
    where.mkdir()
    mount = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(where)],
                           capture_output=True, text=True)
    if mount.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {mount.stderr.strip()}")

    def remount(options: str) -> None:
        subprocess.run(["mount", "-o", f"remount,{options}", str(where)], check=True)

    yield where, remount
    subprocess.run(["umount", "-l", str(where)], check=True)


def test_a_full_disk_is_one_line_and_the_last_checkpoint_stays_intact(tiny_disk):
    disk, remount = tiny_disk
    directory = disk / CHECKPOINT_DIR
    checkpoints = _saved(directory, (1,))
    # No room for a second 0.6 MiB checkpoint: refused before orbax writes anything.
    with pytest.raises(checkpoint.CheckpointWriteError) as info:
        checkpoints.save(_ref_state(2), host_state(2, trained=(), frozen=("ref",)))
    assert str(info.value).startswith(f"checkpoint: no room for checkpoint 2 in {directory} (it "
                                      "needs 0.6 MiB") and "\n" not in str(info.value)
    assert str(info.value).endswith("the last good checkpoint is 1, intact")
    # Room in bytes, none in files: the write itself fails, in one exception.
    remount("size=8m")
    used = int(subprocess.run(["df", "--output=iused", str(disk)], capture_output=True,
                              text=True).stdout.split()[-1])
    remount(f"nr_inodes={used + 4}")
    with pytest.raises(checkpoint.CheckpointWriteError, match=r"^checkpoint: writing checkpoint "
                       r"2 in .* failed \(.*No space left on device\); the last good "
                       r"checkpoint is 1, intact$"):
        checkpoints.save(_ref_state(2), host_state(2, trained=(), frozen=("ref",)))
        checkpoints.wait()
    remount("nr_inodes=10000")
    host, states = Checkpointer(directory, None).restore_intact(_target())
    assert host.step == 1
    jax.block_until_ready(states)


# --- export --out ----------------------------------------------------------------------------


def test_export_refuses_an_occupied_out_unless_overwrite(tmp_path):
    _saved(tmp_path / CHECKPOINT_DIR, (7,)).close()
    occupied = tmp_path / "occupied"
    occupied.mkdir()
    (occupied / "tokenizer.json").write_text("{}")  # an older export's
    with pytest.raises(FileExistsError, match=r"--out=.*occupied: a directory that is not empty "
                                              r"\(pass --overwrite"):
        export.export(tmp_path, occupied, Role.REF)
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    with pytest.raises(FileExistsError, match=r"--out=.*a_file: exists and is not a directory"):
        export.export(tmp_path, a_file, Role.REF)
    assert a_file.read_text() == "x"

    export.export(tmp_path, occupied, Role.REF, overwrite=True)
    assert sorted(p.name for p in occupied.iterdir()) == [
        "config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
        "tokenizer_config.json"]
    assert (occupied / "tokenizer.json").read_text() != "{}"  # the older export's is gone
    export.export(tmp_path, a_file, Role.REF, overwrite=True)
    assert a_file.is_dir()
    empty = tmp_path / "empty"
    empty.mkdir()
    export.export(tmp_path, empty, Role.REF)  # an empty directory is fine
    assert not [p for p in tmp_path.iterdir() if ".export-" in p.name]  # no staging left
    shutil.rmtree(empty)
