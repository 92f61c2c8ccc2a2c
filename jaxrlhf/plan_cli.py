"""The planner's command line, `python -m jaxrlhf.plan` (`jaxrlhf/plan/__main__.py` forwards
here: an entry point sits above the run stack, the planner below it).

  python -m jaxrlhf.plan --config=configs/ppo_70b.py --cluster=meshes/a100_16x8.py [--json]

Searches an execution plan for an experiment on a cluster and prints it beside the baselines
(colocate, standalone, split, interleave, and ReaL's Megatron-rule `heuristic`), as tables like
ReaL's Tables 2-6, with the step time of each and the searched plan's speedup; `--json` prints
one JSON object instead ({"plans": {NAME: {"step_seconds", "mfc_seconds", "mfcs", ...}}}).
With `--config.placement.kind=manual --config.placement.allocation=...` the given plan is
priced too, as plan `configured`: the plan the run would run (`run.layouts.execution_plan`; an
MFC without `@N` gets the run's default micro-batches). The searched plan's
`placement.allocation` line (micro-batches included, `@N`) can be pasted into a run
(`placement.kind=manual`); `placement.kind=auto` runs the same plan object.

Two modes run the config's MFCs on this machine's devices, which must be the cluster's:
  * `--calibrate` times the MFCs under a few strategies and batch sizes (`--probes`, default
    `calibrate.default_probes`), fits the cluster's efficiencies and overheads
    (`cost.fit_calibration`) and writes them to `<workdir>/calibration/NAME.json`, or
    `meshes/calibration/NAME.json` beside the cluster file, where `load_cluster` finds them
    (never into an installed package: there `--workdir` is required);
  * `--validate` runs the configured plan (`placement.*`) for `--steps` steps and prints the
    calibrated prediction beside the measurement: seconds per MFC and per step, and the memory
    model beside `memory_analysis()` of each compiled MFC.

`--compile` needs no devices at all: it compiles every call of a plan for the cluster's own
hardware from this host (`calibration/aot.py`, `calibration/targets.py`: a TPU slice that libtpu
describes by the cluster file's topology, or GPUs that JAX's CUDA plugin describes by its
topology and target description) and prints, per call, XLA's peak bytes per device beside the
memory model's, whether it fits, XLA's FLOPs beside the cost model's, the attention kernels it
compiled and the compile seconds. The plan is the one the run would run on that cluster
(`placement.kind` colocate, split, ..., manual), or with `placement.kind=auto` the searched
plans best first (`--compile_plans` of them, baselines included) until one fits by XLA's
account. Then the parameter movements between the chosen plan's layouts: the collective hops
`parallel/reshard.py` runs, compiled chunk by chunk as it runs them, their collective bytes
beside the planner's and their peak bytes per device beside the memory model's
(`plan.moves.move_memory`). No weights
are read: `require_model_paths` does not apply. With `--explain` a line per call follows the
table: what XLA holds at the peak of its largest program, by JAX source (XLA's live ranges,
`calibration/peaks.py`; TPU and GPU): the memory model's misses are read there. Its last line
is one JSON object,
`{"compile": {"platform", "topology", "limit_bytes", "plan", "calls": {NAME: ...},
"reallocations": [...]}}`.
"""

from __future__ import annotations

import dataclasses
import json
import os

import jax.numpy as jnp
from absl import flags, logging
from ml_collections import config_flags

from jaxrlhf import cli
from jaxrlhf.dataflow.placement import Placement
from jaxrlhf.plan import report as report_lib
from jaxrlhf.plan.choice import ExecutionPlan
from jaxrlhf.mfc import Call, Role
from jaxrlhf.models.sizes import param_count
from jaxrlhf.plan.cluster import Cluster, load_cluster, save_calibration
from jaxrlhf.plan.evaluate import Evaluator, SimOptions
from jaxrlhf.plan.search import PlanResult, SearchOptions, search
from jaxrlhf.plan.simulator import dispatch_order
from jaxrlhf.plan.weight_sync import sync_price
from jaxrlhf.run.layouts import execution_plan
from jaxrlhf.schema import ConfigError, field
from jaxrlhf.spec import run_spec

_CONFIG = config_flags.DEFINE_config_file("config", None, "experiment config file")
_CLUSTER = flags.DEFINE_string("cluster", None, "cluster file, e.g. meshes/a100_16x8.py")
_JSON = flags.DEFINE_bool("json", False, "print one JSON object")
_SEED = flags.DEFINE_integer("seed", 0, "seed of the annealing proposals")
_ITERATIONS = flags.DEFINE_integer("iterations", SearchOptions.iterations, "annealing proposals",
                                   lower_bound=0)
_TIME_LIMIT = flags.DEFINE_float("time_limit", SearchOptions.time_limit_s,
                                 "annealing wall-clock budget in seconds", lower_bound=0)
_OVERLAP = flags.DEFINE_bool("overlap_steps", SimOptions.overlap_steps,
                             "let consecutive steps overlap where dependencies allow")
_WORKDIR = flags.DEFINE_string("workdir", None, "run directory whose calibration/ wins")
_CALIBRATE = flags.DEFINE_bool("calibrate", False, "time MFCs here and fit efficiencies")
_VALIDATE = flags.DEFINE_bool("validate", False,
                              "run the configured plan here: predicted vs measured")
_PROBES = flags.DEFINE_string("probes", "", "calibration runs, e.g. d8@32,d4t2@128 "
                              "(STRATEGY@PROMPTS); empty: calibrate.default_probes")
_REPEATS = flags.DEFINE_integer("repeats", 7, "calibration: timed runs of each MFC",
                                lower_bound=1)  # no timings have no median
_STEPS = flags.DEFINE_integer("steps", 5, "validation: timed steps after the compiling one",
                              lower_bound=1)
_COMPILE = flags.DEFINE_bool("compile", False, "compile every call for the cluster's hardware "
                             "here, without it: XLA's memory and FLOPs beside the models'")
_EXPLAIN = flags.DEFINE_bool("explain", False, "with --compile: what XLA holds at each call's "
                             "peak, by source (its live ranges; TPU and GPU)")
_COMPILE_PLANS = flags.DEFINE_integer("compile_plans", 3, "--compile: searched plans to try, "
                                      "best first, until one fits", lower_bound=1)


def _use_devices(cluster: Cluster) -> None:
    """Presents the cluster's devices: on a CPU, that many virtual devices (before JAX starts)."""
    flag = f"--xla_force_host_platform_device_count={cluster.num_devices}"
    if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {flag}".strip()
    import jax

    if jax.process_count() > 1:
        raise ConfigError("--calibrate/--validate run on one host (one process)")
    here = jax.devices()[0].platform
    if here != cluster.platform.value:  # a fit or comparison of another machine's timings
        raise ConfigError(f"--cluster: {cluster.name} is a {cluster.platform.value.upper()} "
                          f"cluster but this machine presents {here.upper()} devices; "
                          "--calibrate and --validate time MFCs on the cluster's own devices "
                          "(--compile compiles for it without them)")
    if jax.device_count() != cluster.num_devices:
        raise ConfigError(f"--cluster: {cluster.name} has {cluster.num_devices} devices but this "
                          f"machine presents {jax.device_count()} ({jax.devices()[0].platform})")


def _calibrate(config, cluster: Cluster) -> None:
    from jaxrlhf.calibration import calibrate

    # Where it will write, refused before any device is touched.
    path = calibrate.calibration_path(_CLUSTER.value, cluster, _WORKDIR.value)
    _use_devices(cluster)
    probes = (calibrate.parse_probes(_PROBES.value) if _PROBES.value
              else calibrate.default_probes(config, cluster))
    print(f"calibrating {cluster.name} on {len(probes)} probes: "
          f"{', '.join(map(str, probes))}", flush=True)
    log = lambda line: print(line, flush=True)
    import jax

    # Virtual CPU devices share the host's cores with whatever else runs: interleave the probes.
    interleave = jax.devices()[0].platform == "cpu"
    calibration, records = calibrate.calibrate(config, cluster, probes, _REPEATS.value,
                                               interleave, log)
    fitted = cluster.calibrated(calibration)
    print(calibrate.records_table(records, cluster, fitted))
    print(f"cluster file: {calibrate.describe(cluster.calibration())}")
    print(f"fitted:       {calibrate.describe(calibration)}")
    print(f"wrote {save_calibration(path, calibration)}")


def _validate(config, cluster: Cluster) -> None:
    from jaxrlhf.calibration import validate

    _use_devices(cluster)
    source = cluster.calibration().source or "uncalibrated: the cluster file's efficiencies"
    print(f"validating the configured plan on {cluster.name} ({source})", flush=True)
    result = validate.validate(config, cluster, _STEPS.value)
    print(validate.time_table(result) + "\n")
    print(validate.memory_table(result))


def _configured_plan(spec, cluster: Cluster) -> ExecutionPlan | None:
    """placement.kind=manual: the plan the run would run (`run.layouts.execution_plan`, the
    runtime's one door from a placement to a plan: an MFC without `@N` gets the run's default),
    on the cluster's devices."""
    if spec.placement.kind is not Placement.MANUAL:
        return None
    with field("placement.allocation"):
        return execution_plan(spec, cluster.num_devices)


def _search(config, cluster: Cluster) -> None:
    spec = run_spec(config)
    experiment = spec.experiment()
    configured = _configured_plan(spec, cluster)
    options = SearchOptions(iterations=_ITERATIONS.value, time_limit_s=_TIME_LIMIT.value,
                            seed=_SEED.value)
    sim = SimOptions(overlap_steps=_OVERLAP.value)
    report = search(experiment, cluster, options, sim)
    if configured is not None:
        evaluation = Evaluator(experiment, cluster, sim).evaluate(configured)
        reason = "; ".join(str(v) for v in evaluation.memory.violations)
        report = dataclasses.replace(
            report, configured=PlanResult("configured", configured, evaluation, reason))
    if _JSON.value:
        print(json.dumps(report_lib.to_json(report, cluster, experiment.decode), indent=1,
                         sort_keys=True))
        return
    order = dispatch_order(experiment)
    for result in report.plans().values():
        print(report_lib.plan_table(result, cluster, order) + "\n")
    print(report_lib.summary(report))
    print(f"pipelined generation priced with the {experiment.decode.value} decode schedule")
    for result in report.plans().values():
        print(_sync_line(spec, result, cluster))
    if report.searched.plan is not None:
        # cluster= cleared: a manual plan reads no cluster (the run refuses one it ignores).
        print(f"\nplacement.kind=manual placement.cluster= placement.allocation="
              f"{report_lib.allocation(report.searched)}")


def _sync_line(spec, result: PlanResult, cluster: Cluster) -> str:
    """The actor's weight sync per version under `result`'s plan (`plan/weight_sync.py`), in
    the parameters' storage dtype (what `reshard` moves)."""
    if result.plan is None:
        return f"weight sync per version, plan {result.name}: no plan"
    mfcs = spec.graph.calls_of(Role.ACTOR)
    train = [m.name for m in mfcs if m.call is Call.TRAIN_STEP and m.name in result.plan]
    gen = [m.name for m in mfcs if m.call is Call.GENERATE and m.name in result.plan]
    if not train or not gen:
        return f"weight sync per version, plan {result.name}: the actor does not generate"
    config = spec.base.config
    model_bytes = param_count(config) * jnp.dtype(config.param_dtype).itemsize
    price = sync_price(model_bytes, result.plan[train[0]], result.plan[gen[0]], cluster)
    if price is None:
        return (f"weight sync per version, plan {result.name}: {gen[0]} shares devices with "
                f"{train[0]} (priced as the plan's parameter reallocation)")
    return f"weight sync per version, plan {result.name}: {price.describe()}"


def _candidates(spec, cluster: Cluster) -> list[PlanResult]:
    """The plans `--compile` tries, best first: the one the run would run on the cluster
    (every placement kind but auto), else the search's feasible plans by step time,
    `--compile_plans` of them."""
    kind = spec.placement.kind
    if kind is not Placement.AUTO:
        with field(f"placement.{'allocation' if kind is Placement.MANUAL else 'kind'}"):
            return [PlanResult(kind.value, execution_plan(spec, cluster.num_devices), None)]
    report = search(spec.experiment(), cluster, SearchOptions(
        iterations=_ITERATIONS.value, time_limit_s=_TIME_LIMIT.value, seed=_SEED.value),
        SimOptions(overlap_steps=_OVERLAP.value))
    best = report.best(_COMPILE_PLANS.value)
    if not best:
        raise ConfigError(f"--cluster: no plan fits {cluster.name} by the memory model: "
                          f"{report.searched.reason}")
    return best


def _compile(config, cluster: Cluster) -> None:
    from jaxrlhf.calibration import aot, targets

    for name, value in targets.TPU_HOST_ENV.items():
        os.environ.setdefault(name, value)
    import jax

    jax.config.update("jax_platforms", "cpu")  # the compile targets are described, not here
    spec = run_spec(config)
    with field(f"--cluster={_CLUSTER.value}"):
        try:
            devices = targets.topology_devices(cluster)
        except targets.CompileError as e:
            raise ConfigError(str(e)) from None
    reported = targets.reported_hbm_bytes(devices)
    limit = min(cluster.usable_hbm_bytes, reported or cluster.usable_hbm_bytes)
    print(f"compiling for {cluster.name}: {cluster.topology}, {len(devices)} "
          f"{devices[0].device_kind} devices; a program may use {limit / 2**30:.2f} GiB per "
          f"device (the cluster file's usable {cluster.usable_hbm_bytes / 2**30:.2f} GiB, "
          f"XLA reports {'no limit' if reported is None else f'{reported / 2**30:.2f} GiB'})",
          flush=True)
    log = lambda line: print(line, flush=True)
    candidates = _candidates(spec, cluster)
    index, reports = aot.first_that_fits(
        spec, cluster, [(f"plan {c.name}: {report_lib.allocation(c)}", c.plan)
                        for c in candidates], devices, limit, log, explain=_EXPLAIN.value)
    chosen, fits = candidates[index], all(r.fits for r in reports)
    print(f"\n{'chosen' if fits else 'no plan fits by XLA; shown'}: plan {chosen.name}, "
          f"placement.allocation={report_lib.allocation(chosen)}")
    print("\nparameter movements between its layouts (collective hops compiled):", flush=True)
    moves = aot.compile_reallocations(spec, cluster, chosen.plan, devices, log)
    print(aot.realloc_table(moves) if moves else "none: every model keeps one layout")
    print(json.dumps({"compile": {
        "platform": cluster.platform.value, "topology": cluster.topology, "limit_bytes": limit,
        "reported_bytes": reported, "plan": chosen.name, "fits": fits,
        "allocation": report_lib.allocation(chosen), "calls": aot.to_json(reports),
        "reallocations": [dataclasses.asdict(m) for m in moves]}},
        sort_keys=True))


def main():
    if _CALIBRATE.value + _VALIDATE.value + _COMPILE.value > 1:
        raise ConfigError("--calibrate, --validate and --compile are separate runs")
    if _EXPLAIN.value and not _COMPILE.value:
        raise ConfigError("--explain: says what XLA holds at each call's peak; it needs --compile")
    with field(f"--cluster={_CLUSTER.value}"):
        cluster = load_cluster(_CLUSTER.value, workdir=_WORKDIR.value)
    if _COMPILE.value:
        logging.set_verbosity(logging.WARNING)
        _compile(_CONFIG.value, cluster)
        return
    if not (_CALIBRATE.value or _VALIDATE.value):
        import jax

        # The search only evaluates shapes abstractly; on a GPU host, keep JAX off the
        # accelerator (it would otherwise reserve most of its memory).
        jax.config.update("jax_platforms", "cpu")
        _search(_CONFIG.value, cluster)
        return
    logging.set_verbosity(logging.WARNING)  # library INFO lines would bury the tables
    (_calibrate if _CALIBRATE.value else _validate)(_CONFIG.value, cluster)


def run() -> None:
    """The command line: flags parsed, bad input one line (jaxrlhf/cli.py), then `main`."""
    flags.mark_flags_as_required(["config", "cluster"])
    cli.run(main)


if __name__ == "__main__":
    run()
