"""Weights & Biases beside metrics.jsonl and TensorBoard (`logging.wandb`), tested offline.

The offline run directory (workdir/wandb/offline-run-*/run-*.wandb) is read back record by
record: W&B writes it as a LevelDB-style log of its protobuf `Record`s, the same file
`wandb sync` uploads. Every step's metrics must be there, equal to metrics.jsonl's.
"""

import json
import pathlib
import struct
import subprocess
import sys

import pytest

wandb = pytest.importorskip("wandb")
from wandb.proto import wandb_internal_pb2  # noqa: E402

from jaxrlhf.metrics import METRICS_FILE, MetricsWriter, WandbMode, WandbSpec, read_records  # noqa: E402
from jaxrlhf.schema import base_config  # noqa: E402
from jaxrlhf.spec import ConfigError, run_spec  # noqa: E402

_MAGIC = b":W&B"  # then 2 bytes of magic and a version byte
_BLOCK, _HEADER = 32768, 7  # log blocks; a record's header: crc32, length, type
_FULL, _LAST = 1, 4  # record types that end a record (_FIRST = 2, _MIDDLE = 3 continue one)


def _records(path: pathlib.Path):
    """The protobuf Records of a .wandb file, in order."""
    data = path.read_bytes()
    assert data[:4] == _MAGIC, data[:7]
    pos, chunks = 7, []
    while pos + _HEADER <= len(data):
        if _BLOCK - pos % _BLOCK < _HEADER:  # a block's tail too short for a header: padding
            pos += _BLOCK - pos % _BLOCK
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + _HEADER])
        if length == 0 and kind == 0:
            break
        chunks.append(data[pos + _HEADER:pos + _HEADER + length])
        pos += _HEADER + length
        if kind in (_FULL, _LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(b"".join(chunks))
            chunks = []
            yield record


def _offline_run(workdir: pathlib.Path) -> tuple[dict, list[dict]]:
    """(the newest run record's project, name and config; its history rows, W&B's own keys
    (`_step`, `_timestamp`, ...) left out)."""
    wandb.teardown()  # `finish` leaves the file's last writes to W&B's service; this waits
    runs = sorted((workdir / "wandb").glob("offline-run-*/run-*.wandb"),
                  key=lambda path: path.stat().st_mtime)
    run, history = {}, []
    for record in _records(runs[-1]):
        match record.WhichOneof("record_type"):
            case "run":
                config = {i.key: json.loads(i.value_json) for i in record.run.config.update}
                run = {"project": record.run.project, "name": record.run.display_name,
                       "config": config}
            case "history":
                items = {i.key or "/".join(i.nested_key): json.loads(i.value_json)
                         for i in record.history.item}
                history.append({k: v for k, v in items.items() if not k.startswith("_")})
    return run, history


def test_offline_run_holds_every_step_and_a_reopened_writer_replays(tmp_path):
    spec = WandbSpec(project="jaxrlhf-test", name="tiny", mode=WandbMode.OFFLINE)
    with MetricsWriter(tmp_path, spec, {"algorithm": "grpo"}) as writer:
        for step in range(3):
            writer.write(step, {"reward": 0.25 * step, "eval/pass@3": step / 3})
    run, history = _offline_run(tmp_path)
    assert run["project"] == "jaxrlhf-test" and run["name"] == "tiny"
    assert run["config"]["algorithm"] == "grpo"
    assert history == read_records(tmp_path / METRICS_FILE)
    assert history[2] == {"step": 2, "reward": 0.5, "eval/pass@3": 2 / 3}
    # Opened again (a resumed run): a new W&B run with the records so far, then its own steps.
    with MetricsWriter(tmp_path, spec) as writer:
        writer.write(3, {"reward": 1.0, "eval/pass@3": 1.0})
    _, resumed = _offline_run(tmp_path)
    assert resumed == read_records(tmp_path / METRICS_FILE) and len(resumed) == 4


@pytest.mark.parametrize("overrides,message", [
    ({"mode": "cloud"}, "logging.wandb.mode='cloud' is not one of: online, offline"),
    ({"name": "run1"}, "logging.wandb.name='run1': set logging.wandb.project too"),
])
def test_bad_wandb_keys_are_one_line(overrides, message):
    config = base_config()
    config.logging.wandb.update(overrides)
    with pytest.raises(ConfigError, match=message):
        run_spec(config)


def test_wandb_spec_of_the_config():
    config = base_config()
    assert run_spec(config).wandb is None
    config.logging.wandb.update({"project": "p", "mode": "offline"})
    assert run_spec(config).wandb == WandbSpec("p", "", WandbMode.OFFLINE)


@pytest.mark.slow
@pytest.mark.entry
def test_train_main_logs_to_an_offline_wandb_run(tmp_path):
    """`python -m jaxrlhf.train` with `logging.wandb` offline: the loop's step metrics reach W&B."""
    result = subprocess.run(
        [sys.executable, "-m", "jaxrlhf.train", "--config=configs/ppo_tiny.py",
         f"--workdir={tmp_path}", "--config.steps=2", "--config.logging.wandb.project=t",
         "--config.logging.wandb.mode=offline", "--config.logging.wandb.name=ppo"],
        capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    run, history = _offline_run(tmp_path)
    assert run["name"] == "ppo" and run["config"]["algorithm"] == "ppo"
    # the scalars: an update's `rows` (the data rows it trained on) are metrics.jsonl's alone
    assert history == [{k: v for k, v in r.items() if k != "rows"}
                       for r in read_records(tmp_path / METRICS_FILE)]
    assert {"reward", "actor/kl"} <= history[-1].keys()
