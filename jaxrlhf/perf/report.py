"""Per-MFC figures of a benchmark run: fractions of the floor (`perf.rounds`), compiled peak
memory, host RSS."""

from __future__ import annotations

import resource
from collections.abc import Mapping, Sequence

import jax

from jaxrlhf.perf.rounds import Clock, Rounds


def compiled_peak_bytes(executables: Sequence[jax.stages.Compiled]) -> int:
    """Largest per-device footprint XLA reports over an MFC's executables (0 if unknown).

    arguments + outputs + temporaries - aliased (donated) bytes, as `memory_analysis()` says,
    or its `peak_memory_in_bytes` when larger (the CPU client fills that field with arguments +
    outputs only, leaving out the temporaries).
    """
    best = 0
    for compiled in executables:
        m = compiled.memory_analysis()
        if m is None:
            continue
        total = (m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes
                 - m.alias_size_in_bytes)
        best = max(best, int(total), int(getattr(m, "peak_memory_in_bytes", 0) or 0))
    return best


def host_rss_bytes() -> tuple[int, int]:
    """(current, peak) resident set size of this process in bytes."""
    with open("/proc/self/statm") as f:
        current = int(f.read().split()[1]) * resource.getpagesize()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB
    return current, peak


def mfu_scale(devices: int, machine_devices: int) -> float:
    """MFU over a fraction of the machine's floor: the machine's peak over the peak of the
    call's own devices. CPU virtual devices share the host's cores (any subset can reach the
    machine's peak): 1; accelerators add up: all devices over the call's."""
    return 1.0 if jax.devices()[0].platform == "cpu" else machine_devices / devices


def floor_figures(measured: Rounds, devices: Mapping[str, int], memory: Mapping[str, int]
                  ) -> dict:
    """Every figure of a benchmark's floor rounds (JSON-ready): the probe's rate, then per call
    its seconds, FLOPs, fraction of the floor (median, lowest, highest round; best call
    against best probe) on both clocks, MFU and peak memory per device."""
    machine = devices["step"]
    out = {"rounds": len(measured.probe_r),
           "peak_gflops_per_s": measured.peak(Clock.WALL).median / 1e9,
           "peak_gflops_per_cpu_s": measured.peak(Clock.CPU).median / 1e9, "calls": {}}
    for row in measured.rows:
        figures = {"gflops": row.flops / 1e9, "devices": devices[row.name]}
        for clock in Clock:
            fraction = measured.fraction(row, clock)
            figures[clock.value] = {"seconds": [s.on(clock) for s in row.seconds_r],
                                    "fraction_of_floor": fraction.as_dict(),
                                    "best_fraction_of_floor": measured.best_fraction(row, clock)}
        figures["mfu"] = (measured.fraction(row, Clock.WALL).median
                          * mfu_scale(devices[row.name], machine))
        if row.name in memory:
            figures["peak_bytes"] = memory[row.name]
        out["calls"][row.name] = figures
    return out


def floor_table(measured: Rounds, devices: Mapping[str, int], memory: Mapping[str, int]) -> str:
    """The floor rounds as a fixed-width table: per call its median seconds and fraction of the
    floor (median, lowest-highest round) on both clocks, MFU, compiled peak memory."""
    peak_wall, peak_cpu = measured.peak(Clock.WALL), measured.peak(Clock.CPU)
    head = (f"{'call':<13}{'dev':>4}{'GFLOP':>7}{'wall s':>8}  {'of floor (wall)':<20}"
            f"{'cpu s':>7}  {'of floor (cpu)':<20}{'MFU':>6}{'peak MiB':>10}")
    lines = [f"probe: {peak_wall.median / 1e9:.1f} GFLOP/s ({peak_wall.low / 1e9:.1f}-"
             f"{peak_wall.high / 1e9:.1f}), {peak_cpu.median / 1e9:.1f} GFLOP per CPU s "
             f"({peak_cpu.low / 1e9:.1f}-{peak_cpu.high / 1e9:.1f}); median (lowest-highest) "
             f"of {len(measured.probe_r)} rounds, each call's fraction against its round's "
             "probe", head, "-" * len(head)]
    for row in measured.rows[1:] + measured.rows[:1]:  # the step last
        mib = f"{memory[row.name] / 2**20:.1f}" if row.name in memory else "-"
        mfu = (measured.fraction(row, Clock.WALL).median
               * mfu_scale(devices[row.name], devices["step"]))
        lines.append(
            f"{row.name:<13}{devices[row.name]:>4}{row.flops / 1e9:>7.1f}"
            f"{row.seconds(Clock.WALL).median:>8.3f}  "
            f"{measured.fraction(row, Clock.WALL).percent():<20}"
            f"{row.seconds(Clock.CPU).median:>7.3f}  "
            f"{measured.fraction(row, Clock.CPU).percent():<20}{mfu:>6.1%}{mib:>10}")
    return "\n".join(lines)
