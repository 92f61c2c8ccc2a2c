"""Per-step metrics: `metrics.jsonl` (one object per step, with a `step` key), TensorBoard, and
Weights & Biases when `logging.wandb.project` is set.

metrics.jsonl is the record; the TensorBoard events and the W&B run mirror its scalars. An RL or
offline update's record also lists the training rows it trained on (`rows`: their indices in the
training data, as `EpochIterator.indices` gives them), in metrics.jsonl only. A resumed run
repeats the steps its killed predecessor logged after its last checkpoint: the run first trims
those records from metrics.jsonl (`run.loop.trim_metrics`), and opening a `MetricsWriter` then
writes the event files anew from what is left, so that TensorBoard shows every (tag, step) once,
with the resumed run's value. A W&B run cannot take values back, so the same holds there by
starting a new W&B run on every open, with the records so far replayed into it.

`wandb` is an optional dependency (`pip install 'jaxrlhf[wandb]'`), imported only when a run
logs to it; `wandb_available` lets the spec refuse `logging.wandb.project` before anything
compiles where it is missing.
"""

from __future__ import annotations

import dataclasses
import enum
import importlib.util
import json
import math
import pathlib
import re
import shutil
from collections.abc import Mapping

import jax

METRICS_FILE = "metrics.jsonl"
TENSORBOARD_DIR = "tensorboard"
# TensorBoard tags hold letters, digits and _ - / . only (TF's node-name rule, which
# tensorboardX applies with a log line per write): "eval/pass@3" is the tag "eval/pass_3".
_NOT_IN_TAGS = re.compile(r"[^-/\w.]")


class WandbMode(enum.Enum):
    """Where a W&B run goes (`logging.wandb.mode`)."""

    ONLINE = "online"  # streamed to the W&B server as the run goes
    OFFLINE = "offline"  # written under workdir/wandb only; `wandb sync` uploads it later


@dataclasses.dataclass(frozen=True)
class WandbSpec:
    """A W&B run: its project, its display name (empty: W&B picks one) and mode."""

    project: str
    name: str
    mode: WandbMode


def wandb_available() -> bool:
    """Whether the optional `wandb` package is installed."""
    return importlib.util.find_spec("wandb") is not None


class _WandbRun:
    """One W&B run under workdir/wandb, logging every record with its step as the x axis."""

    def __init__(self, spec: WandbSpec, workdir: pathlib.Path, config: Mapping | None):
        import wandb  # optional: only runs that log to W&B need it

        self._run = wandb.init(
            project=spec.project, name=spec.name or None, mode=spec.mode.value,
            dir=str(workdir), config=dict(config or {}), reinit="create_new",
            settings=wandb.Settings(console="off"))  # the terminal is the trainer's
        # Our step is a metric, every chart's x axis, and not W&B's own step: that one must
        # increase with every call, and a warm start's records (sft/*) restart at step 0.
        self._run.define_metric("step")
        self._run.define_metric("*", step_metric="step")

    def log(self, record: Mapping[str, float]) -> None:
        self._run.log(dict(record))

    def close(self) -> None:
        self._run.finish()


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
    """Appends one JSON object per step and mirrors scalars to TensorBoard event files (and to a
    W&B run, given `wandb`).

    Opening it writes the TensorBoard events of the records already in metrics.jsonl again,
    in a new event file, and removes the old event files (see the module docstring); a W&B run
    starts afresh with those records. `config`: the run's config, shown by W&B beside the run.
    Multi-process: every process computes the same metrics, and only process 0 writes them.
    """

    def __init__(self, workdir: str | pathlib.Path, wandb: WandbSpec | None = None,
                 config: Mapping | None = None):
        self.dir = pathlib.Path(workdir)
        self.enabled = jax.process_index() == 0
        if not self.enabled:
            return
        self.dir.mkdir(parents=True, exist_ok=True)
        path = self.dir / METRICS_FILE
        earlier = read_records(path)
        shutil.rmtree(self.dir / TENSORBOARD_DIR, ignore_errors=True)
        self._jsonl = path.open("a", encoding="utf-8")
        # Imported here: tensorboardX imports torch where it is installed (~2 s), which every
        # process that only reads a config (a bad flag, the planner) would pay.
        from tensorboardX import SummaryWriter
        self._tb = SummaryWriter(str(self.dir / TENSORBOARD_DIR))
        self._wandb = None if wandb is None else _WandbRun(wandb, self.dir, config)
        for record in earlier:
            self._scalars(record)

    def _scalars(self, record: Mapping[str, float | list]) -> None:
        scalars = {k: v for k, v in record.items() if not isinstance(v, list)}
        for key, value in scalars.items():
            if key != "step" and math.isfinite(value):
                self._tb.add_scalar(_NOT_IN_TAGS.sub("_", key), value, record["step"])
        if self._wandb is not None:
            self._wandb.log(scalars)

    def write(self, step: int, metrics: Mapping[str, float | list]) -> None:
        """One step's record: scalars, and lists (the rows an update trained on) that only
        metrics.jsonl keeps."""
        if not self.enabled:
            return
        record = {"step": step, **{k: v if isinstance(v, list) else float(v)
                                   for k, v in metrics.items()}}
        self._jsonl.write(json.dumps(record) + "\n")
        self._jsonl.flush()
        self._scalars(record)

    def close(self) -> None:
        if not self.enabled:
            return
        self._jsonl.close()
        self._tb.close()
        if self._wandb is not None:
            self._wandb.close()

    def __enter__(self) -> "MetricsWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
