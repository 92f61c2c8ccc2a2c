"""Export a trained model from a run's checkpoint as a Hugging Face model directory.

    python -m jaxrlhf.export --workdir=W --out=DIR [--role=actor] [--step=N] [--overwrite]

Any run's checkpoint: RL (actor, critic, ...), SFT and DPO (`--role=actor`), reward modelling
(`--role=reward`: the trained reward model, which an RL run then scores with through
`--config.reward.kind=model --config.models.reward.path=DIR`).

Reads checkpoint N (default: the newest that restores; a damaged newer one is named and
skipped) of W/checkpoints, rebuilds the role's model config from
the experiment config stored in it, restores only that role's parameters (no optimizer state)
and writes them with `hf_io.save_hf` in the parameters' dtype:

- actor / ref: `LlamaForCausalLM` (or Qwen2 when the model has q/k/v biases);
- critic / cost_critic / reward / cost: `…ForSequenceClassification` with one label, the
  scalar head as `score.weight` [1, hidden] (hf_io's layout; HF's `forward` pools the score at
  each row's last non-pad token, which is a reward model's score as jaxrlhf computes it;
  `score(model(x).last_hidden_state)` gives our per-token values).

config.json carries the tokenizer's `bos_token_id`, `eos_token_id` and `pad_token_id`, and
generation_config.json the ids generation stops on (the run's stop ids: every EOS of the
tokenizer and of its model's generation config) over the sampling defaults of the run's model
directory's generation_config.json, where it had one. When the run's tokenizer is a Hugging Face
directory its files are copied alongside, chat template included. The built-in byte tokenizer
(`tokenizer="byte"`: ids 0..255 the UTF-8 bytes of the text, 256 padding, 257 BOS, 258 EOS, up
to 271 reserved) is written as a `tokenizers` model that encodes exactly as it does
(`data/byte_hf.py`), so every export loads in `transformers` and serves in vLLM as it is.

The parameters are restored onto whatever devices this process has (one CPU device is
enough), whatever plan the run used.

A LoRA actor (`models.actor.lora.rank` > 0) is written twice over: at DIR its adapters merged
into the weights (W + alpha/r · A·B, a plain HF model), and in DIR/adapter the adapters alone in
PEFT's format (adapter_model.safetensors, adapter_config.json), whose base model is
`models.actor.path`, or DIR/base, written too, when the run's base model had no directory.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import fcntl
import json
import os
import pathlib
import shutil
import socket
import tempfile

import numpy as np
from absl import flags, logging

from jaxrlhf import cli
from jaxrlhf.mfc import Role
from jaxrlhf.restore import restore_role
from jaxrlhf.schema import ConfigError

_WORKDIR = flags.DEFINE_string("workdir", None, "the run's workdir (holds checkpoints/)",
                               required=True)
_OUT = flags.DEFINE_string("out", None, "output directory for the HF model", required=True)
_ROLE = flags.DEFINE_enum("role", Role.ACTOR.value, [r.value for r in Role],
                          "which model to export")
_STEP = flags.DEFINE_integer("step", None, "checkpoint step (default: the newest that "
                             "restores)")
_OVERWRITE = flags.DEFINE_bool("overwrite", False, "replace an existing --out (a file, or a "
                               "directory with files in it) instead of refusing it")


@dataclasses.dataclass(frozen=True)
class Exported:
    """What `export` wrote: the directory, the checkpoint step, and the tokenizer files' source
    (None for the byte tokenizer, whose files are written: data/byte_hf.py)."""

    out: pathlib.Path
    step: int
    tokenizer_dir: str | None


def check_out(out: pathlib.Path, overwrite: bool) -> None:
    """Refuses an `out` that holds something (a file, or a directory with entries) unless
    `overwrite`: an export into it would mix its files with the old ones.

    Raises:
      FileExistsError: naming it and `--overwrite`.
    """
    if overwrite or not (out.exists() or out.is_symlink()):
        return
    if not out.is_dir():
        raise FileExistsError(f"--out={out}: exists and is not a directory (pass --overwrite "
                              "to replace it)")
    if any(out.iterdir()):
        raise FileExistsError(f"--out={out}: a directory that is not empty (pass --overwrite "
                              "to replace it and everything in it)")


@contextlib.contextmanager
def out_lock(out: pathlib.Path):
    """Holds an exclusive lock on `out` (a `flock` on `.NAME.export-lock` beside it, since an
    export replaces `out` itself) while an export writes it: two exports to one `--out` at once
    would each pass `check_out` and the later would silently replace the other's.

    Raises:
      FileExistsError: another export holds it (naming its pid and host).
    """
    path = out.absolute().parent / f".{out.name}.export-lock"
    out.absolute().parent.mkdir(parents=True, exist_ok=True)
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            holder = (os.pread(fd, 256, 0).decode(errors="replace").split() + ["?", "?"])[:2]
            os.close(fd)
            if e.errno not in (errno.EWOULDBLOCK, errno.EACCES):
                raise
            raise FileExistsError(f"--out={out}: another export is writing it (pid {holder[0]} "
                                  f"on {holder[1]}); wait for it, or choose another --out") from None
        # the holder before us unlinks the file as it finishes: lock the one at `path` now
        try:
            if os.stat(path).st_ino == os.fstat(fd).st_ino:
                break
        except FileNotFoundError:
            pass
        os.close(fd)
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()} {socket.gethostname()}\n".encode(), 0)
    try:
        yield
    finally:
        path.unlink(missing_ok=True)
        os.close(fd)


def _replace(staged: pathlib.Path, out: pathlib.Path) -> None:
    """Moves the finished export `staged` to `out`, removing whatever was there."""
    if out.is_dir() and not out.is_symlink():
        shutil.rmtree(out)
    elif out.exists() or out.is_symlink():
        out.unlink()
    staged.rename(out)


def export(workdir: str | pathlib.Path, out: str | pathlib.Path, role: Role = Role.ACTOR,
           step: int | None = None, overwrite: bool = False) -> Exported:
    """Writes `role` of checkpoint `step` (None: the newest that restores) of `workdir` to
    `out` (see module): written beside it first, so that a failed export leaves `out` as it was.

    Raises:
      FileNotFoundError: the workdir has no checkpoint (or not `step`), or none that restores.
      FileExistsError: `out` holds something and not `overwrite` (`check_out`), or another
        export is writing it (`out_lock`).
      ValueError: the checkpoint has no model of that role.
    """
    out = pathlib.Path(out)
    with out_lock(out):
        check_out(out, overwrite)
        return _export(workdir, out, role, step)


def _export(workdir, out: pathlib.Path, role: Role, step: int | None) -> Exported:
    """`export` once `out` is locked and checked."""
    # Imported here so that `--help` answers without starting JAX.
    from jaxrlhf import checkpoint
    from jaxrlhf.data.tokenizer import load_tokenizer
    from jaxrlhf.models import hf_io

    directory = pathlib.Path(workdir) / checkpoint.CHECKPOINT_DIR
    if not directory.is_dir():
        raise FileNotFoundError(f"no checkpoints in {directory}")
    checkpoints = checkpoint.Checkpointer(directory, None)
    try:
        host, model, params = restore_role(checkpoints, role, step)
    finally:
        checkpoints.close()
    config = host.experiment_config()
    tokenizer = load_tokenizer(config.tokenizer)
    tokenizer_dir = None if config.tokenizer == "byte" else config.tokenizer
    ids = {"bos_token_id": tokenizer.bos_id, "eos_token_id": tokenizer.eos_id,
           "pad_token_id": tokenizer.pad_id}
    staged = pathlib.Path(tempfile.mkdtemp(prefix=f".{out.name}.export-",
                                           dir=out.absolute().parent))
    model_dir = config.models[role.value].path
    try:
        if model.lora is None:
            hf_io.save_hf(staged, model, params, tokenizer_dir=tokenizer_dir, extra_config=ids)
        else:
            _save_lora(staged, out, model, params, model_dir,
                       tokenizer_dir=tokenizer_dir, extra_config=ids)
        for directory in (staged, staged / BASE_DIR):
            if directory.is_dir():
                _write_serving_files(directory, tokenizer, tokenizer_dir, model_dir)
        _replace(staged, out)
    finally:
        shutil.rmtree(staged, ignore_errors=True)
    return Exported(out, host.step, tokenizer_dir)


GENERATION_CONFIG = "generation_config.json"


def generation_config(tokenizer, model_dir: str) -> dict:
    """generation_config.json of an export: `model_dir`'s (its sampling defaults), if it has
    one, with the run's special ids; `eos_token_id` lists every stop id when there are several
    (as chat models' files do)."""
    source = pathlib.Path(model_dir) / GENERATION_CONFIG if model_dir else None
    config = json.loads(source.read_text()) if source is not None and source.is_file() else {}
    stops = [int(i) for i in tokenizer.stop_ids]
    config.update(eos_token_id=stops if len(stops) > 1 else stops[0],
                  pad_token_id=tokenizer.pad_id)
    if tokenizer.bos_id is not None:
        config["bos_token_id"] = tokenizer.bos_id
    return config


def _write_serving_files(path: pathlib.Path, tokenizer, tokenizer_dir: str | None,
                         model_dir: str) -> None:
    """generation_config.json, and the byte tokenizer's files where the run had no HF one (an
    HF tokenizer's files are copied by save_hf)."""
    from jaxrlhf.data.byte_hf import write_byte_tokenizer

    if tokenizer_dir is None:
        write_byte_tokenizer(path)
    (path / GENERATION_CONFIG).write_text(
        json.dumps(generation_config(tokenizer, model_dir), indent=2) + "\n")


def _save_lora(staged: pathlib.Path, out: pathlib.Path, model, params, base: str,
               **hf_args) -> None:
    """A LoRA model into `staged` (moved to `out` afterwards): the merged weights, the adapters
    in PEFT's format in adapter/, and their base model in base/ when `base` (the run's
    models.actor.path) is empty."""
    from jaxrlhf.models import hf_io, lora

    save = lambda path, tree: hf_io.save_hf(path, model.replace(lora=None), tree, **hf_args)
    save(staged, lora.merged(params, model.lora))
    if not base:  # initialised by its config: the adapters' base model is written too
        save(staged / BASE_DIR, lora.partition(params, model.lora)[1])
        base = str(out.absolute() / BASE_DIR)
    save_peft(staged / ADAPTER_DIR, model, params, base)


ADAPTER_DIR = "adapter"  # a LoRA model's adapters, in PEFT's format
BASE_DIR = "base"  # their base model, when the run had none on disk
PEFT_WEIGHTS, PEFT_CONFIG = "adapter_model.safetensors", "adapter_config.json"


def save_peft(path: pathlib.Path, model, params, base_model: str) -> None:
    """The LoRA adapters of `params` as PEFT's adapter_model.safetensors and
    adapter_config.json in `path` (models/lora.py gives the layout)."""
    import jax
    from safetensors.numpy import save_file

    from jaxrlhf.models import hf_io, lora

    adapters, _ = lora.partition(params, model.lora)
    leaves = {tuple(str(k.key) for k in key_path): np.asarray(jax.device_get(x))
              for key_path, x in jax.tree_util.tree_flatten_with_path(adapters)[0]}
    hf_name = lambda kernel_path, layer: hf_io.tensor_map(kernel_path).name(layer)
    tensors = lora.peft_tensors(leaves, hf_name, model.num_layers)
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, path / PEFT_WEIGHTS, metadata={"format": "pt"})
    (path / PEFT_CONFIG).write_text(json.dumps(lora.peft_config(model.lora, base_model),
                                               indent=2))


def main() -> None:
    # orbax logs every file it opens (INFO) and that the checkpoints open read-only (WARNING)
    logging.set_verbosity(logging.ERROR)
    try:
        result = export(_WORKDIR.value, _OUT.value, Role(_ROLE.value), _STEP.value,
                        _OVERWRITE.value)
    except FileExistsError as e:  # `--out`'s, named in the message
        raise ConfigError(e) from None
    except (FileNotFoundError, ValueError) as e:  # what `export` raises for its input
        raise ConfigError(f"--workdir={_WORKDIR.value}: {e}") from None
    if result.tokenizer_dir is None:
        print("tokenizer: the byte tokenizer, written as tokenizer.json (ids 0-255 are UTF-8 "
              "bytes, 256 pad, 257 BOS, 258 EOS; `python -m jaxrlhf.export --help`)")
    print(json.dumps({"out": str(result.out), "role": _ROLE.value, "step": result.step,
                      "tokenizer": result.tokenizer_dir}))


if __name__ == "__main__":
    cli.run(main)
