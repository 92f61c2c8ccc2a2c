"""Plan search: simulated annealing over per-MFC choices (ReaL's MCMC), and exhaustive search.

The chain starts from the best baseline. Each proposal changes one MFC (a random choice, another
configuration on the same devices, the same configuration elsewhere, the devices of another MFC,
or the parameter layout of another call of the same model, which saves a reallocation) and is
accepted by the Metropolis rule on the relative change of the simulated step time, at a
temperature that decays geometrically. Plans that do not fit are never accepted. The per-MFC
costs, reallocation costs and plan evaluations are cached by the `Evaluator`.

`exhaustive` enumerates the whole (Pareto-pruned) space; it finds the optimum on small clusters
and is how the tests check the annealer.

Baselines, the placements of earlier systems, each with the best strategies it allows:

  colocate    every MFC on all devices with one symmetric strategy (DeepSpeed-Chat): the best
              single (d, f, t, p) for all MFCs by the cost model, micro-batches per MFC.
  heuristic   ReaL's heuristic baseline: every MFC on all devices with one symmetric 3D
              strategy and one micro-batch count chosen by Megatron-style rules, not by the
              cost model (`heuristic`).
  standalone, split, interleave
              the device blocks of `dataflow.placement.resolve_placement`, then the best
              strategy per MFC on its block.

"Best" is a coordinate descent from the smallest-memory configuration of every MFC: each MFC
in turn takes the configuration (on its fixed devices) that most lowers the simulated step
time while the plan still fits, until a round changes nothing.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import random
import time

from jaxrlhf.dataflow.placement import Placement, PlacementError, resolve_placement
from jaxrlhf.parallel.strategy import DeviceRange
from jaxrlhf.plan.choice import CallChoice, ExecutionPlan
from jaxrlhf.plan.cluster import Cluster
from jaxrlhf.plan.evaluate import Evaluation, Evaluator, SimOptions
from jaxrlhf.plan.experiment import Experiment
from jaxrlhf.plan.space import Config, Menu, SpaceOptions, runs_as_priced

BASELINES = (Placement.COLOCATE, Placement.STANDALONE, Placement.SPLIT, Placement.INTERLEAVE)


@dataclasses.dataclass(frozen=True)
class PlanResult:
    """A named plan and its evaluation, or the reason there is none."""

    name: str
    plan: ExecutionPlan | None
    evaluation: Evaluation | None
    reason: str = ""

    @property
    def feasible(self) -> bool:
        return self.evaluation is not None and math.isfinite(self.evaluation.step_seconds)

    @property
    def step_seconds(self) -> float:
        return self.evaluation.step_seconds if self.feasible else math.inf


def _smallest(menu: Menu, name: str, devices: DeviceRange, configs: list[Config]) -> CallChoice:
    experiment = menu.evaluator.experiment
    mfc = experiment.graph.mfc(name)
    return min((c.at(devices) for c in configs),
               key=lambda ch: (menu.evaluator.own_memory(mfc, ch).total,
                               menu.evaluator.mfc_seconds(name, ch)))


FASTEST, SMALLEST = 24, 8  # the descent's shortlist per MFC


def _shortlist(configs: list[Config]) -> list[Config]:
    """The FASTEST fastest configs and the SMALLEST slowest (which hold the least memory):
    the menu's configs are sorted by seconds, and the descent is only a start for annealing,
    which sees them all."""
    if len(configs) <= FASTEST + SMALLEST:
        return configs
    return configs[:FASTEST] + configs[-SMALLEST:]


def descend(menu: Menu, ranges: dict[str, DeviceRange], allowed: dict[str, list[Config]],
            name: str) -> PlanResult:
    """Coordinate descent over each MFC's `allowed` configs (their `_shortlist`; all of them
    when the plan does not fit otherwise) on its fixed `ranges`."""
    if any(not allowed[n] for n in ranges):
        empty = [n for n in ranges if not allowed[n]]
        return PlanResult(name, None, None, f"no legal strategy fits for MFC(s) {empty}")
    shortlisted = _descend(menu, ranges, {n: _shortlist(c) for n, c in allowed.items()}, name)
    if shortlisted.feasible or all(len(c) == len(_shortlist(c)) for c in allowed.values()):
        return shortlisted
    return _descend(menu, ranges, allowed, name)


def _descend(menu: Menu, ranges: dict[str, DeviceRange], allowed: dict[str, list[Config]],
             name: str) -> PlanResult:
    evaluator = menu.evaluator
    plan = ExecutionPlan.of({n: _smallest(menu, n, ranges[n], allowed[n]) for n in ranges})
    best = evaluator.evaluate(plan)
    if not best.fits:
        return PlanResult(name, plan, best, "; ".join(str(v) for v in best.memory.violations))
    improved = True
    while improved:
        improved = False
        for n in ranges:
            for config in allowed[n]:
                trial = plan.replace(**{n: config.at(ranges[n])})
                result = evaluator.evaluate(trial)
                if result.step_seconds < best.step_seconds * (1 - 1e-9):
                    plan, best, improved = trial, result, True
    return PlanResult(name, plan, best)


def colocate(menu: Menu) -> PlanResult:
    """All MFCs on all devices, one (d, f, t) for all; the best such plan."""
    names = list(menu.configs)
    everything = DeviceRange(0, menu.evaluator.cluster.num_devices - 1)
    size = everything.size
    shared = None
    for n in names:
        degrees = {c.degrees for c in menu.configs[n].get(size, [])}
        shared = degrees if shared is None else shared & degrees
    best = PlanResult("colocate", None, None,
                      "no (d, f, t, p) is legal for every MFC on all devices")
    for degrees in sorted(shared or ()):
        allowed = {n: [c for c in menu.configs[n][size] if c.degrees == degrees] for n in names}
        result = descend(menu, {n: everything for n in names}, allowed, "colocate")
        if best.plan is None or result.step_seconds < best.step_seconds:
            best = result
    return best


def _heuristic_degrees(experiment: Experiment, cluster: Cluster) -> tuple[int, list[int]]:
    """Megatron's rules: tensor parallelism inside a host, as wide as every model's heads allow;
    then pipeline degrees that divide every model's layers, fewest stages first."""
    models = [experiment.model(role) for role, _ in experiment.models]
    tensor = max(t for t in range(1, cluster.devices_per_host + 1)
                 if cluster.devices_per_host % t == 0 and cluster.num_devices % t == 0
                 and all(m.num_heads % t == 0 and m.num_kv_heads % t == 0 for m in models))
    stages = [p for p in range(1, cluster.num_devices // tensor + 1)
              if (cluster.num_devices // tensor) % p == 0
              and all(m.num_layers % p == 0 for m in models)]
    return tensor, stages


def heuristic(evaluator: Evaluator, micro_batches: tuple[int, ...]) -> PlanResult:
    """ReaL's heuristic baseline: one symmetric 3D strategy for every MFC, on all devices.

    Megatron-style rules, not the cost model, pick it: tensor parallelism inside a host
    (`_heuristic_degrees`), the fewest pipeline stages with which the plan fits, data
    parallelism over the remaining devices (no fsdp: Megatron has none), and one micro-batch
    count for all MFCs, the fewest that fits and, with a pipeline, is at least 2p, which keeps
    a 1F1B bubble under a third. (ReaL's tables: 70B+7B on 128 GPUs took TP8 PP4 DP4 with 8 micro-batches,
    7B+7B on 16 took TP8 DP2 with 4.) Only a strategy every MFC runs as priced
    (`space.runs_as_priced`: no pipeline where a mixture of experts trains) is tried.
    """
    experiment, cluster = evaluator.experiment, evaluator.cluster
    everything = DeviceRange(0, cluster.num_devices - 1)
    tensor, stages = _heuristic_degrees(experiment, cluster)
    mfcs = experiment.model_mfcs()
    names = [m.name for m in mfcs]
    last = PlanResult("heuristic", None, None, "no symmetric 3D strategy is legal")
    for p in stages:
        data = cluster.num_devices // (tensor * p)
        degrees = Config(data, 1, tensor, 1, p)
        if not all(runs_as_priced(mfc, cluster, experiment.model(mfc.role), degrees)
                   for mfc in mfcs):
            continue
        floor = min(2 * p, max(micro_batches)) if p > 1 else 1
        for k in sorted(m for m in micro_batches if m >= floor):
            rows = {n: experiment.workload.rows(experiment.graph.mfc(n).call) for n in names}
            if any(r % (k * data) for r in rows.values()):
                continue
            choice = CallChoice(everything, data, 1, tensor, k, p)
            plan = ExecutionPlan.of({n: choice for n in names})
            evaluation = evaluator.evaluate(plan)
            if evaluation.fits:
                return PlanResult("heuristic", plan, evaluation)
            last = PlanResult("heuristic", plan, evaluation, "; ".join(
                str(v) for v in evaluation.memory.violations))
    return last


def placed(menu: Menu, kind: Placement) -> PlanResult:
    """The device blocks of a placement strategy, with the best strategy per MFC."""
    experiment, cluster = menu.evaluator.experiment, menu.evaluator.cluster
    name = kind.value
    try:
        strategies = resolve_placement(experiment.graph, kind, cluster.num_devices)
    except PlacementError as e:
        return PlanResult(name, None, None, str(e))
    ranges = {}
    for mfc_name, strategy in strategies.items():
        try:
            cluster.check_devices(strategy.devices)
        except ValueError as e:
            return PlanResult(name, None, None, f"MFC {mfc_name}: {e}")
        ranges[mfc_name] = strategy.devices
    allowed = {n: menu.configs[n].get(ranges[n].size, []) for n in ranges}
    return descend(menu, ranges, allowed, name)


def baseline(menu: Menu, kind: Placement) -> PlanResult:
    match kind:
        case Placement.COLOCATE:
            return colocate(menu)
        case Placement.STANDALONE | Placement.SPLIT | Placement.INTERLEAVE:
            return placed(menu, kind)
    raise ValueError(f"{kind.value} is not a baseline")


@dataclasses.dataclass(frozen=True)
class SearchOptions:
    """Annealing budget and schedule.

    Attributes:
      iterations: proposals at most.
      time_limit_s: wall-clock budget of the annealing.
      seed: of the proposal generator (the search is deterministic given seed and iterations
        when the time limit does not bind).
      t_start, t_end: temperature, as a relative step-time increase accepted with prob. 1/e.
    """

    iterations: int = 10000
    time_limit_s: float = 20.0
    seed: int = 0
    t_start: float = 0.05
    t_end: float = 0.0005


@dataclasses.dataclass(frozen=True)
class SearchReport:
    """The searched plan, the baselines, and what the search cost."""

    searched: PlanResult
    baselines: dict[str, PlanResult]
    search_seconds: float
    evaluations: int
    configured: PlanResult | None = None  # the run's own plan (placement.kind=manual), priced
    search_cpu_seconds: float = 0.0  # this process's CPU time (wall time on a shared machine
    # counts other processes' load too)

    def plans(self) -> dict[str, PlanResult]:
        """Every plan by name: searched, the baselines, and the configured one if any."""
        found = {"searched": self.searched, **self.baselines}
        return found | ({"configured": self.configured} if self.configured else {})

    def best(self, count: int) -> list[PlanResult]:
        """The `count` fastest plans that fit by the memory model (searched and baselines; a
        plan found under two names once, by its first), fastest first: the plans a compile
        tries in turn until XLA says one fits."""
        feasible = sorted((r for r in self.plans().values() if r.feasible),
                          key=lambda r: r.step_seconds)  # stable: "searched" wins a tie
        distinct: dict[ExecutionPlan, PlanResult] = {}
        for r in feasible:
            distinct.setdefault(r.plan, r)
        return list(distinct.values())[:count]

    @property
    def best_baseline(self) -> PlanResult:
        return min(self.baselines.values(), key=lambda r: r.step_seconds)


class _Proposer:
    """Random one-MFC changes of a plan."""

    def __init__(self, menu: Menu, rng: random.Random):
        self.menu, self.rng = menu, rng
        experiment = menu.evaluator.experiment
        self.names = list(menu.configs)
        self.role_of = {n: experiment.graph.mfc(n).role for n in self.names}

    def __call__(self, plan: ExecutionPlan) -> ExecutionPlan | None:
        name = self.rng.choice(self.names)
        current = plan[name]
        move = self.rng.random()
        if move < 0.35:
            choice = self._anywhere(name)
        elif move < 0.55:
            choice = self._reconfigure(name, current)
        elif move < 0.70:
            choice = self._shift(name, current)
        elif move < 0.85:
            choice = self._join(name, plan, same_role=True)
        else:
            choice = self._join(name, plan, same_role=False)
        if choice is None or choice == current:
            return None
        return plan.replace(**{name: choice})

    def _anywhere(self, name: str) -> CallChoice:
        size = self.rng.choice(self.menu.sizes(name))
        devices = self.rng.choice(self.menu.ranges[name][size])
        return self.rng.choice(self.menu.configs[name][size]).at(devices)

    def _reconfigure(self, name: str, current: CallChoice) -> CallChoice:
        return self.rng.choice(self.menu.configs[name][current.devices.size]).at(current.devices)

    def _shift(self, name: str, current: CallChoice) -> CallChoice:
        devices = self.rng.choice(self.menu.ranges[name][current.devices.size])
        return dataclasses.replace(current, devices=devices)

    def _join(self, name: str, plan: ExecutionPlan, same_role: bool) -> CallChoice | None:
        """Another MFC's devices; with `same_role` also its (f, t), to share its parameters."""
        others = [n for n in self.names if n != name
                  and (self.role_of[n] is self.role_of[name]) == same_role]
        if not others:
            return None
        target = plan[self.rng.choice(others)]
        configs = self.menu.configs[name].get(target.devices.size, [])
        if same_role:
            configs = [c for c in configs if (c.fsdp, c.tensor, c.pipeline)
                       == (target.fsdp, target.tensor, target.pipeline)]
        return configs[0].at(target.devices) if configs else None


def anneal(menu: Menu, start: ExecutionPlan, options: SearchOptions) -> ExecutionPlan:
    """The best plan the chain visits (the start if nothing better fits)."""
    evaluator = menu.evaluator
    rng = random.Random(options.seed)
    propose = _Proposer(menu, rng)
    current = best = start
    current_s = best_s = evaluator.evaluate(start).step_seconds
    if not math.isfinite(current_s):
        raise ValueError("annealing needs a start plan that fits")
    deadline = time.perf_counter() + options.time_limit_s
    ratio = options.t_end / options.t_start
    for i in range(options.iterations):
        if i % 64 == 0 and time.perf_counter() > deadline:
            break
        proposal = propose(current)
        if proposal is None:
            continue
        seconds = evaluator.evaluate(proposal).step_seconds
        if not math.isfinite(seconds):
            continue
        temperature = options.t_start * ratio ** (i / options.iterations)
        delta = (seconds - current_s) / current_s
        if delta <= 0 or rng.random() < math.exp(-delta / temperature):
            current, current_s = proposal, seconds
            if seconds < best_s:
                best, best_s = proposal, seconds
    return best


def exhaustive(menu: Menu, limit: int = 1_000_000) -> ExecutionPlan | None:
    """The optimum over every combination of per-MFC choices, or None when nothing fits."""
    names = list(menu.configs)
    total = math.prod(menu.count(n) for n in names)
    if total > limit:
        raise ValueError(f"{total} plans exceed the exhaustive limit of {limit}")
    best, best_s = None, math.inf
    for combo in itertools.product(*(list(menu.choices(n)) for n in names)):
        plan = ExecutionPlan.of(dict(zip(names, combo)))
        seconds = menu.evaluator.evaluate(plan).step_seconds
        if seconds < best_s:
            best, best_s = plan, seconds
    return best


def _everything(menu: Menu) -> PlanResult:
    """A fallback start: all MFCs on all devices, each with its own best strategy."""
    everything = DeviceRange(0, menu.evaluator.cluster.num_devices - 1)
    allowed = {n: menu.configs[n].get(everything.size, []) for n in menu.configs}
    return descend(menu, {n: everything for n in menu.configs}, allowed, "all devices")


def search(experiment: Experiment, cluster: Cluster,
           options: SearchOptions = SearchOptions(), sim: SimOptions = SimOptions(),
           space: SpaceOptions = SpaceOptions(),
           baselines: tuple[Placement, ...] = BASELINES) -> SearchReport:
    """Baselines, then annealing from the best of them."""
    t0, cpu0 = time.perf_counter(), time.process_time()
    evaluator = Evaluator(experiment, cluster, sim)
    menu = Menu(evaluator, space)
    results = {kind.value: baseline(menu, kind) for kind in baselines}
    results["heuristic"] = heuristic(evaluator, space.micro_batches)
    start = min([*results.values(), _everything(menu)], key=lambda r: r.step_seconds)
    if not start.feasible:
        reasons = "; ".join(f"{n}: {r.reason}" for n, r in results.items())
        searched = PlanResult("searched", None, None, f"no baseline fits ({reasons})")
    else:
        plan = anneal(menu, start.plan, options)
        searched = PlanResult("searched", plan, evaluator.evaluate(plan))
    return SearchReport(searched, results, time.perf_counter() - t0, evaluator.evaluations,
                        search_cpu_seconds=time.process_time() - cpu0)
