"""Per-step metrics: `metrics.jsonl` (one object per step, with a `step` key) and TensorBoard.

metrics.jsonl is the record; the TensorBoard events mirror it. A resumed run repeats the steps
its killed predecessor logged after its last checkpoint: the run first trims those records from
metrics.jsonl (`run.loop.trim_metrics`), and opening a `MetricsWriter` then writes the event
files anew from what is left, so that TensorBoard shows every (tag, step) once, with the
resumed run's value.
"""

from __future__ import annotations

import json
import math
import pathlib
import re
import shutil
from collections.abc import Mapping

import jax
from tensorboardX import SummaryWriter

METRICS_FILE = "metrics.jsonl"
TENSORBOARD_DIR = "tensorboard"
# TensorBoard tags hold letters, digits and _ - / . only (TF's node-name rule, which
# tensorboardX applies with a log line per write): "eval/pass@3" is the tag "eval/pass_3".
_NOT_IN_TAGS = re.compile(r"[^-/\w.]")


def read_records(path: pathlib.Path) -> list[dict]:
    """The records of a metrics.jsonl; a line cut off mid-write (a killed run) is left out."""
    if not path.exists():
        return []
    records = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records


class MetricsWriter:
    """Appends one JSON object per step and mirrors scalars to TensorBoard event files.

    Opening it writes the TensorBoard events of the records already in metrics.jsonl again,
    in a new event file, and removes the old event files (see the module docstring).
    Multi-process: every process computes the same metrics, and only process 0 writes them.
    """

    def __init__(self, workdir: str | pathlib.Path):
        self.dir = pathlib.Path(workdir)
        self.enabled = jax.process_index() == 0
        if not self.enabled:
            return
        self.dir.mkdir(parents=True, exist_ok=True)
        path = self.dir / METRICS_FILE
        earlier = read_records(path)
        shutil.rmtree(self.dir / TENSORBOARD_DIR, ignore_errors=True)
        self._jsonl = path.open("a", encoding="utf-8")
        self._tb = SummaryWriter(str(self.dir / TENSORBOARD_DIR))
        for record in earlier:
            self._scalars(record)

    def _scalars(self, record: Mapping[str, float]) -> None:
        for key, value in record.items():
            if key != "step" and math.isfinite(value):
                self._tb.add_scalar(_NOT_IN_TAGS.sub("_", key), value, record["step"])

    def write(self, step: int, metrics: Mapping[str, float]) -> None:
        if not self.enabled:
            return
        record = {"step": step, **{k: float(v) for k, v in metrics.items()}}
        self._jsonl.write(json.dumps(record) + "\n")
        self._jsonl.flush()
        self._scalars(record)

    def close(self) -> None:
        if not self.enabled:
            return
        self._jsonl.close()
        self._tb.close()

    def __enter__(self) -> "MetricsWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
