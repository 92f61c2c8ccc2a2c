"""Per-MFC figures of a benchmark run: time against the floor, compiled peak memory, host RSS."""

from __future__ import annotations

import resource
import statistics
from collections.abc import Mapping, Sequence

import jax

from jaxrlhf.perf.flops import Figures


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


def median_seconds(timings: Sequence, name: str | None = None) -> float:
    """Median over measured steps of the step's (or one MFC's) seconds."""
    if name is None:
        return statistics.median(t.seconds for t in timings)
    return statistics.median(t.mfcs[name].seconds for t in timings)


def table(rows: Sequence[Figures], memory: Mapping[str, int]) -> str:
    """A fixed-width table of the figures, one line per MFC and one for the step (rows on one
    peak, `flops.with_peak_no_call_beat`: a raised probe is the run's to report)."""
    head = (f"{'mfc':<14}{'dev':>4}{'seconds':>9}{'GFLOP':>8}{'floor s':>9}{'of floor':>9}"
            f"{'MFU':>7}{'peak MiB':>10}")
    lines = [head, "-" * len(head)]
    for f in rows:
        mib = f"{memory[f.name] / 2**20:.1f}" if f.name in memory else "-"
        lines.append(f"{f.name:<14}{f.devices:>4}{f.seconds:>9.3f}{f.flops / 1e9:>8.1f}"
                     f"{f.floor_seconds:>9.3f}{f.fraction_of_floor:>9.1%}{f.mfu:>7.1%}"
                     f"{mib:>10}")
    return "\n".join(lines)
