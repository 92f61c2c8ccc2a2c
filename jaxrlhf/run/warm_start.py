"""The supervised warm start of the actor before an RL or offline run, checkpointed.

The warm start fine-tunes the actor on the SFT rows through the same runner as training, with
its own optimizer. It saves checkpoints of its own in `workdir/checkpoints/warm_start/<steps
done>/` (the actor's TrainState and the SFT row iterator) on the run's `checkpoint.every`
cadence, when asked to stop (Ctrl-C, SIGTERM: the step finishes, the checkpoint is saved, the
run returns), and once at its end. A rerun that finds no checkpoint of the run itself resumes
the warm start from the newest intact one (one at its end: the warm start is skipped) and then
goes on exactly as the uninterrupted run did.
"""

from __future__ import annotations

import contextlib
import dataclasses

from tqdm import tqdm

from jaxrlhf import checkpoint
from jaxrlhf.algorithms import sft
from jaxrlhf.data import datasets
from jaxrlhf.data.encode import sft_batch
from jaxrlhf.dataflow.graph import build_graph
from jaxrlhf.engine.microbatch import num_microbatches
from jaxrlhf.engine.train_step import create_train_state
from jaxrlhf.mfc import Role
from jaxrlhf.parallel.layout import Layout
from jaxrlhf.run import build
from jaxrlhf.run.check import Job
from jaxrlhf.run.layouts import single
from jaxrlhf.run.runner import Runner


class WarmStart:
    """The warm start of one run on the actor's `layout`: its checkpoints and where it stands.

    Construction restores the newest intact warm-start checkpoint, if any (a run that has a
    checkpoint of its own never builds one), so that `start_step` is known before the run opens
    its metrics (`checkpoint.trim_metrics`). `run` then trains and waits for its saves.
    """

    def __init__(self, job: Job, layout: Layout):
        self.job, self.layout, self.rows = job, layout, job.data.sft
        w = job.spec.warm_start
        self.steps = w.steps if self.rows else 0
        self.checkpoints = None
        self.restored = None
        if self.steps:
            self.checkpoints = checkpoint.Checkpointer(
                job.workdir / checkpoint.CHECKPOINT_DIR / checkpoint.WARM_START_DIR,
                job.spec.checkpoint)
            target = {Role.ACTOR: checkpoint.abstract_state(job.spec.base.config, layout,
                                                            w.optimizer)}
            self.restored = self.checkpoints.restore_intact(target)
        # The warm-start step this run begins at (0 unless a checkpoint was restored).
        self.start_step = 0 if self.restored is None else self.restored[0].step

    def run(self, writer):
        """The actor's parameters after the warm start, or None when it was stopped (a
        checkpoint saved: the rerun goes on from it); waits for its checkpoint saves.

        Args:
          writer: the run's MetricsWriter (records `sft/...` at warm-start steps).
        """
        job, spec = self.job, self.job.spec
        if not self.steps:
            return build.initial_actor_params(spec, self.layout)
        with contextlib.closing(self.checkpoints):
            if self.restored is not None and self.start_step >= self.steps:
                print(f"the warm start is done: its checkpoint {self.start_step} in "
                      f"{self.checkpoints.directory}", flush=True)
                return self.restored[1][Role.ACTOR].params
            if self.restored is not None:
                print(f"resuming the warm start from checkpoint {self.start_step} in "
                      f"{self.checkpoints.directory}", flush=True)
            runner, rows = self._runner()
            r = spec.rollout
            save = lambda: checkpoint.save_run(self.checkpoints, runner, rows, {},
                                               spec.config_json, job.fingerprint)
            bar = tqdm(range(runner.step_index, self.steps), desc="warm start (SFT)",
                       initial=runner.step_index, total=self.steps, mininterval=2)
            with contextlib.closing(runner), checkpoint.StopRequest() as stop:
                for step in bar:
                    batch = sft_batch(next(rows), job.tokenizer, r.max_prompt_len,
                                      r.max_new_tokens)
                    result = runner.step(batch)
                    writer.write(step, {f"sft/{k}": v
                                        for k, v in result.of_role(Role.ACTOR).items()})
                    if checkpoint.save_if_due(self.checkpoints, stop, step + 1, save,
                                              "warm-start"):
                        return None
            save()  # its end: a rerun stopped before the run's first checkpoint starts here
            return runner.runtimes[Role.ACTOR].state.params

    def _runner(self) -> tuple[Runner, datasets.EpochIterator]:
        """The warm start's runner and SFT row iterator, at step 0 or at the restored step: the
        run's own runner (`build.runner`) of SFT on the actor alone, on the actor's layout, with
        the warm start's optimizer."""
        job, spec, layout = self.job, self.job.spec, self.layout
        w, algorithm = spec.warm_start, sft.make()
        micro = num_microbatches(spec.micro, w.batch_size, spec.rollout.seq_len, layout.dp_size)
        rows = datasets.EpochIterator(self.rows, w.batch_size, seed=spec.seed)
        host = None
        if self.restored is None:
            params = build.initial_actor_params(spec, layout)
            state = create_train_state(params, spec.base.config, layout, w.optimizer)
        else:
            host, states = self.restored
            state = states[Role.ACTOR]
            rows.restore(host.iterator)
        warm = dataclasses.replace(spec, algorithm=algorithm, graph=build_graph(algorithm.mfcs),
                                   models={Role.ACTOR: spec.base}, rewards={},
                                   optimizers={Role.ACTOR: w.optimizer})
        runner = build.runner(dataclasses.replace(job, spec=warm, plan=single(
            algorithm.mfcs[0].name, layout, micro)), {Role.ACTOR: state}, {},
            None if host is None else host.runner)
        self.restored = None  # its arrays now belong to the runner (donated by its steps)
        return runner, rows
