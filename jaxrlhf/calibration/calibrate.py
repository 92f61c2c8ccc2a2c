"""`python -m jaxrlhf.plan --calibrate`: time real MFCs here and fit the cluster's efficiencies.

A probe is the config's RL graph colocated on all devices with one strategy and one batch size
(`Probe`), frozen models kept on the devices. Each runs through `measure.LiveRun`: a step that
compiles, a step that warms up, then rounds in which every model MFC is timed on its own and
every frozen model is moved to host memory and back (medians over `repeats` rounds). Each
timing is a `Record`: the cost model's estimate at unit efficiency (shapes, strategy,
micro-batches; or the movement) beside the measured seconds. `fit` hands all records to
`cost.fit_calibration`; `calibration_path` says where the result goes (`load_cluster` reads it
from there).

With `interleave`, all probes are open at once and their rounds alternate, so a shared
machine's changing load falls on every probe alike instead of skewing the ones measured while
it was busy; it holds every probe's models in memory together, which a CPU can afford.

Probes use all devices, varying strategy and batch: on a CPU the "devices" are threads sharing
a few cores, so a sub-mesh is not a smaller machine, and the runs the planner must get right
(colocated plans) are whole-cluster ones. Varying data, tensor and fsdp degrees exercises the
collectives; varying the batch separates per-token work from per-call and per-layer overheads.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import datetime
import math
import pathlib
from collections.abc import Callable, Sequence

from ml_collections import ConfigDict

from jaxrlhf import shipped
from jaxrlhf.mfc import MFC, Role
from jaxrlhf.models.config import ModelConfig
from jaxrlhf.parallel.strategy import Strategy
from jaxrlhf.plan import cost as cost_lib
from jaxrlhf.calibration import measure
from jaxrlhf.plan.cluster import OVERHEADS, Calibration, Cluster, calibration_candidates
from jaxrlhf.plan.experiment import Experiment
from jaxrlhf.schema import ConfigError
from jaxrlhf.spec import run_spec

Log = Callable[[str], None]


@dataclasses.dataclass(frozen=True)
class Probe:
    """One calibration run: every MFC colocated on all devices with `strategy`.

    Attributes:
      strategy: parallel degrees without a device range, e.g. "d4t2".
      batch_size: prompts per step (rollout.batch_size).
    """

    strategy: str
    batch_size: int

    def __str__(self) -> str:
        return f"{self.strategy}@{self.batch_size}"

    @classmethod
    def parse(cls, text: str) -> "Probe":
        """From "STRATEGY@PROMPTS", e.g. "d4t2@32"."""
        strategy, sep, batch = text.strip().partition("@")
        if not sep or not strategy or not batch.isdigit():
            raise ValueError(f"probe {text!r} is not STRATEGY@PROMPTS, e.g. d4t2@32")
        return cls(strategy, int(batch))


def parse_probes(text: str) -> tuple[Probe, ...]:
    """Comma-separated probes, e.g. "d8@32,d4t2@128"."""
    return tuple(Probe.parse(item) for item in text.split(",") if item.strip())


def _legal(strategy: Strategy, cluster: Cluster, models: Sequence[ModelConfig]) -> bool:
    t, p = strategy.tensor, strategy.pipeline
    return cluster.devices_per_host % t == 0 and all(
        m.num_heads % t == 0 and m.num_kv_heads % t == 0 and m.num_layers % p == 0
        for m in models)


def default_probes(config: ConfigDict, cluster: Cluster) -> tuple[Probe, ...]:
    """Data, tensor, fsdp and pipeline parallel on all devices, at the config's batch and 4
    times it.

    Strategies a model or the batch does not allow are left out.
    """
    n = cluster.num_devices
    candidates = [Strategy(data=n)]
    if n % 2 == 0:
        candidates += [Strategy(data=n // 2, tensor=2), Strategy(fsdp=n),
                       Strategy(data=n // 2, pipeline=2)]
    models = [model for _, model in run_spec(config).experiment().models]
    mini_batches = config.ppo.mini_batches
    probes = []
    for strategy in candidates:
        for prompts in (config.rollout.batch_size, 4 * config.rollout.batch_size):
            per_update = prompts * config.rollout.group_size // mini_batches
            if _legal(strategy, cluster, models) and per_update % strategy.dp_size == 0:
                probes.append(Probe(strategy.axes_str(), prompts))
    return tuple(probes)


def probe_config(config: ConfigDict, probe: Probe) -> ConfigDict:
    """The config with every MFC colocated under the probe's strategy and batch size, and frozen
    models kept on the devices (their movements are timed apart, not inside their calls)."""
    probed = copy.deepcopy(config)
    probed.placement.kind = "colocate"
    probed.placement.strategy = probe.strategy
    probed.placement.allocation = ""
    probed.placement.offload_frozen = False
    probed.rollout.batch_size = probe.batch_size
    return probed


@dataclasses.dataclass(frozen=True)
class Record:
    """One MFC (or parameter movement) timed on its own under one probe.

    Attributes:
      mfc: its name; "realloc:NAME" for the copy MFC NAME reallocated, "offload:ROLE" for a
        frozen model's trip to host memory and back.
      probe: the run it was timed in.
      seconds: median measured seconds.
      spread: interquartile range / median of the measurements.
      cost: the cost model's estimate at unit efficiency.
    """

    mfc: str
    probe: Probe
    seconds: float
    spread: float
    cost: cost_lib.CallCost


def mfc_cost(experiment: Experiment, mfc: MFC, choice, cluster: Cluster) -> cost_lib.CallCost:
    return cost_lib.call_cost(experiment.profile(mfc.role), mfc.call, experiment.workload,
                              choice, cluster, experiment.master(mfc.role))


def records_of(run: measure.LiveRun, times: dict[str, measure.Timing],
               offloads: dict[Role, measure.Timing], probe: Probe,
               cluster: Cluster) -> list[Record]:
    """Records of the MFCs timed in `run` (their reallocations apart: a call off its model's
    home layout copies a new parameter version every round, as every round trains), and of the
    frozen models' trips to host memory and back."""
    experiment = run.spec.experiment()
    plan = run.plan
    records = []
    for name, t in times.items():
        mfc = experiment.graph.mfc(name)
        p, choice = experiment.profile(mfc.role), plan[name]
        records.append(Record(name, probe, t.median, t.spread,
                              mfc_cost(experiment, mfc, choice, cluster)))
        if t.moved_median > 0:
            home = plan[experiment.home_mfc(mfc.role)]
            records.append(Record(f"realloc:{name}", probe, t.moved_median, t.moved_spread,
                                  cost_lib.realloc_cost(p, home, choice, cluster).cost))
    for role, t in offloads.items():
        p, home = experiment.profile(role), plan[experiment.home_mfc(role)]
        records.append(Record(t.name, probe, t.median, t.spread,
                              cost_lib.offload_cost(p, home, cluster).times(2)))
    return records


def _log_probe(log: Log, probe: Probe, records: Sequence[Record]) -> None:
    log(f"probe {probe}: " + ", ".join(f"{r.mfc} {1e3 * r.seconds:.1f} ms" for r in records))


def _open(stack: contextlib.ExitStack, config: ConfigDict, probe: Probe) -> measure.LiveRun:
    run = stack.enter_context(measure.live_run(probe_config(config, probe)))
    run.steps(2)  # compile, then warm up
    return run


def measure_probes(config: ConfigDict, probes: Sequence[Probe], cluster: Cluster, repeats: int,
                   interleave: bool, log: Log = print) -> list[Record]:
    """Records of every probe: each compiled, warmed up and timed for `repeats` rounds."""
    records = []
    if not interleave:
        for probe in probes:
            with contextlib.ExitStack() as stack:
                run = _open(stack, config, probe)
                found = records_of(run, *run.time_rounds(repeats), probe, cluster)
            _log_probe(log, probe, found)
            records += found
        return records
    with contextlib.ExitStack() as stack:
        runs = []
        for probe in probes:
            runs.append(_open(stack, config, probe))
            log(f"probe {probe}: compiled")
        timed = [run.time_rounds(1) for run in runs]
        for _ in range(repeats - 1):
            timed = [tuple(map(measure.merge, old, run.time_rounds(1)))
                     for old, run in zip(timed, runs)]
        for probe, run, (times, offloads) in zip(probes, runs, timed):
            found = records_of(run, times, offloads, probe, cluster)
            _log_probe(log, probe, found)
            records += found
    return records


def fit(records: Sequence[Record], cluster: Cluster) -> Calibration:
    """The calibration that best explains `records` (unexercised terms keep the cluster's)."""
    today = datetime.date.today().isoformat()
    probes = sorted({str(r.probe) for r in records})
    return cost_lib.fit_calibration(
        [(r.cost, r.seconds) for r in records], cluster.calibration(),
        source=f"fit on {len(records)} timings ({', '.join(probes)}), {today}")


def calibrate(config: ConfigDict, cluster: Cluster, probes: Sequence[Probe], repeats: int = 5,
              interleave: bool = False, log: Log = print) -> tuple[Calibration, list[Record]]:
    """Measures every probe and fits the cluster's efficiencies and overheads."""
    if not probes:
        raise ValueError("calibration needs at least one probe")
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    records = measure_probes(config, probes, cluster, repeats, interleave, log)
    return fit(records, cluster), records


def calibration_path(cluster_file: str, cluster: Cluster, workdir: str | None) -> pathlib.Path:
    """Where `load_cluster` looks first: the workdir's calibration/, else meshes/calibration/
    beside the cluster file (a checkout's, or the user's own).

    Raises:
      ConfigError: no workdir, and the cluster file lies in an installed copy of the package,
        which nothing writes into.
    """
    resolved = pathlib.Path(shipped.resolve(cluster_file))
    if not workdir and shipped.in_installed_package(resolved):
        raise ConfigError(f"--workdir: the cluster file {resolved} lies in the installed "
                          "package, which --calibrate does not write into; give --workdir=DIR "
                          f"to write DIR/calibration/{cluster.name}.json")
    return calibration_candidates(resolved, cluster.name, workdir)[0]


def _row(cells: Sequence[str], widths: Sequence[int]) -> str:
    return "  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip()


def records_table(records: Sequence[Record], before: Cluster, after: Cluster) -> str:
    """Measured vs predicted seconds per record, with the cluster file's and the fitted values."""
    header = ("probe", "MFC", "measured ms", "spread", "default ms", "fitted ms", "fit error")
    rows = [header]
    for r in records:
        fitted = r.cost.seconds(after)
        rows.append((str(r.probe), r.mfc, f"{1e3 * r.seconds:.2f}", f"{r.spread:.2f}",
                     f"{1e3 * r.cost.seconds(before):.2f}", f"{1e3 * fitted:.2f}",
                     f"{100 * (fitted / r.seconds - 1):+.0f}%"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = [_row(row, widths) for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    errors = [abs(math.log(max(r.cost.seconds(after), 1e-9) / r.seconds)) for r in records]
    lines.append(f"geometric mean error: {100 * (math.exp(sum(errors) / len(errors)) - 1):.0f}%")
    return "\n".join(lines)


def describe(calibration: Calibration) -> str:
    c = calibration
    overheads = ", ".join(f"{name} {1e6 * getattr(c, name):.0f} us" for name in OVERHEADS
                          if getattr(c, name) is not None)
    return (f"matmul_efficiency {c.matmul_efficiency:.3g}, hbm_efficiency "
            f"{c.hbm_efficiency:.3g}, comm_efficiency {c.comm_efficiency:.3g}, {overheads}")
