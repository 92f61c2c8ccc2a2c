"""Scoring a plan: per-MFC costs, the memory check and the simulated step time, with caches.

The search scores thousands of plans that differ in one MFC, so the `Evaluator` caches each
MFC's time by its choice, each reallocation by (role, source, destination) parameter layouts,
and whole evaluations by plan.
"""

from __future__ import annotations

import dataclasses
import math

from jaxrlhf.mfc import MFC, Role
from jaxrlhf.plan import cost as cost_lib
from jaxrlhf.plan import memory as memory_lib
from jaxrlhf.plan import simulator, train_memory
from jaxrlhf.plan.choice import CallChoice, ExecutionPlan
from jaxrlhf.plan.cluster import Cluster
from jaxrlhf.plan.experiment import Experiment


@dataclasses.dataclass(frozen=True)
class SimOptions:
    """How plans are simulated.

    Attributes:
      num_steps: steps simulated (>= 2 so parameter-version edges across steps take effect).
      overlap_steps: let a step begin before the previous one ended, where the dependencies
        allow (ReaL's runtime); False follows the synchronous scheduler.
    """

    num_steps: int = 2
    overlap_steps: bool = False


@dataclasses.dataclass(frozen=True)
class Evaluation:
    """A plan's score.

    Attributes:
      step_seconds: simulated seconds per step (inf when the plan does not fit).
      memory: peak bytes per device of every MFC, and the MFCs that do not fit.
      mfc_seconds: each model MFC's own duration.
      movement_seconds: each reallocation / onload / offload task's duration.
      sim: the simulation (None when the plan does not fit).
    """

    step_seconds: float
    memory: memory_lib.PlanMemory
    mfc_seconds: dict[str, float]
    movement_seconds: dict[str, float]
    sim: simulator.SimResult | None

    @property
    def fits(self) -> bool:
        return self.memory.fits


class Evaluator:
    """Scores plans of one experiment on one cluster (see the module docstring)."""

    def __init__(self, experiment: Experiment, cluster: Cluster,
                 options: SimOptions = SimOptions()):
        self.experiment, self.cluster, self.options = experiment, cluster, options
        self._mfc: dict[tuple[str, CallChoice], float] = {}
        self._own: dict[tuple[str, CallChoice], memory_lib.MemoryBreakdown] = {}
        self._realloc: dict[tuple, cost_lib.ReallocCost] = {}
        self._plans: dict[ExecutionPlan, Evaluation] = {}
        self.skeleton = simulator.Skeleton(experiment)
        self.evaluations = 0

    def mfc_cost(self, name: str, choice: CallChoice) -> cost_lib.CallCost:
        mfc = self.experiment.graph.mfc(name)
        return cost_lib.call_cost(self.experiment.profile(mfc.role), mfc.call,
                                  self.experiment.workload, choice, self.cluster,
                                  self.experiment.master(mfc.role), self.experiment.decode)

    def mfc_seconds(self, name: str, choice: CallChoice) -> float:
        key = (name, choice)
        if key not in self._mfc:
            self._mfc[key] = self.mfc_cost(name, choice).seconds(self.cluster)
        return self._mfc[key]

    def realloc(self, role: Role, src: CallChoice, dst: CallChoice) -> cost_lib.ReallocCost:
        key = (role, src.param_layout, dst.param_layout)
        if key not in self._realloc:
            self._realloc[key] = cost_lib.realloc_cost(
                self.experiment.profile(role), src, dst, self.cluster)
        return self._realloc[key]

    def _realloc_seconds(self, role: Role, src: CallChoice, dst: CallChoice) -> float:
        return self.realloc(role, src, dst).cost.seconds(self.cluster)

    def _offload_seconds(self, role: Role, choice: CallChoice) -> float:
        p = self.experiment.profile(role)
        return cost_lib.offload_cost(p, choice, self.cluster).seconds(self.cluster)

    def _state_seconds(self, role: Role, home: CallChoice) -> float:
        """A trained model's parameters and optimizer state to or from host memory."""
        p = self.experiment.profile(role)
        nbytes = sum(train_memory.train_state_bytes(p, home, self.experiment.master(role)))
        moments = 3 if self.experiment.master(role) else 2  # AdamW m, v (+ fp32 master)
        cost = cost_lib.host_transfer_cost(nbytes, (1 + moments) * len(p.leaves), self.cluster)
        return cost.seconds(self.cluster)

    def own_memory(self, mfc: MFC, choice: CallChoice) -> memory_lib.MemoryBreakdown:
        key = (mfc.name, choice)
        if key not in self._own:
            self._own[key] = memory_lib.own_memory(self.experiment, mfc, choice,
                                                   platform=self.cluster.platform)
        return self._own[key]

    def memory(self, plan: ExecutionPlan) -> memory_lib.PlanMemory:
        return memory_lib.plan_memory(self.experiment, plan, self.cluster, self.own_memory)

    def tasks(self, plan: ExecutionPlan) -> list[simulator.Task]:
        """The plan's augmented graph of one step (MFCs and parameter movements)."""
        seconds = {name: self.mfc_seconds(name, choice) for name, choice in plan.items()}
        return simulator.augmented_tasks(self.skeleton, plan, seconds, self._realloc_seconds,
                                         self._offload_seconds, self._state_seconds)

    def simulate(self, plan: ExecutionPlan) -> simulator.SimResult:
        """The simulated steps of a plan, whether or not the memory model lets it fit."""
        return simulator.simulate(self.tasks(plan), self.cluster.num_devices,
                                  self.options.num_steps, self.options.overlap_steps)

    def evaluate(self, plan: ExecutionPlan) -> Evaluation:
        """Memory check, then (if it fits) the simulated step time."""
        if plan in self._plans:
            return self._plans[plan]
        self.evaluations += 1
        memory = self.memory(plan)
        seconds = {name: self.mfc_seconds(name, choice) for name, choice in plan.items()}
        tasks = self.tasks(plan)
        moves = {t.name: t.seconds for t in tasks if t.kind is not simulator.TaskKind.MFC}
        sim = None
        step = math.inf
        if memory.fits:
            sim = simulator.simulate(tasks, self.cluster.num_devices, self.options.num_steps,
                                     self.options.overlap_steps)
            step = sim.step_seconds
        evaluation = Evaluation(step, memory, seconds, moves, sim)
        self._plans[plan] = evaluation
        return evaluation
