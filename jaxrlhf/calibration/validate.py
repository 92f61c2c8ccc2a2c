"""`python -m jaxrlhf.plan --validate`: the configured plan, predicted against measured here.

Builds the plan the run would use (`experiment.plan_layouts`, whatever `placement.kind` says)
through `measure.LiveRun`, runs a few real steps from freshly initialised parameters, and lines
up:
  * per MFC, the calibrated cost model's seconds (with the parameter movements the runtime
    makes inside the call: onload and offload of a frozen model, a reallocated copy) against
    the scheduler's `StepTiming` (median over the steps after the first, which compiles);
  * per step, the simulator's step time (`evaluate.Evaluator`, which adds reallocations and
    the schedule's overlap) against the measured step;
  * per MFC, the memory model (`memory.call_memory`) against XLA's `memory_analysis()` of the
    compiled call (`memory.compare_with_compiled`): arguments and temporaries.

Host MFCs (rule-based rewards) are not modelled by the planner (0 s unless the experiment
says otherwise); the table shows what they measured, which counts where they hold up the step.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Sequence

import jax
import numpy as np
from ml_collections import ConfigDict

from jaxrlhf.parallel.layout import Platform
from jaxrlhf.plan import memory as memory_lib
from jaxrlhf.calibration import measure
from jaxrlhf.plan import simulator
from jaxrlhf.plan.cluster import Cluster
from jaxrlhf.plan.evaluate import Evaluation, Evaluator
from jaxrlhf.plan.experiment import Experiment


def _per_device_bytes(info, sharding) -> int:
    shape = sharding.shard_shape(tuple(info.shape))
    return math.prod(shape) * info.dtype.itemsize


def batch_argument_bytes(compiled: jax.stages.Compiled) -> int:
    """Per-device bytes of a compiled MFC's arguments after the first (the parameters or train
    state come first in every call kind; the rest is the batch, the rng and the like), but for
    donated ones: the rollout engine's slot state, which its programs donate and the memory
    model counts as `MemoryBreakdown.state`."""
    (args, _), (shardings, _) = compiled.args_info, compiled.input_shardings
    leaves = [(info, sharding)
              for arg, arg_shardings in zip(args[1:], shardings[1:])
              for info, sharding in zip(jax.tree.leaves(arg), jax.tree.leaves(arg_shardings))
              if not info.donated]
    return sum(_per_device_bytes(info, sharding) for info, sharding in leaves)


@dataclasses.dataclass(frozen=True)
class MFCCheck:
    """One MFC: predicted and measured seconds, estimated and compiled memory.

    Attributes:
      name, spec: the MFC and its layout.
      predicted: the cost model's seconds on the calibrated cluster, its movements included.
      measured: median seconds per step (the scheduler's timing).
      estimate: the memory model's breakdown.
      memory: the estimate beside `memory_analysis()` (the largest compiled bucket).
    """

    name: str
    spec: str
    predicted: float
    measured: float
    estimate: memory_lib.MemoryBreakdown
    memory: memory_lib.MemoryCheck


@dataclasses.dataclass(frozen=True)
class Validation:
    """The configured plan, predicted vs measured.

    Attributes:
      mfcs: one check per model MFC, in dispatch order.
      host: (name, predicted, measured seconds) per host MFC.
      predicted_step: the simulator's seconds per step.
      measured_steps: each timed step's seconds (the compile step left out).
      evaluation: the planner's full evaluation of the plan.
    """

    mfcs: tuple[MFCCheck, ...]
    host: tuple[tuple[str, float, float], ...]
    predicted_step: float
    measured_steps: tuple[float, ...]
    evaluation: Evaluation

    @property
    def measured_step(self) -> float:
        return statistics.median(self.measured_steps)

    @property
    def step_error(self) -> float:
        """predicted / measured - 1."""
        return self.predicted_step / self.measured_step - 1


def memory_checks(run: measure.LiveRun, experiment: Experiment
                  ) -> dict[str, tuple[memory_lib.MemoryBreakdown, memory_lib.MemoryCheck]]:
    """Per model MFC of `run` (after a step): its estimate and how it compares to XLA's."""
    checks = {}
    platform = Platform(jax.devices()[0].platform)  # the devices the calls were compiled for
    for name, choice in run.plan.items():
        estimate = memory_lib.own_memory(experiment, experiment.graph.mfc(name), choice, platform)
        compiled = max(run.compiled(name), key=lambda c: c.memory_analysis().temp_size_in_bytes)
        checks[name] = (estimate, memory_lib.compare_with_compiled(
            estimate, compiled.memory_analysis(), batch_argument_bytes(compiled)))
    return checks


def predicted_call_seconds(evaluation: Evaluation, name: str) -> float:
    """MFC `name`'s seconds with the movements the runtime makes inside its call (the
    simulator's movement tasks are named "KIND:MFC")."""
    moves = sum(seconds for task, seconds in evaluation.movement_seconds.items()
                if task.partition(":")[2] == name)
    return evaluation.mfc_seconds[name] + moves


def validate_run(run: measure.LiveRun, cluster: Cluster, steps: int) -> Validation:
    """Times `steps` steps of an open run (after one more, which compiles if nothing has yet)
    and compares them, and its compiled MFCs, with the planner's models."""
    if steps < 1:
        raise ValueError(f"validation needs at least one timed step, got {steps}")
    experiment = run.spec.experiment()
    timings = run.steps(1 + steps)[1:]
    plan = run.plan
    memory = memory_checks(run, experiment)
    evaluation = Evaluator(experiment, cluster).evaluate(plan)
    measured = lambda name: statistics.median(t.mfcs[name].seconds for t in timings)
    order = simulator.dispatch_order(experiment)
    checks = tuple(
        MFCCheck(name, plan[name].spec(), predicted_call_seconds(evaluation, name),
                 measured(name), *memory[name])
        for name in order if name in memory)
    host = tuple((name, experiment.host_mfc_seconds(name), measured(name))
                 for name in order if name not in memory)
    return Validation(checks, host, evaluation.step_seconds, tuple(t.seconds for t in timings),
                      evaluation)


def validate(config: ConfigDict, cluster: Cluster, steps: int = 5) -> Validation:
    """Runs the configured plan here for `steps` timed steps and compares (`validate_run`)."""
    with measure.live_run(config) as run:
        return validate_run(run, cluster, steps)


def text_table(rows: Sequence[Sequence[str]]) -> str:
    """Rows of strings as aligned columns, a rule under the first (the header)."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _error(predicted: float, measured: float) -> str:
    return f"{100 * (predicted / measured - 1):+.0f}%" if measured > 0 else "-"


def time_table(v: Validation) -> str:
    """Predicted vs measured seconds per MFC and per step."""
    rows = [("MFC", "layout", "predicted ms", "measured ms", "error")]
    for c in v.mfcs:
        rows.append((c.name, c.spec, f"{1e3 * c.predicted:.2f}", f"{1e3 * c.measured:.2f}",
                     _error(c.predicted, c.measured)))
    for name, predicted, measured in v.host:
        rows.append((name, "host", f"{1e3 * predicted:.2f}", f"{1e3 * measured:.2f}",
                     _error(predicted, measured) if predicted else "not modelled"))
    spread = np.percentile(v.measured_steps, [25, 75]) * 1e3
    rows.append(("step", f"{len(v.measured_steps)} steps, IQR {spread[0]:.0f}-{spread[1]:.0f} ms",
                 f"{1e3 * v.predicted_step:.2f}", f"{1e3 * v.measured_step:.2f}",
                 _error(v.predicted_step, v.measured_step)))
    return text_table(rows)


def memory_table(v: Validation) -> str:
    """Estimated vs compiled bytes per device: arguments and temporaries, per MFC."""
    rows = [("MFC", "arguments est.", "compiled", "ratio", "temporaries est.", "compiled",
             "ratio")]
    for c in v.mfcs:
        m = c.memory
        rows.append((c.name, f"{m.estimated_arguments}", f"{m.compiled_arguments}",
                     f"{m.arguments_ratio:.2f}", f"{m.estimated_temporaries}",
                     f"{m.compiled_temporaries}", f"{m.temporaries_ratio:.2f}"))
    return text_table(rows)
