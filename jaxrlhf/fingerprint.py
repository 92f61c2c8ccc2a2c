"""What defines a run, so that a checkpoint resumes only the run that wrote it.

A checkpoint stores the fingerprint of its run: every config key that changes what is being
trained (the algorithm, every model's architecture, size, dtype and weights, the tokenizer, the
data files and built-in task, rollout shapes, hyper-parameters, the seed), flattened to
`"section.key": value`. Files named by the config (data files, model and tokenizer
directories) enter by content digest, not only by path, so an edited data file counts as a
different run. A rerun compares its own fingerprint with the checkpoint's before anything
compiles (`checkpoint.check_resume`). A key the schema gained after a checkpoint was written
(a new algorithm's section, a new option) reads as its default there: the run is the same run
as long as the key keeps its default.

Keys that may legitimately change between a run and its resume do not count: how long it runs
(`steps`), where and on what it runs (`workdir`, `cpu_devices`, `placement.*`, micro-batching,
reward worker processes and timeouts, the compilation cache), how often it saves, logs and
evaluates, and implementation choices that leave the mathematics unchanged (layer scan,
rematerialisation, attention kernels).
"""

from __future__ import annotations

import hashlib
import json
import pathlib

from jaxrlhf.schema import RENAMED_KEYS, base_config

# Config key prefixes that may change on resume (see the module docstring).
RESUMABLE = (
    "steps", "workdir", "cpu_devices", "log_every", "checkpoint.", "placement.", "micro_batches",
    "micro_batch_tokens", "reward.workers", "reward.timeout", "cost.workers", "cost.timeout",
    "nan_policy", "eval.", "reward.max_error_rate", "cost.max_error_rate", "logging.",
    "compile.",
)
# Per-model implementation choices (models.<role>.<key>) that may change on resume.
_MODEL_RESUMABLE = ("scan_layers", "remat", "attention")
# Files read when a directory is named: enough to tell two models or tokenizers apart without
# hashing gigabytes of weights (their sizes and the weight index are included).
_DIRECTORY_FILES = ("config.json", "generation_config.json", "tokenizer.json",
                    "tokenizer_config.json", "chat_template.jinja", "model.safetensors.index.json")
_PATH_KEYS = ("path", "train_path", "eval_path", "sft_path", "preference_path",
              "preference_eval_path", "tokenizer")


def _flatten(node: dict, prefix: str = "") -> dict[str, object]:
    out = {}
    for key, value in node.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(_flatten(value, f"{name}."))
        else:
            out[name] = value
    return out


def _resumable(key: str) -> bool:
    if any(key == p or (p.endswith(".") and key.startswith(p)) for p in RESUMABLE):
        return True
    parts = key.split(".")
    return len(parts) == 3 and parts[0] == "models" and parts[2] in _MODEL_RESUMABLE


def _file_digest(path: pathlib.Path, digest) -> None:
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)


def content_digest(value: str) -> str:
    """A short digest of the file or directory `value` names (the value itself otherwise)."""
    path = pathlib.Path(value)
    if not value or not path.exists():
        return value
    digest = hashlib.sha256()
    if path.is_file():
        _file_digest(path, digest)
    else:
        for child in sorted(path.iterdir()):
            if child.name in _DIRECTORY_FILES:
                digest.update(child.name.encode())
                _file_digest(child, digest)
            elif child.is_file() and child.suffix == ".safetensors":
                digest.update(f"{child.name}:{child.stat().st_size}".encode())
    return f"{value} (sha256 {digest.hexdigest()[:12]})"


def run_fingerprint(config_json: str) -> dict[str, str]:
    """The fingerprint of the run a config describes: `"section.key"` -> value as text."""
    flat = _flatten(json.loads(config_json))
    out = {}
    for key, value in sorted(flat.items()):
        if _resumable(key):
            continue
        if key.rsplit(".", 1)[-1] in _PATH_KEYS and isinstance(value, str):
            value = content_digest(value)
        out[key] = json.dumps(value) if not isinstance(value, str) else value
    return out


def differences(saved: dict[str, str], current: dict[str, str]) -> list[str]:
    """`key: saved -> current` for every key whose value differs (or exists on one side)."""
    saved = {RENAMED_KEYS.get(k, k): v for k, v in saved.items()}  # a run before a rename
    defaults = run_fingerprint(base_config().to_json())
    saved |= {k: defaults[k] for k in current.keys() - saved.keys() if k in defaults}  # added since
    keys = sorted(set(saved) | set(current))
    missing = "(absent)"
    return [f"{k}: {saved.get(k, missing)} -> {current.get(k, missing)}" for k in keys
            if saved.get(k) != current.get(k)]
