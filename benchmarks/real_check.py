"""The ReaL check: ReaL's published plans priced by the planner, beside ReaL's measurements.

`python benchmarks/real_check.py [--cluster=meshes/h100_16x8.py] [--json] [--compile]`

ReaL's appendix (`shared/papers/real_paper_appendix.txt`) gives four execution plans
(Tables 2-5: 70B+7B searched and heuristic, 7B+7B searched and heuristic) and the measured
seconds of each MFC and of the whole step (Table 6). This script writes each plan in jaxrlhf's
terms, prices it with the planner (per-MFC cost model, memory model, ReaL's Algorithm 1 over
the augmented graph) and prints prediction, measurement and relative error per MFC and step.

Memory: each MFC's peak per device (its own call plus what other models keep on its devices
meanwhile, `plan.memory.plan_memory`), whether it fits the cluster's usable memory (the
breakdown of each that does not is printed under the table), and the peak less what jaxrlhf's
runtime holds beyond ReaL's (`beyond_real`: what a pipelined train step's stages keep for the
backward pass, against 1F1B's p micro-batches).

Two pricings:
  * `file`: the cluster file's figures and default efficiencies as shipped (nothing fitted);
  * `fit7B`: efficiencies and overheads fitted (`cost.fit_calibration`) to the twelve 7B+7B
    MFC measurements only; the 70B+7B rows are then out-of-sample: the validation. Nothing is
    ever fitted to the 70B tables.

How ReaL's plans map to jaxrlhf's:
  * devices: `trainer01` is devices 0-7, `trainer[01-02]` 0-15, `trainer[01-16]` 0-127;
  * TP, PP, DP are t, p, d (no fsdp); the mesh order (pipeline, data, tensor) is ReaL's;
  * micro-batches: ReaL's `#Micro-Batches` n splits the batch for memory, and its pipeline
    runner streams 2p micro-batches per split when training and p when not
    (`PipelineRunner.default_train_mbs` / `default_inf_mbs` in ReaL's code), so jaxrlhf's
    count, the micro-batches a pipeline streams, is n·2p (train, p > 1), n·p (otherwise);
  * workload: the 7B+7B case is the base setting (512 prompts, 1024 + 1024 tokens, 8 PPO
    mini-batches, `configs/ppo_7b.py`); the 70B+7B case runs on 128 GPUs, where the weak-scaling
    setting has 4096 prompts (`configs/ppo_70b.py` with rollout.batch_size=4096). Only 4096
    splits into ReaL's micro-batch counts, and only it makes the measured seconds plausible
    (512 prompts would put the 70B actor's training at ~4% MFU, 4096 at ~30%).
  * ReaL's pipelined decoding keeps the pipeline full across tokens, so its plans are priced
    with `DecodeSchedule.ACROSS_TOKENS` (jaxrlhf's runtime schedule too, since
    `engine/pipelined_decode.py`; set explicitly so the check prices ReaL's schedule whatever
    the runtime's default);
  * generation is compared with the CUDA-graph figures (Tables 2-5 list those); the step with
    Table 6's End2End with CUDA graphs. The w/o-CUDA-graph figures are printed beside them.

`--compile` compiles every call of ReaL's 70B+7B plans (Tables 2 and 3) for the cluster's GPUs
as XLA describes them (`calibration.aot`, as `plan --compile` does; it needs the `[cuda]`
extra, and no GPU): XLA's peak per device beside the memory model's and the 80 GB ReaL ran
them in, and XLA's FLOPs beside the cost model's.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json

import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from jaxrlhf.mfc import Call  # noqa: E402
from jaxrlhf.parallel.pipeline import remats_stages  # noqa: E402
from jaxrlhf.parallel.strategy import DeviceRange  # noqa: E402
from jaxrlhf.plan import cost as cost_lib  # noqa: E402
from jaxrlhf.plan import memory  # noqa: E402
from jaxrlhf.plan.choice import CallChoice, ExecutionPlan  # noqa: E402
from jaxrlhf.plan.cluster import Cluster, load_cluster  # noqa: E402
from jaxrlhf.plan.evaluate import Evaluator  # noqa: E402
from jaxrlhf.plan.experiment import DecodeSchedule, Experiment  # noqa: E402
from jaxrlhf.spec import RunSpec, run_spec  # noqa: E402

MFCS = ("actor_gen", "reward", "ref_inf", "critic_inf", "critic_train", "actor_train")
REAL_NAMES = dict(zip(MFCS, ("ActorGen", "RewInf", "RefInf", "CriticInf", "CriticTrain",
                             "ActorTrain")))
HOSTS = {"trainer01": (0, 7), "trainer02": (8, 15), "trainer[01-02]": (0, 15),
         "trainer[01-16]": (0, 127)}


@dataclasses.dataclass(frozen=True)
class Row:
    """One row of ReaL's Tables 2-5: DeviceMesh, TP, PP, DP, #Micro-Batches, Time (s)."""

    mesh: str
    tp: int
    pp: int
    dp: int
    n_mbs: int
    seconds: float


# Tables 2-5, rows in the tables' order (ActorGen, RewInf, RefInf, CriticInf, CriticTrain,
# ActorTrain).
TABLES = {
    ("70B+7B", "searched"): (  # Table 2
        Row("trainer[01-16]", 2, 4, 16, 4, 185.1), Row("trainer[01-16]", 1, 8, 16, 4, 5.6),
        Row("trainer[01-16]", 1, 8, 16, 16, 35.6), Row("trainer[01-16]", 1, 8, 16, 16, 5.6),
        Row("trainer[01-16]", 8, 4, 4, 2, 20.8), Row("trainer[01-16]", 2, 16, 4, 2, 108.0)),
    ("70B+7B", "heuristic"): (  # Table 3
        Row("trainer[01-16]", 8, 4, 4, 8, 241.8), Row("trainer[01-16]", 8, 4, 4, 8, 12.6),
        Row("trainer[01-16]", 8, 4, 4, 8, 63.5), Row("trainer[01-16]", 8, 4, 4, 8, 12.5),
        Row("trainer[01-16]", 8, 4, 4, 8, 35.7), Row("trainer[01-16]", 8, 4, 4, 8, 163.4)),
    ("7B+7B", "searched"): (  # Table 4
        Row("trainer[01-02]", 2, 2, 4, 1, 16.3), Row("trainer01", 2, 1, 4, 16, 6.0),
        Row("trainer02", 1, 2, 4, 16, 8.0), Row("trainer[01-02]", 1, 2, 8, 8, 4.7),
        Row("trainer02", 4, 2, 1, 2, 28.1), Row("trainer01", 2, 4, 1, 2, 26.6)),
    ("7B+7B", "heuristic"): (  # Table 5
        Row("trainer[01-02]", 8, 1, 2, 4, 44.2), Row("trainer[01-02]", 8, 1, 2, 4, 7.3),
        Row("trainer[01-02]", 8, 1, 2, 4, 7.6), Row("trainer[01-02]", 8, 1, 2, 4, 6.8),
        Row("trainer[01-02]", 8, 1, 2, 4, 24.3), Row("trainer[01-02]", 8, 1, 2, 4, 24.7)),
}
# Table 6: End2End with CUDA graphs, then without; ActorGen without CUDA graphs.
END2END = {("7B+7B", "searched"): (64.0, 82.2), ("7B+7B", "heuristic"): (122.6, 183.0),
           ("70B+7B", "searched"): (383.1, 547.4), ("70B+7B", "heuristic"): (546.8, 912.3)}
GEN_NO_GRAPH = {("7B+7B", "searched"): 34.5, ("7B+7B", "heuristic"): 104.6,
                ("70B+7B", "searched"): 185.1, ("70B+7B", "heuristic"): 241.8}
CONFIGS = {"7B+7B": ("configs/ppo_7b.py", 512), "70B+7B": ("configs/ppo_70b.py", 4096)}


def spec_of(case: str) -> RunSpec:
    """The case's run spec from its shipped config (see the module docstring)."""
    path, batch = CONFIGS[case]
    spec = importlib.util.spec_from_file_location(f"_real_{pathlib.Path(path).stem}",
                                                  ROOT / path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    config = module.get_config()
    config.rollout.batch_size = batch
    return run_spec(config)


def priced(spec: RunSpec) -> Experiment:
    """A run's experiment as ReaL's plans are priced: decoding across tokens (module
    docstring)."""
    return dataclasses.replace(spec.experiment(), decode=DecodeSchedule.ACROSS_TOKENS)


def experiment_of(case: str) -> Experiment:
    """The case's experiment (see the module docstring)."""
    return priced(spec_of(case))


def micro_batches(call: Call, row: Row) -> int:
    """jaxrlhf's micro-batch count for one of ReaL's rows (module docstring)."""
    per_split = 2 * row.pp if (call is Call.TRAIN_STEP and row.pp > 1) else row.pp
    return row.n_mbs * per_split


def real_plan(experiment: Experiment, case: str, kind: str) -> ExecutionPlan:
    """ReaL's plan of Table 2-5 as an ExecutionPlan.

    On a workload other than the table's (e.g. `configs/ppo_70b.py`'s 512 prompts), a
    micro-batch count that does not split the batch becomes the largest one below it that does.
    """
    choices = {}
    for name, row in zip(MFCS, TABLES[case, kind]):
        devices = DeviceRange(*HOSTS[row.mesh])
        call = experiment.graph.mfc(name).call
        rows = experiment.workload.rows(call) // row.dp
        micro = max(k for k in range(1, micro_batches(call, row) + 1) if rows % k == 0)
        choices[name] = CallChoice(devices, data=row.dp, fsdp=1, tensor=row.tp,
                                   micro_batches=micro, pipeline=row.pp)
    return ExecutionPlan.of(choices)


def beyond_real(experiment: Experiment, plan: ExecutionPlan, name: str) -> int:
    """Bytes per device an MFC holds in jaxrlhf beyond what ReaL's runtime holds: what a
    pipelined train step's stages keep for the backward pass (GPipe: every iteration of the
    schedule's saved activations, or under full remat each iteration's stage input,
    `parallel.pipeline.remats_stages`) less ReaL's 1F1B (at most p micro-batches' saved
    activations per stage); negative where jaxrlhf keeps less, paid with one more forward.
    Its head, like ReaL's, runs one micro-batch at a time. 0 for every other MFC."""
    mfc, choice = experiment.graph.mfc(name), plan[name]
    if mfc.call is not Call.TRAIN_STEP or choice.pipeline == 1:
        return 0
    p, work, stages = experiment.profile(mfc.role), experiment.workload, choice.pipeline
    tokens = work.packed_tokens_per_device(Call.TRAIN_STEP, choice.dp_size,
                                           choice.micro_batches, stages)
    per_stage = memory.saved_activation_bytes(p, tokens, work.seq_len, choice.tensor) / stages
    runtime = memory.pipelined_saved_bytes(p, choice, tokens, work.seq_len,
                                           remats_stages(p.config.remat))
    return int(runtime - per_stage * min(choice.micro_batches, stages))


def fit_on_7b(cluster: Cluster, experiments: dict[str, Experiment]) -> Cluster:
    """The cluster with efficiencies and overheads fitted to the 7B+7B MFC times only."""
    records = []
    for kind in ("searched", "heuristic"):
        evaluator = Evaluator(experiments["7B+7B"], cluster)
        plan = real_plan(experiments["7B+7B"], "7B+7B", kind)
        for name, row in zip(MFCS, TABLES["7B+7B", kind]):
            records.append((evaluator.mfc_cost(name, plan[name]), row.seconds))
    calibration = cost_lib.fit_calibration(records, cluster.calibration(),
                                           "fit on ReaL's 7B+7B MFC times (Tables 4-6)")
    return cluster.calibrated(calibration)


def _error(predicted: float, measured: float) -> float:
    return predicted / measured - 1.0


def price(cluster: Cluster, experiments: dict[str, Experiment]) -> list[dict]:
    """One record per (case, plan, MFC or End2End): measured, predicted, relative error, the
    MFC's peak per device and whether the memory model lets it fit (the step: the whole plan),
    with the breakdown of an MFC over capacity (a plan it rejects is priced all the same)."""
    rows = []
    for (case, kind), table in TABLES.items():
        experiment = experiments[case]
        evaluator = Evaluator(experiment, cluster)
        plan = real_plan(experiment, case, kind)
        evaluation = evaluator.evaluate(plan)
        over = {v.mfc: v for v in evaluation.memory.violations}
        for name, row in zip(MFCS, table):
            predicted = evaluation.mfc_seconds[name]
            rows.append(dict(case=case, plan=kind, mfc=REAL_NAMES[name], measured=row.seconds,
                             predicted=predicted, error=_error(predicted, row.seconds),
                             fits=name not in over,
                             over=str(over[name]) if name in over else None,
                             peak_gib=evaluation.memory.peak[name] / 2**30,
                             real_held_gib=(evaluation.memory.peak[name]
                                            - beyond_real(experiment, plan, name)) / 2**30,
                             measured_no_cuda_graph=(GEN_NO_GRAPH[case, kind]
                                                     if name == "actor_gen" else None)))
        step = evaluator.simulate(plan).step_seconds
        measured, no_graph = END2END[case, kind]
        rows.append(dict(case=case, plan=kind, mfc="End2End", measured=measured,
                         predicted=step, error=_error(step, measured), fits=evaluation.fits,
                         over=None, peak_gib=None, real_held_gib=None,
                         measured_no_cuda_graph=no_graph))
    return rows


def speedups(rows: list[dict]) -> dict[str, dict[str, float]]:
    """Heuristic / searched End2End per case, predicted and measured."""
    step = {(r["case"], r["plan"]): r for r in rows if r["mfc"] == "End2End"}
    return {case: {what: step[case, "heuristic"][what] / step[case, "searched"][what]
                   for what in ("measured", "predicted")}
            for case in CONFIGS}


def table(rows: list[dict]) -> str:
    """ReaL's Table 6 layout: one line per MFC and plan, measured beside predicted."""
    header = ("case", "plan", "MFC", "measured s", "predicted s", "error", "fits",
              "peak GiB", "as ReaL holds GiB", "measured w/o CUDA graph")
    lines = [header]
    for r in rows:
        lines.append((r["case"], r["plan"], r["mfc"], f"{r['measured']:.1f}",
                      f"{r['predicted']:.1f}", f"{r['error']:+.0%}",
                      "yes" if r["fits"] else "NO", "" if r["peak_gib"] is None
                      else f"{r['peak_gib']:.1f}", "" if r["real_held_gib"] is None
                      else f"{r['real_held_gib']:.1f}",
                      "" if r["measured_no_cuda_graph"] is None
                      else f"{r['measured_no_cuda_graph']:.1f}"))
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    out = ["  ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip() for line in lines]
    out.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(out)


def summary(rows: list[dict]) -> dict[str, float]:
    """Mean absolute relative error of the MFCs and of the steps, per case."""
    out = {}
    for case in CONFIGS:
        mfcs = [abs(r["error"]) for r in rows if r["case"] == case and r["mfc"] != "End2End"]
        steps = [abs(r["error"]) for r in rows if r["case"] == case and r["mfc"] == "End2End"]
        out[f"{case} MFC mean |error|"] = sum(mfcs) / len(mfcs)
        out[f"{case} step mean |error|"] = sum(steps) / len(steps)
    return out


def check(cluster_path: str) -> dict:
    """Both pricings (see the module docstring) as one JSON-able object."""
    cluster = load_cluster(cluster_path)
    experiments = {case: experiment_of(case) for case in CONFIGS}
    fitted = fit_on_7b(cluster, experiments)
    result = {"cluster": cluster.name, "pricings": {}}
    for name, priced in (("file", cluster), ("fit7B", fitted)):
        rows = price(priced, experiments)
        result["pricings"][name] = {
            "calibration": dataclasses.asdict(priced.calibration()), "rows": rows,
            "summary": summary(rows), "speedup_heuristic_over_searched": speedups(rows)}
    return result


def compile_70b(cluster_path: str) -> dict:
    """Every call of ReaL's 70B+7B plans compiled for the cluster's GPUs (`--compile`): per
    plan, `aot.to_json` of its calls, each against the cluster's usable memory and its whole
    HBM (`fits_hbm`: the 80 GB ReaL ran them in)."""
    from jaxrlhf.calibration import aot, targets

    import jax

    jax.config.update("jax_platforms", "cpu")  # the GPUs are described, not here
    cluster = load_cluster(cluster_path)
    devices = targets.topology_devices(cluster)
    spec = spec_of("70B+7B")
    experiment = priced(spec)
    result = {"cluster": cluster.name, "hbm_bytes": cluster.hbm_bytes, "plans": {}}
    for kind in ("searched", "heuristic"):
        print(f"\n== ReaL's 70B+7B {kind} plan on {cluster.name} ==", flush=True)
        plan = real_plan(experiment, "70B+7B", kind)
        reports = aot.compile_plan(spec, cluster, plan, devices, cluster.usable_hbm_bytes,
                                   lambda line: print(line, flush=True))
        print(aot.table(reports), flush=True)
        calls = aot.to_json(reports)
        for report in reports:
            calls[report.name]["fits_hbm"] = (report.compiled
                                              and report.xla_bytes <= cluster.hbm_bytes)
        result["plans"][kind] = calls
    return result


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cluster", default="meshes/h100_16x8.py")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--compile", action="store_true",
                        help="compile ReaL's 70B plans for the cluster's GPUs (the [cuda] extra)")
    args = parser.parse_args(argv)
    path = (str(ROOT / args.cluster) if not pathlib.Path(args.cluster).is_absolute()
            else args.cluster)
    if args.compile:
        result = compile_70b(path)
        print(json.dumps({"compile": result}, sort_keys=True))
        return result
    result = check(path)
    if args.json:
        print(json.dumps(result, indent=1, sort_keys=True))
        return result
    for name, pricing in result["pricings"].items():
        c = pricing["calibration"]
        print(f"== {result['cluster']}, pricing {name}: matmul {c['matmul_efficiency']:.3f}, "
              f"HBM {c['hbm_efficiency']:.3f}, comm {c['comm_efficiency']:.3f}, layer "
              f"{c['layer_overhead'] * 1e6:.1f} us, call {c['call_overhead'] * 1e3:.2f} ms, "
              f"array {c['array_overhead'] * 1e6:.1f} us ==")
        print(table(pricing["rows"]))
        for r in pricing["rows"]:
            if r["over"]:
                print(f"{r['case']} {r['plan']}: {r['over']}")
        for key, value in pricing["summary"].items():
            print(f"{key}: {value:.0%}")
        for case, s in pricing["speedup_heuristic_over_searched"].items():
            print(f"{case} heuristic/searched step: measured {s['measured']:.2f}x, "
                  f"predicted {s['predicted']:.2f}x")
        print()
    return result


if __name__ == "__main__":
    main()

