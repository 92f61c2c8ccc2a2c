"""The train_step call kind: one optimizer update of one model on one layout, as one jit.

Loss contract (every loss in `jaxrlhf.algorithms` is written this way):

    loss_fn(out, batch) -> (loss_sum, weight, stats)

`out` is the model's per-token readout of `batch`, an `InferenceOutput` of the train step's
`readout` config (log-probs at a temperature and optionally entropies for an LM head, values
for a scalar head), each [b, t] on the batch's padded rows: entry t belongs to token t, exactly
what the inference call kind returns. `batch` is a dict of arrays with a leading batch dim.
`loss_sum` and `weight` are f32 scalars and `stats` a dict of f32 scalar *sums*. The optimised
loss is Σloss_sum / Σweight over the whole batch and each reported stat is Σstat / Σweight, so
cutting the batch into micro-batches changes nothing. `weight` must not depend on the
parameters (it is a token or sequence count); it is not differentiated.

The batch carries the model inputs `tokens_bt`, `positions_bt`, `segment_ids_bt` (0 = padding,
one sequence per row) plus whatever the loss needs. The model does not compute on those rows:
each micro-batch's sequences are packed into rows of the batch's width (`engine.packing`), and
only the per-token readout comes back to the padded rows, so the transformer, the vocabulary
projection and the log-softmax pay for tokens, not padding, while every loss sees what an
unpacked forward gives. A PPO step's several mini-batch updates are several calls on slices of
one batch (`microbatch.minibatches`).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec

from jaxrlhf.engine import microbatch, packing, replay
from jaxrlhf.engine.call import BucketedCall, abstract
from jaxrlhf.engine.buckets import CompileCache, shape_key
from jaxrlhf.engine.inference import (
    InferenceBatch, InferenceConfig, InferenceKind, infer_packed,
)
from jaxrlhf.engine.optimizer import OptimizerConfig, make_optimizer, make_schedule
from jaxrlhf.models import lora
from jaxrlhf.models.config import HeadKind, ModelConfig
from jaxrlhf.models.moe import MoeConfig, RouterLosses
from jaxrlhf.models.sizes import abstract_params
from jaxrlhf.models.transformer import Transformer
from jaxrlhf.parallel.layout import Layout, init_params
from jaxrlhf.parallel.pipeline import Pipeline, layer_stack, remats_stages
from jaxrlhf.parallel.reshard import fetch, transfer
from jaxrlhf.parallel.zero import over_data

Batch = dict[str, jax.Array]
LossFn = Callable[[jax.Array, Batch], tuple[jax.Array, jax.Array, dict[str, jax.Array]]]

MODEL_INPUT_KEYS = ("tokens_bt", "positions_bt", "segment_ids_bt")
# A batch's recorded experts [b, t, L, k] (`engine.replay`), where the rollout's travel with it:
# replayed where the readout says (`InferenceConfig.replay_routing`), compared with the
# forward's own choice either way (stat routing_mismatch).
ROUTES_KEY = "routes_btlk"


@flax.struct.dataclass
class TrainState:
    """Everything a train_step updates.

    Attributes:
      params: unboxed parameter pytree (sharded jax.Arrays).
      opt_state: the optax state of `make_optimizer(opt_cfg)` over the trained parameters
        (with LoRA the adapters alone, `lora.partition`), sharded like them and, by default,
        also over the data-parallel ranks (ZeRO-1, `parallel.zero`).
      step: int32 scalar, the number of updates applied so far (drives the lr schedule).
    """

    params: Any
    opt_state: Any
    step: jax.Array


def _match_param_shardings(abstract_tree, params_shape, param_shardings,
                           default: NamedSharding):
    """Sharding per leaf of an optimizer-state-like tree, by matching parameter paths.

    A leaf whose key path ends with a parameter's key path and has that parameter's shape
    (Adam's mu/nu, a fp32 master copy) is sharded like that parameter; every other leaf (step
    counts, scalars) gets `default`. Path matching works for any optax state nesting, where
    `optax.tree_map_params` cannot see through wrappers with non-trivial `init`s.
    """
    flat_params = jax.tree_util.tree_flatten_with_path(params_shape)[0]
    flat_shardings = jax.tree_util.tree_leaves(param_shardings)
    by_path = {
        tuple(path): (leaf.shape, sharding)
        for (path, leaf), sharding in zip(flat_params, flat_shardings, strict=True)
    }
    max_depth = max(len(path) for path in by_path)

    def pick(path, leaf):
        for depth in range(min(len(path), max_depth), 0, -1):
            shape, sharding = by_path.get(tuple(path[-depth:]), (None, None))
            if shape == leaf.shape:
                return sharding
        return default

    return jax.tree_util.tree_map_with_path(pick, abstract_tree)


def optimizer_shardings(model_config: ModelConfig, layout: Layout, shard_optimizer: bool = True):
    """The sharding of the optimizer state's parameter-like leaves (Adam's moments, a fp32
    master): the parameters', plus "data" with `shard_optimizer` (ZeRO-1, `parallel.zero`)."""
    boxed = abstract_params(model_config)
    param_shardings = layout.param_shardings(boxed)
    return over_data(param_shardings, nn.unbox(boxed)) if shard_optimizer else param_shardings


def state_shardings(model_config: ModelConfig, layout: Layout, opt_cfg: OptimizerConfig,
                    shard_optimizer: bool = True) -> TrainState:
    """The NamedSharding of every TrainState leaf: params by the layout's rules, optimizer
    state by `optimizer_shardings`, the step replicated.

    `shard_optimizer=False` keeps a full optimizer state on every data-parallel rank (the
    layout before ZeRO-1; the tests compare the two)."""
    boxed = abstract_params(model_config)
    unboxed = nn.unbox(boxed)
    trained, _ = lora.partition(unboxed, model_config.lora)
    abstract_opt = jax.eval_shape(make_optimizer(opt_cfg).init, trained)
    opt_shardings = _match_param_shardings(
        abstract_opt, unboxed, optimizer_shardings(model_config, layout, shard_optimizer),
        layout.replicated()
    )
    return TrainState(params=layout.param_shardings(boxed), opt_state=opt_shardings,
                      step=layout.replicated())


def create_train_state(params, model_config: ModelConfig, layout: Layout,
                       opt_cfg: OptimizerConfig, shard_optimizer: bool = True) -> TrainState:
    """A TrainState at step 0 around existing parameters (e.g. loaded from HF), on `layout`.

    `params` may be host arrays or jax.Arrays on any layout; they are placed with `place`
    (arrays already on `layout` are used as they are and then donated by the first step).
    `shard_optimizer`: ZeRO-1 (`state_shardings`).
    """
    shardings = state_shardings(model_config, layout, opt_cfg, shard_optimizer)
    params = transfer(params, shardings.params)
    trained, _ = lora.partition(params, model_config.lora)
    opt_state = jax.jit(make_optimizer(opt_cfg).init, out_shardings=shardings.opt_state)(trained)
    step = jax.device_put(jnp.zeros((), jnp.int32), shardings.step)
    return TrainState(params=params, opt_state=opt_state, step=step)


def init_train_state(model_config: ModelConfig, layout: Layout, opt_cfg: OptimizerConfig,
                     rng: jax.Array, shard_optimizer: bool = True) -> TrainState:
    """A freshly initialised model and optimizer on `layout` (`shard_optimizer`: ZeRO-1)."""
    return create_train_state(init_params(model_config, layout, rng), model_config, layout,
                              opt_cfg, shard_optimizer)


@dataclasses.dataclass(frozen=True)
class _StepSpec:
    """Static pieces the pure step closes over (hashable, one per compiled executable)."""

    model_config: ModelConfig
    opt_cfg: OptimizerConfig
    readout: InferenceConfig  # what the loss reads of the model
    num_micro: int  # micro-batches accumulated one after another
    pipeline: Pipeline | None = None  # on a pipelined layout: streams its micro-batches
    spread: bool = False  # the plan balances the shards' tokens (`packing.plan`'s spread)


def _grad_fn(model: Transformer, loss_fn: LossFn, readout: InferenceConfig, shards: int,
             frozen):
    """(trained params, (micro_batch, its PackPlan)) -> (grads of loss_sum, {loss_sum, weight,
    num_tokens, stats}); the `frozen` parameters (LoRA's base model) enter as constants: no
    gradient. A model with experts adds its router's auxiliary losses (`_with_router`)."""
    moe_cfg = model.config.moe
    if moe_cfg is not None:
        readout = dataclasses.replace(readout, with_router=True)

    def loss_of(trained, micro: Batch, plan: packing.PackPlan):
        params = lora.combine(trained, frozen)
        inputs = InferenceBatch(*(micro[k] for k in MODEL_INPUT_KEYS))
        plan_1 = jax.tree.map(lambda x: x[None], plan)
        out = infer_packed(model, readout, shards, params, inputs, plan_1,
                           routes_btlk=micro.get(ROUTES_KEY))
        loss_sum, weight, stats = loss_fn(out, micro)
        if moe_cfg is not None:
            loss_sum, stats = _with_router(moe_cfg, out.router, loss_sum, weight, stats)
        if out.routes_changed is not None:  # the batch carries the rollout's experts
            stats = {**stats, "routing_mismatch": jax.lax.stop_gradient(
                weight * replay.mismatch(out.routes_changed))}
        num_tokens = jnp.sum(micro["segment_ids_bt"] != 0, dtype=jnp.float32)
        aux = dict(loss_sum=loss_sum, weight=jax.lax.stop_gradient(weight),
                   num_tokens=num_tokens, stats=stats)
        return loss_sum, aux

    def grad_fn(params, micro_and_plan):
        grads, aux = jax.grad(loss_of, has_aux=True)(params, *micro_and_plan)
        return grads, aux

    return grad_fn


def _with_router(moe_cfg: MoeConfig, router: RouterLosses, loss_sum, weight, stats):
    """The loss with the router's terms, each weighed by `weight` like the loss (so the step
    optimises loss + aux_loss_coef * balance + z_loss_coef * z per unit of weight), and its
    stats: moe_balance_loss, moe_z_loss and moe_min_load (the least-used expert's share in
    units of an even share, models/moe.py), averaged over the batch like the loss's."""
    weight = jax.lax.stop_gradient(weight)
    aux = moe_cfg.aux_loss_coef * router.balance_loss + moe_cfg.z_loss_coef * router.z_loss
    stats = {**stats, "moe_balance_loss": weight * router.balance_loss,
             "moe_z_loss": weight * router.z_loss,
             "moe_min_load": weight * jax.lax.stop_gradient(router.min_load)}
    return loss_sum + weight * aux, stats


def _train_step(state: TrainState, batch: Batch, plan: packing.PackPlan, *, spec: _StepSpec,
                loss_fn: LossFn, layout: Layout, param_shardings
                ) -> tuple[TrainState, dict[str, jax.Array]]:
    """The pure step: accumulate micro-batch gradients, normalise, one optimizer update.

    `plan` holds one PackPlan per micro-batch (leading dim k, the micro-batch count).

    The accumulator and the normalised gradients are kept on `param_shardings`. With ZeRO-1
    (the optimizer state on `optimizer_shardings`) each data-parallel rank then updates its
    slice of the state and of the parameters, and the step's out_shardings all-gather the new
    parameters (`parallel.zero` says why the gradients are summed whole, not scattered).
    """
    batch_kb = microbatch.split(batch, spec.num_micro)
    batch_kb = jax.tree.map(
        lambda x: jax.lax.with_sharding_constraint(x, _micro_sharding(layout, x.ndim)), batch_kb
    )
    # With LoRA only the adapters are differentiated, updated and given optimizer state.
    trained, frozen = lora.partition(state.params, spec.model_config.lora)
    trained_shardings, _ = lora.partition(param_shardings, spec.model_config.lora)
    keep_sharded = lambda g: jax.lax.with_sharding_constraint(g, trained_shardings)
    grads_sum, sums = microbatch.accumulate(
        _grad_fn(Transformer(spec.model_config, spec.pipeline), loss_fn, spec.readout,
                 1 if spec.spread else layout.dp_size, frozen),
        trained, (batch_kb, plan), keep_sharded,
    )
    weight = sums["weight"]
    # An all-masked batch has no loss; dividing by 1 makes its gradient 0 instead of NaN.
    safe_weight = jnp.where(weight > 0, weight, 1.0)
    # Kept whole over "data" through the norm: left free, XLA slices the division for the
    # ZeRO-1 update and sums the norm slice by slice, in another order than without ZeRO-1;
    # the clip takes this norm (`optimizer.clip_by_global_norm`).
    grads = keep_sharded(jax.tree.map(lambda g: g / safe_weight, grads_sum))
    grad_norm = optax.tree.norm(grads)
    if not spec.opt_cfg.fp32_master:
        # Without a master copy the optimizer state lives in the parameter dtype.
        grads = jax.tree.map(lambda g, p: g.astype(p.dtype), grads, trained)
    optimizer = make_optimizer(spec.opt_cfg)
    updates, opt_state = optimizer.update(grads, state.opt_state, trained,
                                          grad_norm=grad_norm)
    params = lora.combine(optax.apply_updates(trained, updates), frozen)
    metrics = {
        "loss": sums["loss_sum"] / safe_weight,
        "weight": weight,
        "num_tokens": sums["num_tokens"],
        "grad_norm": grad_norm,
        "lr": jnp.asarray(make_schedule(spec.opt_cfg)(state.step), jnp.float32),
        **{name: total / safe_weight for name, total in sums["stats"].items()},
    }
    return TrainState(params=params, opt_state=opt_state, step=state.step + 1), metrics


def _micro_sharding(layout: Layout, ndim: int) -> NamedSharding:
    """[k, b, ...] micro-batch stacks: dim 1 sharded like a batch's dim 0, k replicated."""
    spec = layout.batch_sharding(ndim - 1).spec
    return NamedSharding(layout.mesh, PartitionSpec(None, *spec))


class TrainStep(BucketedCall):
    """A compiled train_step on one layout: `(state, batch) -> (new state, metrics)`.

    The state is donated: the caller must use the returned state. Each call reads the batch's
    segment ids on the host (a sync point, `int32 [b, t]`) to pack its sequences; each distinct
    (batch shape, micro-batches, packed rows) key is compiled once, ahead of time, and counted
    in `self.compile_cache`.

    Metrics (f32 scalars, replicated): loss (Σloss_sum/Σweight), weight, num_tokens (non-padding
    tokens), grad_norm (before clipping), lr (the rate this update used), and every loss stat
    as Σstat/Σweight (with experts also moe_balance_loss, moe_z_loss, moe_min_load:
    `_with_router`).
    """

    def __init__(self, model_config: ModelConfig, layout: Layout, loss_fn: LossFn,
                 opt_cfg: OptimizerConfig, microbatch_cfg: microbatch.MicrobatchConfig,
                 readout: InferenceConfig, rows: packing.Rows = packing.Rows.PACKED,
                 shard_optimizer: bool = True):
        super().__init__("train_step", layout)
        if readout.head is not model_config.head or readout.kind is InferenceKind.SCORES:
            raise ValueError(f"a train step reads {readout.kind} of a {model_config.head} head")
        if model_config.moe is not None and layout.pipeline > 1:
            # A pipeline's stages apply each layer alone: its router statistics are not sown.
            raise ValueError("a model with experts trains without a pipeline (p1): its router's "
                             "auxiliary losses are not collected across pipeline stages")
        self.model_config = model_config
        self.loss_fn = loss_fn
        self.opt_cfg = opt_cfg
        self.microbatch_cfg = microbatch_cfg
        self.readout = readout
        # A pipeline streams the padded rows of its micro-batches through its stages.
        self.rows = rows if layout.pipeline == 1 else packing.Rows.PADDED
        self.shardings = state_shardings(model_config, layout, opt_cfg, shard_optimizer)

    @property
    def cache(self) -> CompileCache:
        """The compile cache (older name of `compile_cache`)."""
        return self.compile_cache

    def batch_shardings(self, batch: Batch):
        return jax.tree.map(lambda x: self.layout.batch_sharding(jnp.ndim(x)), batch)

    def plan(self, batch: Batch) -> tuple[int, packing.PackPlan]:
        """(k, plan): the micro-batch count of `batch` as `microbatch.plan_microbatches`
        chooses it for this step's config, and the packed rows of each micro-batch (host numpy;
        a sync on the batch's segment ids). On a pipeline the plan is one micro-batch of the
        rows as given: the pipeline cuts them into its k micro-batches itself."""
        return self._planned(batch)[:2]

    def _planned(self, batch: Batch) -> tuple[int, packing.PackPlan, bool]:
        """`plan`'s (k, plan) and whether the plan is spread: on a data-parallel layout, where
        each shard packing its own rows needs more packed rows than sequences dealt evenly
        over the shards (long-tailed lengths), the spread plan; its packing reads across
        devices, a gather of the batch's token arrays that costs far less than the rows."""
        segment_ids_bt = np.asarray(fetch(batch["segment_ids_bt"]))
        shards = self.layout.dp_size
        plan = microbatch.plan_microbatches(self.microbatch_cfg, segment_ids_bt, shards,
                                            self.rows)
        count = plan.gather_mrt.shape[0]
        if self.layout.pipeline > 1:
            return count, packing.plan(segment_ids_bt, 1, shards, packing.Rows.PADDED), False
        return count, *packing.fewest_rows(segment_ids_bt, plan, shards, self.rows)

    def num_microbatches(self, batch: Batch) -> int:
        return self.plan(batch)[0]

    def __call__(self, state: TrainState, batch: Batch) -> tuple[TrainState, dict[str, jax.Array]]:
        """One optimizer update on `batch` (host or device arrays; placed with `place`).

        The state is normally already on `self.shardings` (then placing it is a no-op); a state
        left on another layout, e.g. by a reshard, is moved back first.
        """
        count, plan, spread = self._planned(batch)
        state = transfer(state, self.shardings)
        batch = transfer(batch, self.batch_shardings(batch))
        plan = transfer(plan, self._plan_shardings(plan))
        executable = self.compile_cache.get(
            (shape_key((batch, plan)), count, spread),
            lambda: self._lower_planned(count, state, batch, plan, spread))
        return executable(state, batch, plan)

    def lower_for(self, state, batch: Batch) -> jax.stages.Lowered:
        """The step this call would compile for host `batch`, lowered with nothing placed:
        `state` abstract (`checkpoint.abstract_state`), the batch and its plan made abstract
        on their shardings (module `engine.call`)."""
        count, plan, spread = self._planned(batch)
        batch = abstract(batch, self.batch_shardings(batch))
        plan = abstract(plan, self._plan_shardings(plan))
        return self._lower_planned(count, state, batch, plan, spread)

    def _lower(self, state: TrainState, batch: Batch) -> jax.stages.Lowered:
        """The lowered step for `batch` (its plan included), e.g. to read its HLO."""
        count, plan, spread = self._planned(batch)
        return self._lower_planned(count, state, batch, plan, spread)

    def _lower_planned(self, count: int, state, batch, plan, spread: bool = False
                       ) -> jax.stages.Lowered:
        with self.layout.activation_context():
            return self._jit_for(count, batch, plan, spread).lower(state, batch, plan)

    def _plan_shardings(self, plan: packing.PackPlan) -> packing.PackPlan:
        return jax.tree.map(lambda x: _micro_sharding(self.layout, x.ndim), plan)

    def _jit_for(self, count: int, batch: Batch, plan: packing.PackPlan, spread: bool = False
                 ) -> jax.stages.Wrapped:
        # A pipeline streams the micro-batches through its stages in one pass instead.
        pipeline = layer_stack(self.layout, count,
                               remat_stages=remats_stages(self.model_config.remat))
        spec = _StepSpec(self.model_config, self.opt_cfg, self.readout,
                         1 if pipeline else count, pipeline, spread)
        step_fn = functools.partial(
            _train_step, spec=spec, loss_fn=self.loss_fn, layout=self.layout,
            param_shardings=self.shardings.params,
        )
        return jax.jit(
            step_fn,
            in_shardings=(self.shardings, self.batch_shardings(batch),
                          self._plan_shardings(plan)),
            out_shardings=(self.shardings, self.layout.replicated()),
            donate_argnums=0,
        )


def default_readout(model_config: ModelConfig) -> InferenceConfig:
    """What a loss reads when its algorithm says nothing: log-probs at temperature 1 of an LM
    head, values of a scalar head."""
    kind = InferenceKind.LOGPROBS if model_config.head is HeadKind.LM else InferenceKind.VALUES
    return InferenceConfig(kind)


def make_train_step(model_config: ModelConfig, layout: Layout, loss_fn: LossFn,
                    opt_cfg: OptimizerConfig,
                    microbatch_cfg: microbatch.MicrobatchConfig = microbatch.MicrobatchConfig(),
                    readout: InferenceConfig | None = None,
                    rows: packing.Rows = packing.Rows.PACKED,
                    shard_optimizer: bool = True) -> TrainStep:
    """The train_step call kind for one model on one layout (see `TrainStep`).

    Args:
      readout: what `loss_fn` reads (default: `default_readout`).
      rows: PACKED (several sequences per row) or PADDED (one per row, as given).
      shard_optimizer: ZeRO-1, the optimizer state sliced over the data axis
        (`parallel.zero`); False keeps a whole copy on every data-parallel rank.
    """
    return TrainStep(model_config, layout, loss_fn, opt_cfg, microbatch_cfg,
                     readout or default_readout(model_config), rows, shard_optimizer)
