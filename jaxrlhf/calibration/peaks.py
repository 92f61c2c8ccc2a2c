"""What holds a compiled program's memory at its peak, in XLA's own words.

XLA's buffer assignment knows which values are live at the program's peak and where each came
from. Compiled with `xla_dump_to` (`compile_options`), the TPU and GPU compilers write it in
the module's `*after_optimizations-live-range.txt`: "Live ranges at N (peak)" and a "Stack
trace breakdown for peak usage" whose top-level entries name the JAX source of each live value
(`jit(_train_step)/jvp(Transformer)/while{2}`: the forward layer scan's saved activations;
`state.opt_state...`: an argument; `copy.561`: a copy XLA made, named by its instruction).
`read_peak` reads that breakdown: `plan --compile --explain` prints it per call, where the
memory model and XLA disagree it says why. XLA:CPU writes no such file.

The module's `*after_optimizations-buffer-assignment.txt` gives the heap XLA packs those values
into (its `preallocated-temp` allocation in the default memory space, `parse_heap`). On a TPU,
`memory_analysis()`'s temporaries can exceed it: an fsdp inference call's by about one
[tokens, hidden] array in the layers (Llama-3 7B's reward on f8 of a v5p-16: 9.89 GiB of
temporaries, 7.25 in the heap), by more at its head; no value in the dump accounts for the
rest, so `--explain` prints both figures.
"""

from __future__ import annotations

import dataclasses
import pathlib
import re

# "      ├── NAME (12.3%, total: 4 294 967 296 bytes, current: ..."  (a top-level entry)
_ENTRY = re.compile(r"^ {6}[├└]── (?P<name>.+?) \([\d.]+%, total: (?P<total>[\d ]+) bytes")
_PEAK = re.compile(r"Stack trace breakdown for peak usage: (?P<bytes>[\d ]+) bytes")
# "allocation 60: size 2893152352, preallocated-temp:" (another memory space adds ", color N")
_HEAP = re.compile(r"^allocation \d+: size (?P<size>\d+), preallocated-temp:")


@dataclasses.dataclass(frozen=True)
class Peak:
    """The live bytes at a program's peak (arguments XLA counts there included) and their
    sources, largest first: (source, bytes); `heap_bytes`: the heap XLA's buffer assignment
    packs the temporaries into (`parse_heap`; 0 where it wrote none)."""

    live_bytes: int
    sources: tuple[tuple[str, int], ...]
    heap_bytes: int = 0

    def describe(self, top: int = 6, width: int = 72) -> str:
        """One line: the live GiB, the heap's and the `top` largest sources."""
        parts = [f"{name[:width]} {nbytes / 2**30:.2f}" for name, nbytes in self.sources[:top]]
        return (f"{self.live_bytes / 2**30:.2f} GiB live at XLA's peak (temporaries' heap "
                f"{self.heap_bytes / 2**30:.2f}): " + ", ".join(parts))


def compile_options(dump_dir: str | pathlib.Path) -> dict[str, str]:
    """The `Lowered.compile(compiler_options=...)` that make XLA write its live ranges."""
    return {"xla_dump_to": str(dump_dir)}


def _number(text: str) -> int:
    return int(text.replace(" ", ""))


def parse_peak(text: str) -> Peak | None:
    """The peak breakdown of one live-range dump's text; None if it has none."""
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if _PEAK.search(line)), None)
    if start is None:
        return None
    sources = [(m.group("name"), _number(m.group("total")))
               for line in lines[start + 1:] if (m := _ENTRY.match(line))]
    merged: dict[str, int] = {}
    for name, nbytes in sources:
        merged[name] = merged.get(name, 0) + nbytes
    ranked = tuple(sorted(merged.items(), key=lambda item: -item[1]))
    return Peak(_number(_PEAK.search(lines[start]).group("bytes")), ranked)


def parse_heap(text: str) -> int:
    """The bytes of the temporaries' heap in one buffer-assignment dump's text: its
    `preallocated-temp` allocations of the default memory space."""
    return sum(int(m.group("size")) for line in text.splitlines() if (m := _HEAP.match(line)))


def read_peak(dump_dir: str | pathlib.Path) -> Peak | None:
    """The peak of the largest module XLA dumped into `dump_dir` (a program compiles one
    module; helpers it compiles beside it are smaller), with its heap; None where none was
    written."""
    files = sorted(pathlib.Path(dump_dir).glob("*after_optimizations-live-range.txt"),
                   key=lambda f: f.stat().st_size)
    if not files or (peak := parse_peak(files[-1].read_text())) is None:
        return None
    assignment = files[-1].with_name(files[-1].name.replace("-live-range", "-buffer-assignment"))
    if not assignment.exists():
        return peak
    return dataclasses.replace(peak, heap_bytes=parse_heap(assignment.read_text()))
