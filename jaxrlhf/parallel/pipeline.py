"""Pipeline parallelism: the stacked decoder layers run as stages over the mesh's pipeline axis.

The model keeps one parameter tree whatever the layout: every layer's weights stacked on a
leading "layers" dim [L, ...]. A layout with p > 1 shards that dim over the "pipeline" mesh axis
(rule `layers -> pipeline`), so device slice s of the axis holds layers [s·L/p, (s+1)·L/p): stage
s. Moving parameters between pipelined and non-pipelined layouts is therefore an ordinary
reshard of the same tree (`parallel/reshard.py`), bit for bit.

`Pipeline` is the model's `LayerStack` on such a layout (`Transformer(cfg, layer_stack=...)`).
It runs a GPipe schedule written SPMD-style, without per-stage programs:

  * the batch is cut into M micro-batches (strided, rows m, m+M, ... as in
    `engine/microbatch.py`, so each stays spread over the data-parallel devices);
  * the stacked parameters are viewed as [S, L/S, ...] (a local reshape: dim 0 is already split
    over the pipeline axis);
  * a state buffer [S, b, t, d] holds the activation each stage works on. Each of the M + S - 1
    iterations runs every stage at once (`jax.vmap` over the stage dim, whose shards live on
    different pipeline devices, so each device computes only its own stage), then shifts the
    buffer one stage on (`jnp.roll` over a sharded dim: XLA's collective-permute) and feeds the
    next micro-batch into stage 0. Stage S-1's output at iteration i is micro-batch i-S+1.

Stage s works on micro-batch i - s at iteration i; outside [0, M) it computes on filler (the
bubble, (S-1)/(M+S-1) of the time) whose results are never used. Reverse-mode autodiff of the
same loop is the backward pipeline (activations of every iteration are kept, as GPipe does;
the model's remat policy applies per layer, and under full remat a train step checkpoints each
stage too, `remats_stages`), so train_step, inference and generation all run pipelined
through the one forward. The head runs after the pipeline, over its output one micro-batch's
rows at a time (`engine.inference.readout_in_chunks`).

KV cache (generation): the cache [L, b, S_len, k, d] is viewed as [S, L/S, b/M, M, S_len, k, d];
stage s reads micro-batch m's slice and writes back only the t slots it filled, and only when m
is real, so bubble iterations never touch the cache. Called once per decode token, this runs
one pipeline per token (`DecodeSchedule.PER_TOKEN`): each token keeps M/(M+S-1) of the stages
busy. Generation on a pipelined layout instead keeps the pipeline full across tokens as ReaL
does (`DecodeSchedule.ACROSS_TOKENS`, `engine/pipelined_decode.py`), built from the same
pieces: `stage_params`, `stage_cache` and one `iteration` per scheduling slot.
"""

from __future__ import annotations

import dataclasses
import enum
import math

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxrlhf.models import attention
from jaxrlhf.models.config import RematPolicy
from jaxrlhf.models.transformer import KVCache, LayerFn, LayerInputs
from jaxrlhf.parallel.layout import Layout
from jaxrlhf.parallel.strategy import Axis

_STATE_AXES = ("stages", "batch", "length", "act_embed")  # [S, b, t, d]
_MICRO_AXES = (None, "batch", "length", "act_embed")  # [M, b, t, d]
# [S, L/S, b, M, S_len, k, d]
_CACHE_AXES = ("stages", None, "batch", None, None, "act_kv_heads", "head_dim")


class DecodeSchedule(enum.Enum):
    """How pipelined generation schedules its decode steps.

    PER_TOKEN: every new token is one GPipe pass over the M micro-batches (M + S - 1
      iterations), so each token pays the bubble.
    ACROSS_TOKENS: ReaL's: a micro-batch's next token enters stage 0 as soon as its last token
      has left stage S-1, so the pipeline stays full from token to token: max(M, S) iterations
      per token (with M < S a token waits for its micro-batch to come round).
    """

    PER_TOKEN = "per_token"
    ACROSS_TOKENS = "across_tokens"


# What generation on a pipelined layout runs (and what the planner prices by default).
DEFAULT_DECODE = DecodeSchedule.ACROSS_TOKENS


def split_rows(x, num_micro: int):
    """[B, ...] -> [M, B/M, ...]; micro-batch m holds rows m, m+M, m+2M, ..."""
    rows = x.shape[0]
    return jnp.swapaxes(x.reshape(rows // num_micro, num_micro, *x.shape[1:]), 0, 1)


def merge_rows(x):
    """Inverse of `split_rows`: [M, B/M, ...] -> [B, ...]."""
    return jnp.swapaxes(x, 0, 1).reshape(x.shape[0] * x.shape[1], *x.shape[2:])


@dataclasses.dataclass(frozen=True)
class Pipeline:
    """A GPipe schedule of `stages` stages over `micro_batches` micro-batches (a LayerStack).

    Attributes:
      stages: S, the size of the pipeline mesh axis; must divide the number of layers.
      micro_batches: M; a call whose batch M does not divide streams gcd(M, batch).
      axis: the mesh axis the stage dim is sharded over (None: no sharding hints, for use
        outside a mesh).
      decode: how generation on this pipeline schedules its decode steps.
      remat_stages: checkpoint each stage's forward per iteration, so the backward pass keeps
        only every iteration's stage input [b, t, d] (what a 1F1B schedule saves over GPipe)
        and recomputes one stage's forward at a time from it; results equal GPipe's.
      shards: the data-parallel devices (data × fsdp × expert) a batch's rows are split over: a
        micro-batch holds at least one row on each (`num_micro`).
    """

    stages: int
    micro_batches: int
    axis: str | None = Axis.PIPELINE.value
    decode: DecodeSchedule = DEFAULT_DECODE
    remat_stages: bool = False
    shards: int = 1

    def __post_init__(self):
        if self.stages < 1 or self.micro_batches < 1:
            raise ValueError(f"pipeline needs stages and micro_batches >= 1, got {self}")

    def num_micro(self, batch: int) -> int:
        """Micro-batches a call of `batch` rows streams: a batch the planned count does not
        divide (e.g. a held-out evaluation's) streams fewer; the numbers do not change. Each
        holds a row on every data-parallel device at least: 8 rows over d8 stream as one
        micro-batch, not as 8 of one row that every data-parallel device would compute whole
        (XLA does: a 70B ref_inf on d8p8t2 computed 14 times its share)."""
        per_shard = batch // self.shards if batch % self.shards == 0 else batch
        return math.gcd(self.micro_batches, per_shard)

    def stage_params(self, params_l):
        """Every layer's params [L, ...] viewed as [S, L/S, ...] (a local reshape)."""
        num_layers = jax.tree.leaves(params_l)[0].shape[0]
        if num_layers % self.stages:
            raise ValueError(f"{self.stages} pipeline stages do not divide {num_layers} layers")
        return jax.tree.map(
            lambda p: p.reshape(self.stages, num_layers // self.stages, *p.shape[1:]), params_l)

    def stage_cache(self, cache: KVCache, num_micro: int) -> KVCache:
        """KVCache [L, B, S_len, k, d] viewed as [S, L/S, B/M, M, S_len, k, d] (micro-batch m
        holds rows m, m+M, ...)."""
        num_layers, batch = cache.k_lbskd.shape[:2]
        return KVCache(*(
            self._constrain(c.reshape(self.stages, num_layers // self.stages, batch // num_micro,
                                      num_micro, *c.shape[2:]), _CACHE_AXES) for c in cache))

    @staticmethod
    def unstage_cache(cache_s: KVCache) -> KVCache:
        """Inverse of `stage_cache`."""
        return KVCache(*(c.reshape(c.shape[0] * c.shape[1], c.shape[2] * c.shape[3], *c.shape[4:])
                         for c in cache_s))

    def iteration(self, layer_fn: LayerFn, params_s, fresh_btd: jax.Array,
                  state_sbtd: jax.Array, cache_s: KVCache | None, inputs_s: LayerInputs,
                  micro_s: jax.Array, real_s: jax.Array, cache_index, unroll: bool
                  ) -> tuple[jax.Array, KVCache | None]:
        """One scheduling slot: stage s takes what stage s-1 produced last slot (stage 0
        `fresh_btd`), then every stage runs its layers at once.

        Args:
          layer_fn: one layer (`transformer.apply_layer` with its config bound).
          params_s: `stage_params` of the layers.
          fresh_btd: [b, t, d] stage 0's new input.
          state_sbtd: [S, b, t, d] every stage's output of the last slot.
          cache_s: `stage_cache` view or None.
          inputs_s: each stage's micro-batch's LayerInputs, stacked on a leading S dim.
          micro_s: int [S] the micro-batch each stage works on (clipped into [0, M)).
          real_s: bool [S] whether that work is real (bubble work never touches the cache).
          cache_index: the cache slot of the first of the t tokens: a scalar shared by all
            stages, or int [S], one per stage.
          unroll: unroll each stage's loop over its layers.

        Returns:
          (out_sbtd [S, b, t, d] every stage's output, the updated cache view or None).
        """
        stage_ids = jnp.arange(self.stages, dtype=jnp.int32)
        shifted_sbtd = jnp.roll(state_sbtd, 1, axis=0)  # collective-permute between stages
        in_sbtd = jnp.where((stage_ids == 0)[:, None, None, None], fresh_btd[None], shifted_sbtd)
        in_sbtd = self._constrain(in_sbtd, _STATE_AXES)
        index_axis = 0 if jnp.ndim(cache_index) else None
        stage = _stage_fn(layer_fn, unroll)
        if self.remat_stages:  # the backward pass recomputes the stage from its input
            stage = jax.checkpoint(stage, policy=jax.checkpoint_policies.nothing_saveable,
                                   prevent_cse=False)
        run_stages = jax.vmap(stage, spmd_axis_name=self.axis,
                              in_axes=(0, 0, 0, 0, 0, 0, index_axis))
        with attention.traced_under_vmap():  # JAX cannot vmap cuDNN attention with our mask
            out_sbtd, cache_s = run_stages(params_s, in_sbtd, cache_s, inputs_s, micro_s,
                                           real_s, jnp.asarray(cache_index, jnp.int32))
        return self._constrain(out_sbtd, _STATE_AXES), cache_s

    def __call__(self, layer_fn: LayerFn, params_l, x_btd: jax.Array, cache: KVCache | None,
                 inputs: LayerInputs, cache_index, unroll: bool
                 ) -> tuple[jax.Array, KVCache | None]:
        """Runs all L layers as S stages (see the module docstring).

        Args:
          layer_fn: one layer, `transformer.apply_layer` with its config bound.
          params_l: every layer's params stacked on dim 0 [L, ...].
          x_btd: [B, t, d] input of the first layer.
          cache: KVCache [L, B, S_len, k, d] or None.
          inputs: per-row layer inputs (dim 0 = B).
          cache_index: scalar slot of the first of the t tokens in the cache.
          unroll: unroll each stage's loop over its layers.

        Returns:
          (x_btd [B, t, d] after the last layer, the updated cache or None).
        """
        num_stages, num_micro = self.stages, self.num_micro(x_btd.shape[0])
        params_s = self.stage_params(params_l)
        x_mbtd = self._constrain(split_rows(x_btd, num_micro), _MICRO_AXES)
        inputs_m = jax.tree.map(lambda a: split_rows(a, num_micro), inputs)
        cache_s = None if cache is None else self.stage_cache(cache, num_micro)
        stage_ids = jnp.arange(num_stages, dtype=jnp.int32)

        def iteration(carry, i):
            state_sbtd, cache_s, stream_mbtd = carry
            micro_s = i - stage_ids
            real_s = (micro_s >= 0) & (micro_s < num_micro)
            micro_s = jnp.clip(micro_s, 0, num_micro - 1)
            fresh_btd = jax.lax.dynamic_index_in_dim(
                stream_mbtd, jnp.minimum(i, num_micro - 1), 0, keepdims=False)
            inputs_s = jax.tree.map(lambda a: a[micro_s], inputs_m)
            out_sbtd, cache_s = self.iteration(layer_fn, params_s, fresh_btd, state_sbtd,
                                               cache_s, inputs_s, micro_s, real_s, cache_index,
                                               unroll)
            # Slot `done` was read (as stage 0's input) `num_stages - 1` iterations ago and
            # never is again: the output takes its place. Before stage S-1 has a real output
            # this writes filler into slot 0, read at iteration 0 only; micro-batch 0's real
            # output overwrites it at iteration S-1.
            done = jnp.clip(i - (num_stages - 1), 0, num_micro - 1)
            stream_mbtd = jax.lax.dynamic_update_index_in_dim(
                stream_mbtd, self.last_stage(out_sbtd), done, 0)
            return (out_sbtd, cache_s, stream_mbtd), None

        # One buffer streams the micro-batches in and the outputs out (`stream_mbtd`), so a
        # call holds one [M, b, t, d] copy of them, and its backward pass one of their
        # gradients, where separate input and output buffers (and the output's zero fill,
        # which XLA:GPU allocates at the program's start) held two or three.
        init = (self.empty_state(x_mbtd.shape[1:], x_btd.dtype), cache_s, x_mbtd)
        steps = jnp.arange(num_micro + num_stages - 1, dtype=jnp.int32)
        (_, cache_s, out_mbtd), _ = jax.lax.scan(iteration, init, steps)
        new_cache = None if cache is None else self.unstage_cache(cache_s)
        return merge_rows(out_mbtd), new_cache

    def last_stage(self, out_sbtd: jax.Array) -> jax.Array:
        """Stage S-1's output [b, t, d] of out_sbtd [S, b, t, d] (sharded over the stages).

        A masked sum over the stage dim, not `out_sbtd[-1]`: the same values (the other
        stages add exact zeros), but its transpose is a masked broadcast that every device
        forms locally, where the index's transpose pads over the sharded stage dim, which
        XLA's SPMD partitioner did by all-gathering the whole [M, b, t, d] gradient buffer
        over the data-parallel devices in every backward iteration (ReaL's 70B plans on
        H100s: 8 GiB live, and 6 GiB sent per iteration)."""
        last_s = jnp.arange(self.stages) == self.stages - 1
        return jnp.sum(jnp.where(last_s[:, None, None, None], out_sbtd, 0), axis=0,
                       dtype=out_sbtd.dtype)

    def empty_state(self, shape_btd: tuple[int, ...], dtype) -> jax.Array:
        """The [S, b, t, d] stage outputs before the first slot (filler)."""
        return self._constrain(jnp.zeros((self.stages, *shape_btd), dtype), _STATE_AXES)

    def _constrain(self, x, names):
        return x if self.axis is None else nn.with_logical_constraint(x, names)


def _stage_fn(layer_fn: LayerFn, unroll: bool):
    """One stage: its L/S layers on one micro-batch (vmapped over the stages by `Pipeline`).

    The returned function maps (params [L/S, ...], x_btd [b, t, d], cache KVCache
    [L/S, b, M, S_len, k, d] or None, LayerInputs of its micro-batch, micro index m, whether m
    is real, cache slot of the first of the t tokens) -> (x_btd after its layers, cache with
    micro-batch m's new slots written).
    """

    def stage(params, x_btd, cache, inputs, micro, real, cache_index):
        per_stage = jax.tree.leaves(params)[0].shape[0]
        cache_m = None if cache is None else KVCache(*(
            jax.lax.dynamic_index_in_dim(c, micro, 2, keepdims=False) for c in cache))

        def body(carry, layer_params_and_index):
            layer_params, layer = layer_params_and_index
            return layer_fn(layer_params, carry, layer, inputs, cache_index), None

        layers = jnp.arange(per_stage, dtype=jnp.int32)
        (x_btd, new_m), _ = jax.lax.scan(body, (x_btd, cache_m), (params, layers),
                                         unroll=per_stage if unroll else 1)
        if cache is None:
            return x_btd, None
        length = x_btd.shape[1]

        def write_back(c, new, old):
            # Only the `length` slots this call filled, and only for a real micro-batch.
            slot = lambda a: jax.lax.dynamic_slice_in_dim(a, cache_index, length, axis=2)
            slots = jnp.where(real, slot(new), slot(old))
            zero = jnp.zeros((), jnp.int32)
            start = (zero, zero, micro.astype(jnp.int32), cache_index, zero, zero)
            return jax.lax.dynamic_update_slice(c, slots[:, :, None], start)

        return x_btd, KVCache(*(write_back(c, n, o) for c, n, o in zip(cache, new_m, cache_m)))

    return stage


def remats_stages(remat: RematPolicy) -> bool:
    """Whether a pipelined train step checkpoints each stage (`Pipeline.remat_stages`): under
    the model's RematPolicy.FULL, the policy that keeps least. GPipe keeps what every layer
    saves for every iteration of the schedule, M + S - 1 times L/S layer inputs per stage
    under FULL; stage checkpoints keep M + S - 1 stage inputs and recompute one stage's layer
    inputs at a time, for one more forward pass of the stage (`plan.cost.train_cost`)."""
    return remat is RematPolicy.FULL


def layer_stack(layout: Layout, micro_batches: int | None = None, *,
                remat_stages: bool = False) -> Pipeline | None:
    """The LayerStack a call on `layout` uses: a Pipeline when the layout has p > 1 (with
    `micro_batches`, default the layout's own, and `remat_stages`), else None (the model's
    plain scan)."""
    if layout.pipeline == 1:
        return None
    return Pipeline(layout.pipeline, micro_batches or layout.micro_batches,
                    remat_stages=remat_stages, shards=layout.dp_size)
