"""Plan tables (like ReaL's Tables 2-6), the step-time summary, and the JSON form.

Every plan prints one row per MFC: device mesh, strategy, micro-batches, estimated seconds and
peak memory per device, then the parameter movements and the simulated step time. The summary
lists each plan's step time and the searched plan's speedup over each baseline.
"""

from __future__ import annotations

import math

from jaxrlhf.plan.allocation import format_allocation
from jaxrlhf.plan.choice import CallChoice
from jaxrlhf.plan.cluster import Cluster
from jaxrlhf.plan.experiment import DEFAULT_DECODE, DecodeSchedule
from jaxrlhf.plan.search import PlanResult, SearchReport

_GIB = 1 << 30
_HEADER = ("MFC", "device mesh", "strategy", "#micro-batches", "est. seconds", "peak GiB/device")


def mesh_name(choice: CallChoice, cluster: Cluster) -> str:
    """ReaL-style mesh name: `hosts[00-15]` for whole hosts, `host03:0-3` inside one host."""
    devices = choice.devices
    hosts = cluster.hosts_of(devices)
    if devices.size % cluster.devices_per_host == 0 and len(hosts) * cluster.devices_per_host \
            == devices.size:
        first, last = hosts[0], hosts[-1]
        return f"host{first:02d}" if first == last else f"hosts[{first:02d}-{last:02d}]"
    local_first = devices.first % cluster.devices_per_host
    local = f"{local_first}-{local_first + devices.size - 1}" if devices.size > 1 \
        else f"{local_first}"
    return f"host{hosts[0]:02d}:{local}"


def _table(rows: list[tuple[str, ...]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def plan_table(result: PlanResult, cluster: Cluster, order: list[str]) -> str:
    """The per-MFC table of one plan, its movements and step time (or why it has none)."""
    title = f"== {result.name} =="
    if result.plan is None or result.evaluation is None:
        return f"{title}\nno plan: {result.reason}"
    ev = result.evaluation
    rows = [_HEADER]
    for name in order:
        if name not in result.plan:
            continue
        choice = result.plan[name]
        rows.append((name, mesh_name(choice, cluster), choice.spec(), str(choice.micro_batches),
                     f"{ev.mfc_seconds[name]:.3g}", f"{ev.memory.peak[name] / _GIB:.3g}"))
    lines = [title, _table(rows)]
    if ev.movement_seconds:
        moves = ", ".join(f"{k} {v:.2f}s" for k, v in ev.movement_seconds.items())
        lines.append(f"parameter movements: {moves}")
    if result.feasible:
        lines.append(f"step time: {ev.step_seconds:.2f} s")
    else:
        lines.append("does not fit: " + "; ".join(str(v) for v in ev.memory.violations))
    return "\n".join(lines)


def summary(report: SearchReport) -> str:
    """Step time of every plan and the searched plan's speedup over each baseline."""
    searched = report.searched.step_seconds
    rows = [("plan", "step seconds", "searched speedup")]
    for name, result in report.plans().items():
        seconds = result.step_seconds
        speedup = "-"
        if name != "searched" and math.isfinite(seconds) and math.isfinite(searched):
            speedup = f"{seconds / searched:.2f}x"
        rows.append((name, f"{seconds:.2f}" if math.isfinite(seconds) else "does not fit",
                     speedup))
    footer = (f"search: {report.search_seconds:.1f} s ({report.search_cpu_seconds:.1f} s CPU), "
              f"{report.evaluations} plans evaluated")
    return _table(rows) + "\n" + footer


def allocation(result: PlanResult) -> str:
    """The plan as the runtime's `placement.allocation` string (with placement.kind=manual),
    micro-batches included: it round-trips (`plan.allocation.parse_allocation`)."""
    if result.plan is None:
        return ""
    return format_allocation(result.plan)


def _plan_json(result: PlanResult, cluster: Cluster) -> dict:
    if not result.feasible:
        out = {"step_seconds": None, "reason": result.reason or "; ".join(
            str(v) for v in result.evaluation.memory.violations)}
        if result.evaluation is not None:  # priced, but the memory model rejects it
            out["mfc_seconds"] = dict(result.evaluation.mfc_seconds)
            out["allocation"] = allocation(result)
        return out
    ev = result.evaluation
    mfcs = {}
    for name, choice in result.plan.items():
        mfcs[name] = {
            "mesh": str(choice.devices), "hosts": mesh_name(choice, cluster),
            "strategy": choice.axes_str(), "micro_batches": choice.micro_batches,
            "seconds": ev.mfc_seconds[name], "peak_bytes_per_device": ev.memory.peak[name],
        }
    return {"step_seconds": ev.step_seconds, "mfcs": mfcs, "movements": ev.movement_seconds,
            "mfc_seconds": dict(ev.mfc_seconds), "allocation": allocation(result)}


def to_json(report: SearchReport, cluster: Cluster,
            decode: DecodeSchedule = DEFAULT_DECODE) -> dict:
    """{plans: {searched: {...}, colocate: {...}, ..., configured: {...} when given},
    search_seconds, evaluations, decode_schedule: how pipelined generation was priced}."""
    plans = {name: _plan_json(r, cluster) for name, r in report.plans().items()}
    return {"plans": plans, "search_seconds": report.search_seconds,
            "search_cpu_seconds": report.search_cpu_seconds,
            "evaluations": report.evaluations, "cluster": cluster.name,
            "decode_schedule": decode.value}
