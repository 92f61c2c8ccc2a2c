"""Asynchronous runs killed and resumed train every prompt exactly once (issue: Reliability IV).

The real `python -m jaxrlhf.train` of grpo_tiny at η = 2, in both forms of asynchronous RL: one
process (`async_loop.LocalSource`, generation running ahead in the trainer's process) and two
(`launch/local.sh 2`, `placement.kind=disaggregate`: a trainer and a generation replica,
`async_procs.RemoteSource`), on 32 prompts (4 batches of 8 an epoch) for 4 epochs. The job is
killed with SIGKILL (its whole process group) at several moments, each time rerun with the
same command, then let finish. Kill moments (`benchmarks/kill_storm.py`'s): inside an update a
few steps past the resume point, when generation has batches ahead of the trainer (finished
but untrained, or still decoding), and while a checkpoint is being written.

Every update's record lists the rows it trained on (`rows` in metrics.jsonl, which a resumed
run trims back to its checkpoint: what is left is the lineage of the last checkpoint). Along it
every epoch's prompts are trained exactly once: none lost with the batches in flight at a kill
(they are generated again), none trained twice; and no trained token is older than η versions,
across the resumes. The counts are printed.
"""

import collections
import os
import pathlib
import random
import sys
import time

import pytest

from jaxrlhf.run import async_loop, rl
from jaxrlhf.run.check import check_config
from jaxrlhf.schema import base_config

REPO = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))
from kill_storm import kill_moment, outcome_of  # noqa: E402
from storm_job import kill_group, rl_records, start  # noqa: E402

REWARD = f"{pathlib.Path(__file__).parent / 'fixtures/reward_fns.py'}:digit_count"
PROMPTS, BATCH, ETA, EPOCHS = 32, 8, 2, 4
PER_EPOCH = PROMPTS // BATCH
STEPS = EPOCHS * PER_EPOCH


def _command(workdir: pathlib.Path, form: str) -> list[str]:
    flags = ["--config=configs/grpo_tiny.py", f"--config.steps={STEPS}",
             "--config.warm_start.sft_steps=0", f"--config.data.task.num_train={PROMPTS}",
             "--config.data.task.num_eval=8", "--config.data.task.num_sft=8",
             f"--config.rollout.batch_size={BATCH}",
             f"--config.async_rl.max_staleness={ETA}", "--config.checkpoint.every=4",
             "--config.checkpoint.keep=2", "--config.reward.workers=1", f"--workdir={workdir}"]
    train = [sys.executable, "-m", "jaxrlhf.train", *flags]
    if form == "one_process":
        return train
    return [str(REPO / "launch/local.sh"), "2", *train, "--config.placement.kind=disaggregate",
            "--wait_timeout=300"]


def _env(form: str, workdir: pathlib.Path) -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    if form == "two_processes":  # local.sh splits config.cpu_devices over the processes
        env.pop("XLA_FLAGS", None)
        env.update(JAX_PLATFORMS="cpu", LOG_DIR=str(workdir.parent / "process-logs"))
    return env


def epoch_counts(records: list[dict], prompts: int, per_epoch: int) -> list[dict]:
    """Per epoch of the records' updates (in step order): how many prompts they trained, how
    many distinct, which of the data's were never trained, which more than once."""
    out = []
    for first in range(0, len(records), per_epoch):
        trained = collections.Counter(i for r in records[first:first + per_epoch]
                                      for i in r["rows"])
        out.append({"epoch": first // per_epoch, "trained": sum(trained.values()),
                    "distinct": len(trained),
                    "missing": sorted(set(range(prompts)) - set(trained)),
                    "repeated": sorted(i for i, n in trained.items() if n > 1)})
    return out


def kill_and_resume(form: str, tmp_path: pathlib.Path, kinds: tuple[str, ...]) -> list[dict]:
    """Runs the job, SIGKILLs it at a moment of each kind in turn (the first once checkpoint 4
    is written, so that every rerun has one to resume from), reruns the same command after
    each and lets the last run finish; every kill's kind, the last step logged when it came,
    and where the rerun after it resumed."""
    work, rng, kills = tmp_path / "run", random.Random(0), []
    for n, kind in enumerate((*kinds, None)):
        log = tmp_path / f"run{n}.log"
        proc = start(_command(work, form), _env(form, work), log)
        kill = kind is not None
        try:
            if kill:
                while n == 0 and not (work / "checkpoints/4/commit_success.txt").exists():
                    assert proc.poll() is None, log.read_text()[-3000:]
                    time.sleep(0.05)
                assert kill_moment(kind, proc, work, rng, 1.0, 900), (kind,
                                                                     log.read_text()[-3000:])
                kill_group(proc)
            else:
                assert proc.wait(timeout=1200) == 0, log.read_text()[-3000:]
        finally:
            if proc.poll() is None:
                kill_group(proc)
        if n:
            kills[-1]["resumed_from"] = outcome_of(log)["resumed_from"]
        if kill:
            kills.append({"kind": kind,
                          "logged": max([r["step"] for r in rl_records(work)], default=-1)})
    assert outcome_of(tmp_path / f"run{len(kinds)}.log")["errors"] == []
    return kills


def _check(form: str, tmp_path: pathlib.Path, kinds: tuple[str, ...]) -> None:
    kills = kill_and_resume(form, tmp_path, kinds)
    records = rl_records(tmp_path / "run")
    counts = epoch_counts(records, PROMPTS, PER_EPOCH)
    stalest = max(r["async/staleness_max"] for r in records)
    print(f"\n{form}: {len(kills)} SIGKILLs (kind, last step logged at the kill, the rerun "
          "resumed from):", [(k["kind"], k["logged"], k["resumed_from"]) for k in kills])
    for c in counts:
        print(f"  epoch {c['epoch']}: {c['trained']} prompts trained, {c['distinct']} distinct "
              f"of {PROMPTS}, missing {c['missing']}, repeated {c['repeated']}")
    print(f"  staleness at most {stalest} (eta {ETA}) over {len(records)} updates")
    assert [r["step"] for r in records] == list(range(STEPS))
    assert all(c["trained"] == c["distinct"] == PROMPTS for c in counts), counts
    assert stalest <= ETA
    # Every kill cut off updates past the checkpoint the rerun resumed from: their batches
    # (and those generated ahead of them) were trained again, once, in the lineage.
    assert all(k["resumed_from"] is not None and k["logged"] >= k["resumed_from"]
               for k in kills), kills


@pytest.mark.slow  # 3 kills and 4 runs of the job per form (3 minutes and more, 2 loaded cores)
@pytest.mark.parametrize("form", ["one_process", "two_processes"])
def test_async_runs_killed_three_times_train_every_prompt_once(form, tmp_path):
    _check(form, tmp_path, ("step", "save", "step"))


class _Killed(BaseException):
    """A SIGKILL's stand-in in one process: nothing catches it, nothing is saved on its way."""


def test_an_async_run_killed_with_batches_in_flight_trains_every_prompt_once(tmp_path,
                                                                            monkeypatch):
    """The default suite's kill, in-process (`rl.run`, η = 2, one process): the run dies once
    update 5 is trained (in memory, neither logged nor saved) while generation has the batches
    after it drawn, finished or decoding; rerun, it resumes from checkpoint 4 and trains every
    prompt once an epoch."""
    config = base_config()
    config.algorithm, config.steps = "grpo", 8
    config.rollout.update(batch_size=4, group_size=2, max_prompt_len=8, max_new_tokens=6)
    config.data.task.update(num_train=16, num_eval=4, num_sft=4)
    config.reward.update(workers=1, function=REWARD)
    config.async_rl.update(max_staleness=2, chunk_tokens=2)
    config.checkpoint.update(every=4, async_save=False)
    work, collect, in_flight = tmp_path / "run", async_loop.LocalSource._collect, []

    def dies_at_update_5(source):
        if source.version == 5:
            source.pending[0].result()  # trained, then killed before its record and weights
            in_flight.extend(range(5, source.next_index))
            raise _Killed
        return collect(source)

    monkeypatch.setattr(async_loop.LocalSource, "_collect", dies_at_update_5)
    with pytest.raises(_Killed):
        rl.run(check_config(config, str(work)))
    monkeypatch.undo()
    assert rl.run(check_config(config, str(work)))["resumed_from"] == 4
    records = rl_records(work)
    counts = epoch_counts(records, 16, 4)
    print(f"\nkilled after update 5 with batches {in_flight} drawn and not trained; resumed "
          f"from 4: {[(c['trained'], c['distinct']) for c in counts]} (trained, distinct) of "
          "16 prompts per epoch")
    assert len(in_flight) > 1  # update 5's batch, and at least one generated ahead of it
    assert [r["step"] for r in records] == list(range(8))
    assert all(c["trained"] == c["distinct"] == 16 for c in counts), counts
    assert max(r["async/staleness_max"] for r in records) <= 2
