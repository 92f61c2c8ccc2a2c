"""Micro-batching: split a batch along dim 0 and accumulate gradients with `lax.scan`.

A train batch that does not fit in memory in one forward/backward is cut into k equal
micro-batches; their gradients are summed in fp32 inside the same jitted step. Because losses
are sums (see train_step's loss contract), k micro-batches give exactly the gradient of one big
batch, up to fp32 summation order.

The split is *strided* (micro-batch j holds rows j, j+k, j+2k, ...), not contiguous: the batch
is sharded in contiguous blocks of rows over the data-parallel devices, and a strided split
keeps every micro-batch spread evenly over all of them with a local reshape, whereas contiguous
slices would each live on 1/k of the devices and force an all-to-all.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxrlhf.engine import packing

Batch = dict[str, jax.Array]


class MicrobatchMode(enum.Enum):
    """How the number of micro-batches is chosen."""

    COUNT = "count"  # `value` micro-batches
    TOKEN_BUDGET = "token_budget"  # fewest micro-batches with <= `value` tokens each (the
    # packed rows' slots; without the lengths, as by `num_microbatches`, the padded rows')


@dataclasses.dataclass(frozen=True)
class MicrobatchConfig:
    """Micro-batching of one train_step.

    Attributes:
      mode: COUNT or TOKEN_BUDGET.
      value: the number of micro-batches (COUNT) or the token budget per micro-batch
        (TOKEN_BUDGET): its packed rows × their width (`plan_microbatches`).
    """

    mode: MicrobatchMode = MicrobatchMode.COUNT
    value: int = 1

    def __post_init__(self):
        if self.value < 1:
            raise ValueError(f"micro-batch {self.mode.value} must be >= 1, got {self.value}")

    @classmethod
    def by_count(cls, k: int) -> "MicrobatchConfig":
        return cls(MicrobatchMode.COUNT, k)

    @classmethod
    def by_token_budget(cls, tokens: int) -> "MicrobatchConfig":
        return cls(MicrobatchMode.TOKEN_BUDGET, tokens)


def num_microbatches(cfg: MicrobatchConfig, batch_size: int, seq_len: int, shards: int = 1) -> int:
    """The number k of micro-batches for a [batch_size, seq_len] batch of padded rows (the
    most a token budget needs: `plan_microbatches` counts the batch's packed rows instead).

    Every micro-batch must have a whole number of rows per data-parallel shard, i.e.
    `batch_size / k` must be a multiple of `shards`; otherwise some devices would sit idle
    or the split would move data between devices.

    Args:
      cfg: the micro-batching rule.
      batch_size: rows in the batch.
      seq_len: padded length of every row.
      shards: number of devices dim 0 of the batch is split over (the layout's dp size).

    Raises:
      ValueError: if no valid k exists (or the COUNT one is invalid).
    """
    valid = _valid_counts(batch_size, shards)
    match cfg.mode:
        case MicrobatchMode.COUNT:
            if cfg.value not in valid:
                raise ValueError(
                    f"{cfg.value} micro-batches do not split {batch_size} rows into equal parts "
                    f"with a multiple of {shards} rows each; valid counts: {valid}"
                )
            return cfg.value
        case MicrobatchMode.TOKEN_BUDGET:
            for k in valid:
                if (batch_size // k) * seq_len <= cfg.value:
                    return k
            smallest = (batch_size // valid[-1]) * seq_len
            raise ValueError(
                f"token budget {cfg.value} is below the smallest micro-batch "
                f"({batch_size // valid[-1]} rows x {seq_len} tokens = {smallest})"
            )


def _valid_counts(batch_size: int, shards: int) -> list[int]:
    """Micro-batch counts that cut `batch_size` rows into equal parts of whole rows per
    data-parallel shard."""
    if batch_size % shards:
        raise ValueError(f"batch of {batch_size} rows does not split over {shards} shards")
    return [k for k in range(1, batch_size + 1)
            if batch_size % k == 0 and (batch_size // k) % shards == 0]


def plan_microbatches(cfg: MicrobatchConfig, segment_ids_bt: np.ndarray, shards: int,
                      rows: packing.Rows) -> packing.PackPlan:
    """The micro-batches of a batch and their packed rows, from its segment ids (host).

    COUNT: `cfg.value` micro-batches. TOKEN_BUDGET: the fewest micro-batches whose packed rows
    (R rows of the batch's width t, R/shards per data-parallel shard from
    `packing.row_buckets`) hold at most `cfg.value` slots each: with long-tailed lengths a
    budget fits many more short sequences than padded rows would. Micro-batch j is rows j::k
    (`split`); each shard packs its own part of it (`packing`).

    Args:
      cfg: the micro-batching rule.
      segment_ids_bt: int [b, t] the batch's segment ids.
      shards: the layout's data-parallel size.
      rows: PACKED, or PADDED (R = b/k rows as given).

    Returns:
      The PackPlan, one entry per micro-batch on its leading dim.

    Raises:
      ValueError: if no valid count exists (or the COUNT one is invalid).
    """
    batch_size, width = segment_ids_bt.shape
    match cfg.mode:
        case MicrobatchMode.COUNT:
            count = num_microbatches(cfg, batch_size, width, shards)
        case MicrobatchMode.TOKEN_BUDGET:
            count = _count_in_budget(cfg.value, segment_ids_bt, shards, rows)
    return packing.plan(segment_ids_bt, count, shards, rows)


def _count_in_budget(budget: int, segment_ids_bt: np.ndarray, shards: int,
                     rows: packing.Rows) -> int:
    """The fewest valid micro-batches whose packed rows hold at most `budget` slots each."""
    batch_size, width = segment_ids_bt.shape
    if rows is packing.Rows.PADDED:
        return num_microbatches(MicrobatchConfig.by_token_budget(budget), batch_size, width,
                                shards)
    for k in _valid_counts(batch_size, shards):
        if packing.packed_rows(segment_ids_bt, k, shards) * width <= budget:
            return k
    raise ValueError(f"token budget {budget} is below the smallest micro-batch "
                     f"({shards} rows x {width} tokens = {shards * width})")


def split(batch: Batch, k: int) -> Batch:
    """Strided split of every array [B, ...] into [k, B/k, ...]; micro-batch j = rows j::k."""

    def one(x):
        rows = x.shape[0]
        if rows % k:
            raise ValueError(f"{rows} rows do not split into {k} micro-batches")
        return jnp.swapaxes(x.reshape(rows // k, k, *x.shape[1:]), 0, 1)

    return jax.tree.map(one, batch)


def accumulate(
    grad_fn: Callable[[Any, Batch], tuple[Any, Any]],
    params: Any,
    batch_kb: Batch,
    constrain: Callable[[Any], Any] = lambda grads: grads,
) -> tuple[Any, Any]:
    """Sums `grad_fn` over the micro-batches of `batch_kb` with `lax.scan`, in fp32.

    Args:
      grad_fn: (params, micro_batch) -> (grads like params, aux pytree of scalars); both are
        summed over micro-batches, so they must be sums (not means) over rows.
      params: the parameters, closed over by every micro-batch.
      batch_kb: arrays [k, B/k, ...] from `split`.
      constrain: applied to the gradient accumulator at every step, e.g. a sharding constraint
        that keeps it sharded like the parameters instead of replicated.

    Returns:
      (Σ grads as fp32 pytree like params, Σ aux as fp32 pytree).
    """
    to_f32 = lambda tree: jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), tree)
    if jax.tree.leaves(batch_kb)[0].shape[0] == 1:
        # One micro-batch: no accumulator to zero, add into and carry through a loop.
        grads, aux = grad_fn(params, jax.tree.map(lambda x: x[0], batch_kb))
        return constrain(to_f32(grads)), to_f32(aux)
    micro_shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype), batch_kb)
    _, aux_shapes = jax.eval_shape(grad_fn, params, micro_shapes)
    zeros = lambda tree: jax.tree.map(lambda s: jnp.zeros(s.shape, jnp.float32), tree)
    init = (constrain(zeros(params)), zeros(aux_shapes))

    def body(carry, micro):
        grads_acc, aux_acc = carry
        grads, aux = grad_fn(params, micro)
        grads_acc = jax.tree.map(jnp.add, grads_acc, to_f32(grads))
        aux_acc = jax.tree.map(jnp.add, aux_acc, to_f32(aux))
        return (constrain(grads_acc), aux_acc), None

    (grads_sum, aux_sum), _ = jax.lax.scan(body, init, batch_kb)
    return grads_sum, aux_sum


def minibatches(batch: Batch, n: int) -> list[Batch]:
    """Cuts a batch into `n` equal-shaped strided slices (rows i::n), for a PPO step's several
    optimizer updates; equal shapes mean one compiled train_step serves them all.

    Works on host (numpy) and device arrays; the train_step places each slice itself.
    """
    sizes = {x.shape[0] for x in jax.tree.leaves(batch)}
    if len(sizes) != 1 or next(iter(sizes)) % n:
        raise ValueError(f"batch dim sizes {sorted(sizes)} do not split into {n} mini-batches")
    return [jax.tree.map(lambda x, i=i: x[i::n], batch) for i in range(n)]
