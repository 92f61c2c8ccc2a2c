"""Load and save Hugging Face safetensors checkpoints directly into and out of sharded params.

Loading never materialises the model on one device or in one host buffer: every parameter is
built with `jax.make_array_from_callback`, whose callback reads only the requested shard from
the safetensors file (`safe_open(...).get_slice(name)[...]`, memory-mapped). Stacked layer
parameters [layers, ...] are assembled per layer from the per-layer HF tensors. In a
multi-process run each process reads only the shards its devices hold.

Saving gathers one HF tensor (one layer of one stacked parameter) at a time to host and writes
shards of at most `max_shard_bytes`, with `model.safetensors.index.json` when there are several
(HF's own naming: `model-00001-of-00003.safetensors`); process 0 writes.

Tensor correspondence (HF Linear weights are [out, in]; D = hidden, H = heads, K = kv heads,
Hd = head_dim, F = intermediate, V = vocab; per layer i):

  embed_tokens/embedding [V, D]          <- model.embed_tokens.weight [V, D]
  layers/*_layernorm/scale [L, D]        <- model.layers.i.*_layernorm.weight [D]
  layers/self_attn/q_proj/kernel [L,D,H,Hd] <- model.layers.i.self_attn.q_proj.weight [H*Hd, D]
  layers/self_attn/{k,v}_proj/kernel [L,D,K,Hd] <- ...{k,v}_proj.weight [K*Hd, D]
  layers/self_attn/{q,k,v}_proj/bias [L,H|K,Hd] <- ...{q,k,v}_proj.bias [H*Hd | K*Hd]   (Qwen2)
  layers/self_attn/{q,k}_norm/scale [L,Hd] <- ...self_attn.{q,k}_norm.weight [Hd]          (Qwen3)
  layers/self_attn/o_proj/kernel [L,H,Hd,D] <- ...o_proj.weight [D, H*Hd]
  layers/mlp/{gate,up}_proj/kernel [L,D,F] <- ...mlp.{gate,up}_proj.weight [F, D]
  layers/mlp/down_proj/kernel [L,F,D]    <- ...mlp.down_proj.weight [D, F]
  layers/moe/router [L, D, E]            <- ...mlp.gate.weight [E, D]  (Mixtral: block_sparse_moe.gate)
  layers/moe/{gate,up}_proj [L, E, D, F'] <- ...mlp.experts.n.{gate,up}_proj.weight [F', D]
                                            (Mixtral: block_sparse_moe.experts.n.{w1,w3})
  layers/moe/down_proj [L, E, F', D]     <- ...mlp.experts.n.down_proj.weight [D, F'] (Mixtral: w2)
  norm/scale [D]                         <- model.norm.weight [D]
  lm_head [D, V]                         <- lm_head.weight [V, D]  (absent when tied)
  score [D, 1]                           <- score.weight [1, D]    (HeadKind.SCALAR)

Experts are read and written in the Hub's per-expert layout (one tensor per expert, as vLLM
reads it; models/families.py names them per family) and stacked on load, whatever layout
`transformers` holds them in memory. A mixed dense/sparse model (Qwen3-MoE's `mlp_only_layers`)
holds both blocks in every layer; the slots a layer does not use have no HF tensor and load as
zeros.

Critic / reward / cost checkpoints (HeadKind.SCALAR) use HF's sequence-classification layout:
architecture `{Llama,Qwen2,Qwen3}ForSequenceClassification`, one label
(`id2label={"0": "LABEL_0"}`, i.e. num_labels=1), the decoder under `model.` and the value head
as `score.weight` [1, hidden] without bias. `score(last_hidden_state)` is our per-token value;
HF's own `forward` additionally pools it at each row's last non-pad token. A checkpoint that
stores the body without the `model.` prefix (a bare `LlamaModel`) loads too.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import pathlib
import shutil
from collections.abc import Callable, Mapping
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_dtypes  # noqa: F401  registers "bfloat16" with numpy, so safe_open(numpy) reads BF16
import numpy as np
from jax.experimental import multihost_utils
from safetensors import safe_open
from safetensors.numpy import save_file

from jaxrlhf.models import hf_config
from jaxrlhf.models.config import HeadKind, ModelConfig
from jaxrlhf.models.families import FAMILIES, ExpertNames
from jaxrlhf.models.sizes import abstract_params

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
CONFIG_FILE = "config.json"
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
    "tokenizer.model", "vocab.json", "merges.txt", "chat_template.jinja", "chat_template.json",
)
# Buffers HF keeps in some old checkpoints; derived from the config, so safe to skip.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)

ShardingsArg = Any | Callable[[ModelConfig], Any]  # pytree of Sharding, or config -> pytree


@dataclasses.dataclass(frozen=True)
class TensorMap:
    """How one (per-layer) parameter corresponds to one HF tensor.

    `hf_tensor = param.transpose(perm).reshape(hf_shape)`, where `groups[j]` consecutive axes
    of the permuted parameter merge into HF axis j.
    """

    hf_name: str  # "{i}" (layer index) iff stacked over layers; "{n}" (expert) over experts
    perm: tuple[int, ...]
    groups: tuple[int, ...]

    @property
    def stacked(self) -> bool:
        return "{i}" in self.hf_name

    @property
    def stack_dims(self) -> int:
        """Leading parameter dims that index HF tensors: layers, then experts (a sparse
        layer's stacked experts are one HF tensor each in the Hub's layout)."""
        return self.stacked + ("{n}" in self.hf_name)

    def name(self, layer: int | None = None, expert: int | None = None) -> str:
        return self.hf_name.format(i=layer, n=expert)

    def names(self, shape: tuple[int, ...]) -> list[tuple[tuple[int, ...], str]]:
        """(indices into the stacked dims, HF name) of every HF tensor of a parameter of
        `shape`, in file order."""
        if self.stack_dims == 0:
            return [((), self.hf_name)]
        if self.stack_dims == 1:
            return [((i,), self.name(i)) for i in range(shape[0])]
        return [((i, n), self.name(i, n)) for i in range(shape[0]) for n in range(shape[1])]

    def hf_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """HF tensor shape for a per-layer parameter shape."""
        permuted, out, axis = [shape[a] for a in self.perm], [], 0
        for n in self.groups:
            out.append(math.prod(permuted[axis:axis + n]))
            axis += n
        return tuple(out)

    def to_hf(self, x: np.ndarray) -> np.ndarray:
        return np.transpose(x, self.perm).reshape(self.hf_shape(x.shape))

    def read(self, hf_slice, shape: tuple[int, ...], bounds: tuple[tuple[int, int], ...]
             ) -> np.ndarray:
        """Reads param[bounds] (per-layer shape `shape`) from a safetensors slice object.

        A merged HF axis is read over the contiguous row range covering the outer axis's
        bounds; inner merged axes (e.g. head_dim) are then cut on host, which over-reads only
        when an inner axis is itself sharded.
        """
        permuted_shape = [shape[a] for a in self.perm]
        permuted_bounds = [bounds[a] for a in self.perm]
        hf_index, block_shape, inner_index, axis = [], [], [], 0
        for n in self.groups:
            rest_shape = permuted_shape[axis + 1:axis + n]
            start, stop = permuted_bounds[axis]
            hf_index.append(slice(start * math.prod(rest_shape), stop * math.prod(rest_shape)))
            block_shape += [stop - start, *rest_shape]
            inner_index += [slice(None)] + [slice(*b) for b in permuted_bounds[axis + 1:axis + n]]
            axis += n
        block = np.asarray(hf_slice[tuple(hf_index)]).reshape(block_shape)[tuple(inner_index)]
        return np.transpose(block, np.argsort(self.perm))


def tensor_map(path: tuple[str, ...], experts: ExpertNames | None = None) -> TensorMap:
    """The HF tensor of the parameter at `path` in our (unboxed) parameter tree; `experts`:
    where the family keeps a sparse layer's tensors (models/families.py), for a model with
    experts."""
    layer = "model.layers.{i}."
    match path:
        case ("layers", "moe", proj) if experts is not None:
            block = f"{layer}{experts.block}."
            if proj == "router":  # ours [D, E], HF's gate [E, D]
                return TensorMap(f"{block}{experts.router}.weight", (1, 0), (1, 1))
            # ours [E, in, out] per layer, HF's one [out, in] per expert
            return TensorMap(f"{block}experts.{{n}}.{experts.projection(proj)}.weight", (1, 0),
                             (1, 1))
        case ("embed_tokens", "embedding"):
            return TensorMap("model.embed_tokens.weight", (0, 1), (1, 1))
        case ("norm", "scale"):
            return TensorMap("model.norm.weight", (0,), (1,))
        case ("lm_head",) | ("score",):
            return TensorMap(f"{path[0]}.weight", (1, 0), (1, 1))
        case ("layers", norm, "scale"):
            return TensorMap(f"{layer}{norm}.weight", (0,), (1,))
        case ("layers", "self_attn", norm, "scale"):  # Qwen3 q_norm / k_norm
            return TensorMap(f"{layer}self_attn.{norm}.weight", (0,), (1,))
        case ("layers", "self_attn", "o_proj", "kernel"):
            return TensorMap(f"{layer}self_attn.o_proj.weight", (2, 0, 1), (1, 2))
        case ("layers", "self_attn", proj, "kernel"):
            return TensorMap(f"{layer}self_attn.{proj}.weight", (1, 2, 0), (2, 1))
        case ("layers", "self_attn", proj, "bias"):
            return TensorMap(f"{layer}self_attn.{proj}.bias", (0, 1), (2,))
        case ("layers", "mlp", proj, "kernel"):
            return TensorMap(f"{layer}mlp.{proj}.weight", (1, 0), (1, 1))
        case _:
            raise ValueError(f"no Hugging Face tensor for parameter {'/'.join(path)}")


def _key_path(path) -> tuple[str, ...]:
    return tuple(str(k.key) for k in path)


def _tensor_maps(abstract, experts: ExpertNames | None) -> dict[tuple[str, ...], TensorMap]:
    return {_key_path(p): tensor_map(_key_path(p), experts)
            for p, _ in jax.tree_util.tree_flatten_with_path(abstract)[0]}


def _unboxed_abstract(config: ModelConfig):
    return nn.meta.unbox(abstract_params(config))


def read_hf_config(path: str | os.PathLike) -> dict[str, Any]:
    """The `config.json` of directory `path`.

    Raises:
      ValueError: it is not a JSON object (naming the file, line and column).
    """
    file = pathlib.Path(path) / CONFIG_FILE
    try:
        config = json.loads(file.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"{file}: not valid JSON (line {e.lineno}, column {e.colno}: "
                         f"{e.msg})") from None
    except UnicodeDecodeError as e:
        raise ValueError(f"{file}: not UTF-8 text ({e.reason})") from None
    if not isinstance(config, dict):
        raise ValueError(f"{file}: holds a {type(config).__name__}, not a JSON object")
    return config


def _open_weights(file: pathlib.Path, stack: contextlib.ExitStack):
    """`safe_open` of one safetensors file; one that cannot be read (truncated, not a
    safetensors file) is a ValueError naming it."""
    try:
        return stack.enter_context(safe_open(file, framework="numpy"))
    except OSError:
        raise
    except Exception as e:  # noqa: BLE001 - SafetensorError derives from Exception only
        text = " ".join(str(e).split())
        raise ValueError(f"{file}: not a readable safetensors file ({text}; a download cut "
                         "short?)") from None


def check_weights(path: str | os.PathLike) -> None:
    """Reads the headers of the weights files of HF directory `path` (a truncated file's header
    no longer covers it), before anything loads or compiles.

    Raises:
      ValueError: naming the file that cannot be read (or an index that is not JSON).
    """
    path = pathlib.Path(path)
    with contextlib.ExitStack() as stack:
        for file in sorted(set(_weight_map(path).values())):
            _open_weights(path / file, stack)


def _weight_map(path: pathlib.Path) -> dict[str, str]:
    """Tensor name -> the file holding it, from the index or the single file's header."""
    if (path / INDEX_FILE).exists():
        try:
            return json.loads((path / INDEX_FILE).read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise ValueError(f"{path / INDEX_FILE}: not a safetensors index ({e})") from None
    if (path / SINGLE_FILE).exists():
        with contextlib.ExitStack() as stack:
            return {name: SINGLE_FILE for name in _open_weights(path / SINGLE_FILE, stack).keys()}
    raise FileNotFoundError(f"no {SINGLE_FILE} or {INDEX_FILE} in {path}")


def load_hf_config(path: str | os.PathLike, *, dtype=jnp.bfloat16, param_dtype=jnp.float32,
                   head: HeadKind | None = None) -> ModelConfig:
    """ModelConfig of the checkpoint in directory `path` (see hf_config_to_model_config)."""
    return hf_config.hf_config_to_model_config(
        read_hf_config(path), dtype=dtype, param_dtype=param_dtype, head=head
    )


class _Checkpoint:
    """Open safetensors files of one checkpoint directory, addressed by our HF tensor names."""

    def __init__(self, path: pathlib.Path, stack: contextlib.ExitStack):
        weight_map = _weight_map(path)
        files = {file: _open_weights(path / file, stack)
                 for file in sorted(set(weight_map.values()))}
        self._file_of = {name: files[file] for name, file in weight_map.items()}
        # A bare base model (LlamaModel) stores the body without the "model." prefix.
        bare = "model.embed_tokens.weight" not in weight_map and "embed_tokens.weight" in weight_map
        self._strip = "model." if bare else ""
        self.path = path

    def stored_name(self, name: str) -> str:
        return name.removeprefix(self._strip) if self._strip else name

    def names(self) -> set[str]:
        return set(self._file_of)

    def has(self, name: str) -> bool:
        return self.stored_name(name) in self._file_of

    def slice(self, name: str):
        stored = self.stored_name(name)
        if stored not in self._file_of:
            raise KeyError(f"tensor {stored!r} not found in checkpoint {self.path}")
        return self._file_of[stored].get_slice(stored)


def _check_tensors(ckpt: _Checkpoint, config: ModelConfig, maps: dict, abstract,
                   allow_missing: set[str]) -> None:
    """Raises on missing, mis-shaped or unexpected tensors before anything is read."""
    expected = set()
    for path, leaf in jax.tree_util.tree_flatten_with_path(abstract)[0]:
        tmap = maps[_key_path(path)]
        shape = leaf.shape[tmap.stack_dims:]
        for index, name in tmap.names(leaf.shape):
            if _unused_slot(config, path, index):
                continue
            expected.add(ckpt.stored_name(name))
            if name in allow_missing and not ckpt.has(name):
                continue
            got = tuple(ckpt.slice(name).get_shape())
            if got != tmap.hf_shape(shape):
                raise ValueError(
                    f"tensor {name!r} has shape {got}, expected {tmap.hf_shape(shape)} "
                    f"for {config}"
                )
    head_names = {"lm_head.weight", "score.weight"}  # unused head of the other kind
    unexpected = sorted(
        n for n in ckpt.names() - expected
        if n not in head_names and not n.endswith(_IGNORED_SUFFIXES)
    )
    if unexpected:
        raise ValueError(
            f"checkpoint {ckpt.path} has tensors the model would ignore: {unexpected[:8]}"
            f"{' ...' if len(unexpected) > 8 else ''}"
        )


def _unused_slot(config: ModelConfig, key_path, index: tuple[int, ...]) -> bool:
    """A mixed dense/sparse model holds both blocks in every layer (models/moe.py): the dense
    MLP's slot of a sparse layer and the experts' slot of a dense one are zeros, with no HF
    tensor."""
    moe = config.moe
    if moe is None or not moe.mixed or not index:
        return False
    path = key_path if isinstance(key_path[0], str) else _key_path(key_path)
    if path[:2] == ("layers", "mlp"):
        return index[0] not in moe.dense_layers
    if path[:2] == ("layers", "moe"):
        return index[0] in moe.dense_layers
    return False


def _param_callback(ckpt: _Checkpoint, config: ModelConfig, path: tuple[str, ...],
                    tmap: TensorMap, shape: tuple[int, ...], dtype,
                    zeros_if_missing: bool) -> Callable:
    """make_array_from_callback callback for one parameter; equal shards are read once."""
    blocks: dict[tuple, np.ndarray] = {}
    stack = tmap.stack_dims

    def read_stacked(bounds, index: tuple[int, ...]) -> np.ndarray:
        if len(index) == stack:
            inner = shape[stack:]
            if _unused_slot(config, path, index):
                return np.zeros([stop - start for start, stop in bounds], dtype)
            return tmap.read(ckpt.slice(tmap.name(*index)), inner, bounds)
        return np.stack([read_stacked(bounds[1:], (*index, i)) for i in range(*bounds[0])])

    def read(index) -> np.ndarray:
        bounds = tuple(s.indices(n)[:2] for s, n in zip(index, shape))
        if bounds in blocks:
            return blocks[bounds]
        if zeros_if_missing:
            block = np.zeros([stop - start for start, stop in bounds], dtype)
        else:
            block = read_stacked(bounds, ())
        blocks[bounds] = block.astype(dtype)
        return blocks[bounds]

    return read


def load_hf(
    path: str | os.PathLike,
    *,
    shardings: ShardingsArg = None,
    dtype=jnp.bfloat16,
    param_dtype=jnp.float32,
    head: HeadKind | None = None,
    init_missing_score: bool = False,
) -> tuple[ModelConfig, Any]:
    """Loads a HF Llama/Qwen2/Qwen3 checkpoint directory into (sharded) parameters.

    Args:
      path: directory with config.json and model.safetensors or a sharded index.
      shardings: pytree of `jax.sharding.Sharding` with the structure of the unboxed params
        (e.g. `layout.param_shardings(abstract_params(config))`), or a function from the
        loaded ModelConfig to such a pytree, or None for the default device.
      dtype: compute dtype recorded in the returned config.
      param_dtype: dtype the tensors are cast to (on host, shard by shard).
      head: force a head kind; None takes it from the checkpoint's architecture.
      init_missing_score: with a SCALAR head and no `score.weight` in the checkpoint (a critic
        started from a causal LM), start the score head at zero, like `Transformer.init`.

    Returns:
      (config, params): params is the unboxed parameter tree of `jax.Array`s.

    Raises:
      ValueError: unsupported config, or tensors missing, mis-shaped or unexpected.
    """
    path = pathlib.Path(path)
    config = load_hf_config(path, dtype=dtype, param_dtype=param_dtype, head=head)
    abstract = _unboxed_abstract(config)
    if callable(shardings):
        shardings = shardings(config)
    if shardings is None:
        default = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        shardings = jax.tree_util.tree_map(lambda _: default, abstract)
    maps = _tensor_maps(abstract, FAMILIES[hf_config.family_of(read_hf_config(path))].experts)
    allow_missing = {"score.weight"} if init_missing_score else set()
    with contextlib.ExitStack() as stack:
        ckpt = _Checkpoint(path, stack)
        _check_tensors(ckpt, config, maps, abstract, allow_missing)

        def build(key_path, leaf, sharding):
            tmap = maps[_key_path(key_path)]
            missing = tmap.hf_name in allow_missing and not ckpt.has(tmap.hf_name)
            read = _param_callback(ckpt, config, _key_path(key_path), tmap, leaf.shape,
                                   leaf.dtype, missing)
            return jax.make_array_from_callback(leaf.shape, sharding, read, dtype=leaf.dtype)

        params = jax.tree_util.tree_map_with_path(build, abstract, shardings)
    return config, params


@dataclasses.dataclass(frozen=True)
class _Entry:
    """One HF tensor to write: layer `layer` (or all) of the parameter at `path`."""

    name: str
    path: tuple[str, ...]
    index: tuple[int, ...]  # into the parameter's stacked dims (layer, expert); () for none
    tmap: TensorMap
    nbytes: int

    @property
    def layer(self) -> int | None:
        return self.index[0] if self.index else None


def _entries(config: ModelConfig, abstract, itemsize: int,
             experts: ExpertNames | None) -> list[_Entry]:
    """All HF tensors in file order: embedding, layer by layer, then final norm and head."""
    entries = []
    for key_path, leaf in jax.tree_util.tree_flatten_with_path(abstract)[0]:
        path = _key_path(key_path)
        tmap = tensor_map(path, experts)
        nbytes = math.prod(leaf.shape[tmap.stack_dims:]) * itemsize
        for index, name in tmap.names(leaf.shape):
            if not _unused_slot(config, path, index):
                entries.append(_Entry(name, path, index, tmap, nbytes))
    rank = lambda e: (-1 if e.path[0] == "embed_tokens" else
                      config.num_layers if e.layer is None else e.layer)
    return sorted(entries, key=lambda e: (rank(e), e.index[1:], e.name))


def _plan_shards(entries: list[_Entry], max_shard_bytes: int) -> list[list[_Entry]]:
    shards: list[list[_Entry]] = [[]]
    size = 0
    for entry in entries:
        if shards[-1] and size + entry.nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(entry)
        size += entry.nbytes
    return shards


@jax.jit
def _take_layer(x_l: jax.Array, layer: jax.Array) -> jax.Array:
    return jax.lax.dynamic_index_in_dim(x_l, layer, keepdims=False)


def _to_host(x: jax.Array, index: tuple[int, ...]) -> np.ndarray:
    """One layer (and expert), or all, of a possibly sharded array, gathered to a host numpy
    array."""
    for i in index:
        x = _take_layer(x, np.int32(i))
    if not x.is_fully_addressable:
        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(jax.device_get(x))


def _copy_tokenizer(tokenizer_dir: pathlib.Path, path: pathlib.Path) -> None:
    found = [name for name in TOKENIZER_FILES if (tokenizer_dir / name).exists()]
    if not found:
        raise FileNotFoundError(f"no tokenizer files ({', '.join(TOKENIZER_FILES)}) in "
                                f"{tokenizer_dir}")
    for name in found:
        shutil.copy2(tokenizer_dir / name, path / name)


def save_hf(
    path: str | os.PathLike,
    config: ModelConfig,
    params,
    *,
    tokenizer_dir: str | os.PathLike | None = None,
    family: hf_config.HfFamily | None = None,
    dtype=None,
    max_shard_bytes: int = 5 * 2**30,
    extra_config: Mapping[str, Any] | None = None,
) -> None:
    """Writes `params` as a HF checkpoint directory loadable by `from_pretrained`.

    Args:
      path: output directory (created).
      config: the model's config.
      params: parameter tree (boxed or unboxed) of possibly sharded arrays.
      tokenizer_dir: directory whose tokenizer files are copied alongside.
      family: HF family to write as; None picks Qwen2 for q/k/v bias, Qwen3 for q/k norms,
        else Llama.
      dtype: dtype of the saved tensors (cast on host); None means `config.param_dtype`.
      max_shard_bytes: upper bound per safetensors file (a larger single tensor gets its own).
      extra_config: keys merged into config.json, e.g. bos/eos/pad token ids.
    """
    path = pathlib.Path(path)
    params = nn.meta.unbox(params)
    abstract = _unboxed_abstract(config)
    if jax.tree_util.tree_structure(params) != jax.tree_util.tree_structure(abstract):
        raise ValueError("params do not match the parameter tree of config")
    leaves = {_key_path(p): x for p, x in jax.tree_util.tree_flatten_with_path(params)[0]}
    save_dtype = np.dtype(dtype if dtype is not None else config.param_dtype)
    family = hf_config.default_family(config) if family is None else family
    experts = FAMILIES[family].experts
    shards = _plan_shards(_entries(config, abstract, save_dtype.itemsize, experts),
                          max_shard_bytes)
    writer = jax.process_index() == 0
    if writer:
        path.mkdir(parents=True, exist_ok=True)
        hf = hf_config.model_config_to_hf_config(config, family=family, dtype=save_dtype)
        (path / CONFIG_FILE).write_text(json.dumps({**hf, **(extra_config or {})}, indent=2))
    weight_map = {}
    for k, shard in enumerate(shards):
        file = SINGLE_FILE if len(shards) == 1 else (
            f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors")
        tensors = {}
        for entry in shard:
            host = _to_host(leaves[entry.path], entry.index)
            tensors[entry.name] = np.ascontiguousarray(entry.tmap.to_hf(host).astype(save_dtype))
            weight_map[entry.name] = file
        if writer:
            save_file(tensors, path / file, metadata={"format": "pt"})
        del tensors
    if writer and len(shards) > 1:
        total = sum(e.nbytes for shard in shards for e in shard)
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (path / INDEX_FILE).write_text(json.dumps(index, indent=2))
    if writer and tokenizer_dir is not None:
        _copy_tokenizer(pathlib.Path(tokenizer_dir), path)
