"""Export a trained model from a run's checkpoint as a Hugging Face model directory.

    python -m jaxrlhf.export --workdir=W --out=DIR [--role=actor] [--step=N]

Any run's checkpoint: RL (actor, critic, ...), SFT and DPO (`--role=actor`), reward modelling
(`--role=reward`: the trained reward model, which an RL run then scores with through
`--config.reward.kind=model --config.models.reward.path=DIR`).

Reads checkpoint N (default: the latest) of W/checkpoints, rebuilds the role's model config from
the experiment config stored in it, restores only that role's parameters (no optimizer state)
and writes them with `hf_io.save_hf` in the parameters' dtype:

- actor / ref: `LlamaForCausalLM` (or Qwen2 when the model has q/k/v biases);
- critic / cost_critic / reward / cost: `…ForSequenceClassification` with one label, the
  scalar head as `score.weight` [1, hidden] (hf_io's layout; HF's `forward` pools the score at
  each row's last non-pad token, which is a reward model's score as jaxrlhf computes it;
  `score(model(x).last_hidden_state)` gives our per-token values).

config.json carries the tokenizer's `bos_token_id`, `eos_token_id` and `pad_token_id`. When the
run's tokenizer is a Hugging Face directory its files are copied alongside. The built-in byte
tokenizer (`tokenizer="byte"`) has no Hugging Face counterpart, so none is written: token ids
0..255 are the UTF-8 bytes of the text, 256 is padding, 257 BOS and 258 EOS (ids up to 271 are
reserved), e.g. `list(text.encode("utf-8"))` encodes and `bytes(i for i in ids if i < 256)`
decodes.

The parameters are restored onto whatever devices this process has (one CPU device is
enough), whatever plan the run used.

A LoRA actor (`models.actor.lora.rank` > 0) is written twice over: at DIR its adapters merged
into the weights (W + alpha/r · A·B, a plain HF model), and in DIR/adapter the adapters alone in
PEFT's format (adapter_model.safetensors, adapter_config.json), whose base model is
`models.actor.path`, or DIR/base, written too, when the run's base model had no directory.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib

import numpy as np

from absl import flags, logging

from jaxrlhf import cli
from jaxrlhf.mfc import Role
from jaxrlhf.schema import ConfigError

_WORKDIR = flags.DEFINE_string("workdir", None, "the run's workdir (holds checkpoints/)",
                               required=True)
_OUT = flags.DEFINE_string("out", None, "output directory for the HF model", required=True)
_ROLE = flags.DEFINE_enum("role", Role.ACTOR.value, [r.value for r in Role],
                          "which model to export")
_STEP = flags.DEFINE_integer("step", None, "checkpoint step (default: the latest)")


@dataclasses.dataclass(frozen=True)
class Exported:
    """What `export` wrote: the directory, the checkpoint step, and the tokenizer files' source
    (None for the byte tokenizer, which has no HF form)."""

    out: pathlib.Path
    step: int
    tokenizer_dir: str | None


def export(workdir: str | pathlib.Path, out: str | pathlib.Path, role: Role = Role.ACTOR,
           step: int | None = None) -> Exported:
    """Writes `role` of checkpoint `step` (None: the latest) of `workdir` to `out` (see module).

    Raises:
      FileNotFoundError: the workdir has no checkpoint (or not `step`).
      ValueError: the checkpoint has no model of that role.
    """
    # Imported here so that `--help` answers without starting JAX.
    import jax

    from jaxrlhf import checkpoint
    from jaxrlhf.spec import model_config_of
    from jaxrlhf.data.tokenizer import load_tokenizer
    from jaxrlhf.models import hf_io, lora
    from jaxrlhf.parallel.layout import make_layout

    directory = pathlib.Path(workdir) / checkpoint.CHECKPOINT_DIR
    if not directory.is_dir():
        raise FileNotFoundError(f"no checkpoints in {directory}")
    checkpoints = checkpoint.Checkpointer(directory, None)
    if step is not None and step not in checkpoints.all_steps():
        raise FileNotFoundError(f"no checkpoint {step} in {directory} "
                                f"(there are {list(checkpoints.all_steps())})")
    host = checkpoints.restore_host(step)
    if host is None:
        raise FileNotFoundError(f"no complete checkpoint in {directory}")
    roles = host.trained + host.frozen
    if role.value not in roles:
        raise ValueError(f"checkpoint {host.step} has no {role.value} model; it has "
                         f"{', '.join(roles)}")
    config = host.experiment_config()
    model = model_config_of(config.models[role.value], role, f"models.{role.value}")
    # Sharded over every local device (one is enough); save_hf gathers one tensor at a time.
    layout = make_layout(f"f{jax.device_count()}", model=model)
    target = {role: checkpoint.abstract_state(model, layout)}
    params = checkpoints.restore_models(host.step, target)[role]
    checkpoints.close()

    tokenizer = load_tokenizer(config.tokenizer)
    tokenizer_dir = None if config.tokenizer == "byte" else config.tokenizer
    ids = {"bos_token_id": tokenizer.bos_id, "eos_token_id": tokenizer.eos_id,
           "pad_token_id": tokenizer.pad_id}
    if model.lora is None:
        hf_io.save_hf(out, model, params, tokenizer_dir=tokenizer_dir, extra_config=ids)
    else:
        save = lambda path, tree: hf_io.save_hf(path, model.replace(lora=None), tree,
                                                tokenizer_dir=tokenizer_dir, extra_config=ids)
        save(out, lora.merged(params, model.lora))
        base = config.models[role.value].path
        if not base:  # initialised by its config: the adapters' base model is written too
            base = str(pathlib.Path(out) / BASE_DIR)
            save(base, lora.partition(params, model.lora)[1])
        save_peft(pathlib.Path(out) / ADAPTER_DIR, model, params, base)
    return Exported(pathlib.Path(out), host.step, tokenizer_dir)


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
        result = export(_WORKDIR.value, _OUT.value, Role(_ROLE.value), _STEP.value)
    except (FileNotFoundError, ValueError) as e:  # what `export` raises for its input
        raise ConfigError(f"--workdir={_WORKDIR.value}: {e}") from None
    if result.tokenizer_dir is None:
        print("tokenizer: the byte tokenizer has no Hugging Face form; ids 0-255 are UTF-8 "
              "bytes, 256 pad, 257 BOS, 258 EOS (`python -m jaxrlhf.export --help`)")
    print(json.dumps({"out": str(result.out), "role": _ROLE.value, "step": result.step,
                      "tokenizer": result.tokenizer_dir}))


if __name__ == "__main__":
    cli.run(main)
