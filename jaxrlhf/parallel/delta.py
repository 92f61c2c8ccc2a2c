"""Delta weight sync: only the tensors that changed since the generator's version travel.

`async_rl.weight_sync=delta`: the trainer keeps the version it last sent (a copy on its own
layout, in its storage dtype) and, at each publish, compares every tensor with it exactly
(`changed`); only the tensors that differ in at least one bit are resharded onto the generator's
layout (through `reshard`, so shard to shard and checksummed across processes), and the
generator keeps its own copy of the others (`apply`). The generator's weights are therefore
bit for bit those of a full sync, whatever changed.

What it saves depends on what the update touches. With LoRA (`models.actor.lora.rank` > 0) the
base weights are frozen and only the adapters move. A full fine-tune with Adam changes every
tensor at every step (Adam's update is nonzero wherever a moment is, and weight decay moves
every weight), so it saves nothing but costs the comparison and the trainer's extra copy;
`full` (the default) keeps neither.

The granularity stays the tensor: blocks of one would not save more on real runs
(`benchmarks/delta_blocks.py`, grpo_tiny and ppo_tiny, fp32 and bf16). Adam moves every
element whose gradient was ever nonzero, by about the learning rate however small the gradient
(it divides by the gradient's own scale), so the only elements that stay are the embedding
rows of tokens the run never saw (about 259 of the byte vocabulary's 272 on the digit task)
and, in bf16, updates under half an ulp. 1 MiB blocks saved 0.0% (fp32) to 0.2% (bf16) of the
bytes, as tensors do; 4 KiB blocks 7-10%, nearly all of it those unseen embedding rows.
"""

from __future__ import annotations

import enum

import jax
import jax.numpy as jnp

from jaxrlhf.parallel.reshard import reshard


class WeightSync(enum.Enum):
    """What a publish sends (`async_rl.weight_sync`)."""

    FULL = "full"  # every tensor, every version
    DELTA = "delta"  # the tensors that changed since the generator's version


@jax.jit
def _differs(new: list[jax.Array], old: list[jax.Array]) -> jax.Array:
    """bool [n]: whether leaf i differs from its old value in any bit."""
    def one(a, b):
        bits = jax.lax.bitcast_convert_type
        if a.dtype != jnp.bool_ and a.dtype.itemsize > 1:
            a, b = bits(a, jnp.uint8), bits(b, jnp.uint8)
        return jnp.any(a != b)

    return jnp.stack([one(a, b) for a, b in zip(new, old)])


class Tracker:
    """The trainer's side: the version last sent and which tensors differ from it."""

    def __init__(self):
        self._sent: list[jax.Array] | None = None

    def changed(self, params) -> list[int]:
        """Indices (in `jax.tree.leaves` order) of the leaves of `params` that differ from the
        version last sent (all of them the first time); remembers `params` as sent, in copies
        of its own (the trainer's next update donates its buffers)."""
        leaves = jax.tree.leaves(params)
        if self._sent is None:
            indices = list(range(len(leaves)))
        else:
            differs = jax.device_get(_differs(leaves, self._sent))
            indices = [i for i, d in enumerate(differs) if d]
        self._sent = [jnp.copy(x) for x in leaves]
        return indices


def send(params, shardings, changed: list[int]):
    """The leaves `changed` of `params` resharded onto theirs in `shardings` (collective across
    processes: every process calls it with the same `changed`); (moved leaves, ReshardStats)."""
    leaves, treedef = jax.tree.flatten(params)
    targets = treedef.flatten_up_to(shardings)
    return reshard([leaves[i] for i in changed], [targets[i] for i in changed])


def apply(params, previous, shardings, changed: list[int]):
    """The generator's new weights: the leaves `changed` of `params` resharded onto
    `shardings`, the others `previous`'s (the generator's copy of the version before).

    Args:
      params: the trainer's new parameters (any layout).
      previous: the generator's weights of the version the changes are against; None: all of
        `changed` must cover every leaf (the first sync).
      shardings: the generator's parameter shardings (a tree like `params`).
      changed: indices of the leaves that travel (`Tracker.changed`; every process the same).

    Returns:
      (new generator weights, ReshardStats of what moved).
    """
    leaves, treedef = jax.tree.flatten(params)
    if previous is None and len(changed) != len(leaves):
        raise ValueError(f"a first sync needs every tensor, got {len(changed)} of {len(leaves)}")
    moved, stats = send(params, shardings, changed)
    out = list(jax.tree.leaves(previous)) if previous is not None else [None] * len(leaves)
    for i, x in zip(changed, moved):
        out[i] = x
    return jax.tree.unflatten(treedef, out), stats
