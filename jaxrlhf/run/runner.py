"""Runs one algorithm's dataflow graph, one step at a time, on given model runtimes.

The runner wires MFCs to engine calls and executors, hands them to the scheduler, and turns a
step's outputs into metrics. The end of a step is its one named sync point: metrics are read
back to the host there (everything before it only dispatched).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
from collections.abc import Callable, Mapping

import jax
import numpy as np
from jaxrlhf.algorithms.spec import Algorithm, Metric
from jaxrlhf.dataflow import executors as ex
from jaxrlhf.dataflow.graph import DataflowGraph
from jaxrlhf.dataflow.runtime import ModelRuntime, with_memory_policy
from jaxrlhf.data.transcript import Transcript
from jaxrlhf.dataflow.trajectories import (
    Environment, Trajectories, TrajectoryLimits, trajectory_executor,
)
from jaxrlhf.dataflow.scheduler import Scheduler, StepTiming
from jaxrlhf.engine.rollout.scheduler import Abandoned
from jaxrlhf.mfc import Call, Role
from jaxrlhf.parallel import watchdog
from jaxrlhf.parallel.reshard import fetch
from jaxrlhf.run.layouts import RunPlan


@dataclasses.dataclass
class StepResult:
    """One step's figures on the host, typed (read back at the step's sync point).

    Attributes:
      stats: role -> the statistics of its train step (loss, grad_norm, kl, ...).
      reward: the step's mean sequence score; None when it scores no sequences.
      controller: the controller state after the step (kl_coef, ...).
      counters: role -> its runtime's transfer counters so far (realloc_bytes, ...).
      reward_errors: failed host reward calls so far; compiles: engine compiles so far.
      timing: the step's schedule; buffer: its step buffer.
    """

    stats: dict[Role, dict[str, float]]
    reward: float | None
    controller: dict[str, float]
    counters: dict[Role, dict[str, float]]
    reward_errors: int
    compiles: int
    timing: StepTiming
    buffer: dict

    def postfix(self, shown: tuple[Metric, ...]) -> dict[str, str]:
        """The progress bar's figures of `shown` (an algorithm's), by name."""
        value = lambda m: self.reward if m.role is None else self.stats[m.role][m.name]
        return {m.name: f"{value(m):.3f}" for m in shown}

    @property
    def metrics(self) -> dict[str, float]:
        """Every figure under its output name, as metrics.jsonl and TensorBoard show it."""
        t = self.timing
        out = {f"{r.value}/{k}": v for r, stats in self.stats.items() for k, v in stats.items()}
        out.update({} if self.reward is None else {"reward": self.reward})
        out.update({f"controller/{k}": v for k, v in self.controller.items()})
        out.update({"time/step_seconds": t.seconds, "time/host_blocked_seconds":
                    t.host_blocked_seconds, "reward_errors": float(self.reward_errors),
                    "recompiles": float(self.compiles)})
        out.update({f"time/{name}": m.seconds for name, m in t.mfcs.items()})
        out.update({f"{r.value}/{k}": v for r, c in self.counters.items() for k, v in c.items()})
        return out


class Runner:
    """One algorithm on one placement.

    Args:
      engines: MFC name -> its engine call (Generator, InferenceFn, TrainStep), every model MFC.
      tokenizer: for host rewards.
      host_pools: role -> the process pool and error budget (`HostFunction`) of each role
        the graph runs as a host function (reward, cost); empty if it has none.
      seed: generation randomness; step s uses fold_in(key(seed), s).
      trajectories: the generate call rolls out multi-turn trajectories with the environment
        pool in `host_pools[Role.ACTOR]` (`dataflow/trajectories.py`); None: single turns.
    """

    def __init__(self, algorithm: Algorithm, graph: DataflowGraph, plan: RunPlan,
                 runtimes: dict[Role, ModelRuntime], engines: dict, tokenizer,
                 host_pools: Mapping[Role, ex.HostFunction], seed: int,
                 trajectories: TrajectoryLimits | None = None):
        self._trajectories, self._tokenizer = trajectories, tokenizer
        self._env = host_pools.get(Role.ACTOR)
        # multi-turn: the last step's mean policy turns per trajectory and tool-call error rate
        self._trajectory_stats = {"turns": 0.0, "tool_error_rate": 0.0}
        self.algorithm, self.graph = algorithm, graph
        self.runtimes = runtimes
        self.controller = dict(algorithm.controller_init)
        self.step_index = 0
        # Asked while a step's multi-turn rollout runs: True abandons the step (`step`).
        self.abandon: Callable[[], bool] = lambda: False
        self._rng = jax.random.key(seed)
        self._waiter = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="reward-wait")
        self._reward_errors = 0
        self.engines = engines
        executors, devices = {}, {}
        for name in graph.order:
            mfc = graph.mfc(name)
            if mfc.host:
                executors[name] = ex.host_reward_executor(
                    mfc, tokenizer, host_pools[mfc.role], self._waiter,
                    self._count_reward_errors)
                continue
            layout = plan.layouts[name]
            devices[name] = frozenset(d.id for d in layout.devices)
            executors[name] = with_memory_policy(
                self._executor(mfc, runtimes[mfc.role], layout, engines[name],
                               plan.micro_batches(name)), mfc, layout, runtimes)
        self.scheduler = Scheduler(graph, executors, devices)

    def _executor(self, mfc, runtime, layout, engine, micro_batches: int):
        match mfc.call:
            case Call.GENERATE if self._trajectories is not None:
                return trajectory_executor(mfc, runtime, layout, engine, self._step_rng,
                                           self._env.pool, self._tokenizer, self._trajectories,
                                           self._count_env, lambda: self.abandon())
            case Call.GENERATE:
                return ex.generate_executor(mfc, runtime, layout, engine, self._step_rng,
                                            micro_batches)
            case Call.INFERENCE:
                return ex.inference_executor(mfc, runtime, layout, engine, micro_batches)
            case Call.TRAIN_STEP:
                spec = self.algorithm.train[mfc.role]
                return ex.train_executor(mfc, runtime, layout, spec, engine,
                                         lambda: self.controller)

    def _step_rng(self) -> jax.Array:
        # The step index goes up explicitly: steps run under transfer_guard("disallow").
        return jax.random.fold_in(self._rng, jax.device_put(np.uint32(self.step_index)))

    def environment(self) -> Environment | None:
        """Multi-turn rollouts' environment (its pool, transcript, tokenizer and limits), for
        a generation that runs outside the graph (asynchronous RL); None: single turns."""
        if self._trajectories is None:
            return None
        return Environment(self._env.pool, Transcript(self._tokenizer), self._tokenizer,
                           self._trajectories)

    def count_trajectories(self, result: Trajectories) -> None:
        """Counts a multi-turn batch generated outside the graph: its environment's failures
        and the turn statistics the next step reports."""
        self._count_env(result)

    def _count_env(self, result: Trajectories) -> None:
        self._reward_errors += result.errors.total
        self._trajectory_stats = {"turns": float(np.mean(result.turns_b)),
                                  "tool_error_rate": result.tool_error_rate}

    def _count_reward_errors(self, result) -> None:
        self._reward_errors += result.errors.total

    @property
    def compiles(self) -> int:
        return sum(engine.compiles for engine in self.engines.values())

    def step(self, batch: dict) -> StepResult:
        """Runs every MFC once on `batch`; returns host figures (the step's sync point).

        Raises:
          Abandoned: `abandon()` said so during the step's multi-turn rollout (before anything
            trained): the step left no trace (its generation copies dropped) and the step
            index stays, so running `batch` again repeats it.
        """
        with watchdog.label(step=self.step_index):  # names the step in a stuck wait's message
            try:
                buffer, timing = self.scheduler.run_step(batch)
            except Abandoned:
                for runtime in self.runtimes.values():
                    runtime.drop_copies()
                raise
            stats = {m.role: {k: float(v) for k, v in fetch(buffer[m.outputs[0]]).items()}
                     for m in self.graph.mfcs if m.call is Call.TRAIN_STEP}  # every process
            if self._trajectories is not None:
                stats[Role.ACTOR].update(self._trajectory_stats)
            reward = (float(np.mean(fetch(buffer["scores_b"]))) if "scores_b" in buffer
                      else None)
        if self.algorithm.controller_update is not None:
            # Host-side controller math at the step's sync point: transfers are expected here.
            with jax.transfer_guard("allow"):
                self.controller = self.algorithm.controller_update(self.controller,
                                                                   stats.get(Role.ACTOR, {}))
        counters = {role: {k: float(v) for k, v in rt.counters.as_dict().items()}
                    for role, rt in self.runtimes.items()}
        self.step_index += 1
        return StepResult(stats, reward, {k: float(v) for k, v in self.controller.items()},
                          counters, self._reward_errors, self.compiles, timing, buffer)

    def state(self) -> dict:
        """What a checkpoint needs to continue this runner (JSON-serialisable): the step index
        (which also fixes the step rng), the controller state and the reward error count."""
        return {"step_index": self.step_index, "controller": dict(self.controller),
                "reward_errors": self._reward_errors}

    def restore(self, state: dict) -> None:
        """Continues from `state()` of another runner of the same algorithm."""
        self.step_index = int(state["step_index"])
        self.controller = {k: float(v) for k, v in state["controller"].items()}
        self._reward_errors = int(state["reward_errors"])

    def close(self) -> None:
        self._waiter.shutdown(wait=False)
