"""What a delta weight sync would save per version at the granularity of a tensor, of blocks, or
of single elements, measured on a real training run.

`python benchmarks/delta_blocks.py --config=configs/grpo_tiny.py --config.async_rl.max_staleness=1
[any other jaxrlhf.train flag]` (from the repository root; `async_rl.weight_sync=delta` is set
here). The run trains as usual; at every publish after the first, the parameters are compared
byte for byte with the version last sent (`parallel/delta.py`'s Tracker, which this wraps), and
the bytes a sync would send are counted per granularity: whole changed tensors (what
`weight_sync=delta` sends), changed blocks of 1 MiB, 64 KiB and 4 KiB of each tensor's bytes
(the last block of a tensor is its remainder), and changed elements alone (the floor of any
block scheme, ignoring the cost of naming them). One JSON line per version and a summary line,
in bytes and as the share of a full sync saved.
"""

from __future__ import annotations

import json
import sys

import jax
import numpy as np

from jaxrlhf.parallel import delta

_BLOCKS = {"block_1MiB": 1 << 20, "block_64KiB": 1 << 16, "block_4KiB": 1 << 12}


def sent_bytes(new: list[np.ndarray], old: list[np.ndarray]) -> dict[str, int]:
    """Bytes a sync of `new` against `old` sends at each granularity (and in full)."""
    out = dict.fromkeys(["full", "tensor", *_BLOCKS, "element"], 0)
    for a, b in zip(new, old):
        differs_n = a.reshape(-1).view(np.uint8) != b.reshape(-1).view(np.uint8)
        out["full"] += a.nbytes
        if not differs_n.any():
            continue
        out["tensor"] += a.nbytes
        for name, size in _BLOCKS.items():
            padded = np.zeros(-(-a.nbytes // size) * size, bool)
            padded[:a.nbytes] = differs_n
            blocks = padded.reshape(-1, size).any(axis=1)
            sizes = np.full(len(blocks), size)
            sizes[-1] = a.nbytes - size * (len(blocks) - 1)
            out[name] += int(sizes[blocks].sum())
        per_element = differs_n.reshape(-1, a.dtype.itemsize).any(axis=1)
        out["element"] += int(per_element.sum()) * a.dtype.itemsize
    return out


def main() -> None:
    rows = []
    changed = delta.Tracker.changed

    def measuring(self, params):
        if self._sent is not None:
            new = [np.asarray(x) for x in jax.tree.leaves(params)]
            old = [np.asarray(x) for x in self._sent]
            row = sent_bytes(new, old)
            row["version"] = len(rows) + 1
            rows.append(row)
            print(json.dumps(row), flush=True)
        return changed(self, params)

    delta.Tracker.changed = measuring
    sys.argv += ["--config.async_rl.weight_sync=delta"]
    from absl import app

    from jaxrlhf import train
    try:
        app.run(train.main)
    finally:
        if rows:
            total = {k: sum(r[k] for r in rows) for k in rows[0] if k != "version"}
            saved = {k: round(1 - v / total["full"], 4) for k, v in total.items()}
            print(json.dumps({"versions": len(rows), "bytes_per_version": {
                k: v // len(rows) for k, v in total.items()}, "saved_share": saved}),
                flush=True)


if __name__ == "__main__":
    main()
