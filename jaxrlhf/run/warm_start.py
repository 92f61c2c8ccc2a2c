"""The supervised warm start of the actor before an RL or offline run, checkpointed.

The warm start fine-tunes the actor on the SFT rows through the same runner and step loop as
training, with its own optimizer. It saves checkpoints of its own in
`workdir/checkpoints/warm_start/<steps done>/` (the actor's TrainState and the SFT row
iterator) on the run's `checkpoint.every` cadence, when asked to stop (Ctrl-C, SIGTERM: the
step finishes, the checkpoint is saved, the run returns), and once at its end. A rerun that
finds no checkpoint of the run itself resumes the warm start from the newest intact one (one at
its end: the warm start is skipped) and then goes on exactly as the uninterrupted run did.
"""

from __future__ import annotations

import contextlib
import dataclasses

from jaxrlhf import checkpoint
from jaxrlhf.algorithms import sft
from jaxrlhf.dataflow.graph import build_graph
from jaxrlhf.engine.microbatch import num_microbatches
from jaxrlhf.mfc import Role
from jaxrlhf.parallel.layout import Layout
from jaxrlhf.run import build
from jaxrlhf.run.check import Job
from jaxrlhf.run.layouts import single


class WarmStart:
    """The warm start of one run on the actor's `layout`: its checkpoints and where it stands.

    Construction restores the newest intact warm-start checkpoint, if any (a run that has a
    checkpoint of its own never builds one), so that `start_step` is known before the run opens
    its metrics (`checkpoint.trim_metrics`). `run` then trains and waits for its saves.
    """

    def __init__(self, job: Job, layout: Layout):
        self.steps = job.spec.warm_start.steps
        self.job = _sft_job(job, layout, self.steps) if self.steps else job
        self.layout = layout
        self.checkpoints = self.restored = None
        if self.steps:
            self.checkpoints = checkpoint.Checkpointer(
                job.workdir / checkpoint.CHECKPOINT_DIR / checkpoint.WARM_START_DIR,
                job.spec.checkpoint)
            self.restored = build.restore(self.job, self.checkpoints)
        # The warm-start step this run begins at (0 unless a checkpoint was restored).
        self.start_step = 0 if self.restored is None else self.restored[0].step

    def run(self, writer, loop):
        """The actor's parameters after the warm start, or None when it was stopped (a
        checkpoint saved: the rerun goes on from it); waits for its checkpoint saves.

        Args:
          writer: the run's MetricsWriter (records `sft/...` at warm-start steps).
          loop: the job's step loop (`rl.rl_loop`), which trains the warm start as it trains
            any offline run: NaN policy, checkpoints, stop requests.
        """
        job = self.job
        if not self.steps:
            return build.initial_actor_params(job.spec, self.layout)
        with contextlib.closing(self.checkpoints):
            if self.restored is None:
                runner, rows = build.fresh_runner(job, {}), build.batches(job)
            else:
                (host, states), where = self.restored, self.checkpoints.directory
                if self.start_step >= self.steps:
                    print(f"the warm start is done: its checkpoint {self.start_step} in {where}",
                          flush=True)
                    return states[Role.ACTOR].params
                print(f"resuming the warm start from checkpoint {self.start_step} in {where}",
                      flush=True)
                runner = build.runner(job, states, {}, host.runner)
                rows = build.batches(job, host.iterator)
                self.restored = None  # its arrays now belong to the runner (donated by its steps)
            with contextlib.closing(runner):
                result = loop(job, runner, rows, writer, self.checkpoints, {}, what="warm-start",
                              prefix="sft/")
            return None if result.interrupted else runner.runtimes[Role.ACTOR].state.params


def _sft_job(job: Job, layout: Layout, steps: int) -> Job:
    """The warm start as a job of its own: `steps` steps of SFT of the actor alone on `layout`,
    with the warm start's optimizer and batch size."""
    spec, w, algorithm = job.spec, job.spec.warm_start, sft.make()
    micro = num_microbatches(spec.micro, w.batch_size, spec.rollout.seq_len, layout.dp_size)
    sft_spec = dataclasses.replace(
        spec, algorithm=algorithm, graph=build_graph(algorithm.mfcs),
        models={Role.ACTOR: spec.base}, rewards={}, optimizers={Role.ACTOR: w.optimizer},
        steps=steps,
        rollout=dataclasses.replace(spec.rollout, batch_size=w.batch_size, group_size=1))
    return dataclasses.replace(job, spec=sft_spec,
                               plan=single(algorithm.mfcs[0].name, layout, micro))
