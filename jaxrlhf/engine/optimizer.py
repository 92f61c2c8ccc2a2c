"""The optimizer of every train_step: global-norm clipping, then AdamW on a warmup-cosine schedule.

Everything is optax; this module only fixes the composition and adds one wrapper,
`with_fp32_master`, for bf16 parameters.

Why a fp32 master copy rather than `adamw(mu_dtype=f32)` plus casts: bf16 has an 8-bit
significand, so an update smaller than ~0.2% of a weight rounds away when it is added to the
bf16 weight. With RLHF learning rates (1e-6 .. 1e-5) almost every Adam step is below that, and a
model whose optimizer state alone is fp32 silently stops learning. Keeping the fp32 weights in
the optimizer state (as Megatron and DeepSpeed do) accumulates those small steps exactly; the
bf16 parameters are just the rounded view of the master that the forward pass reads. The cost is
4 extra bytes per parameter, which the memory model must count.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

# Parameter leaves that AdamW does not decay: norm scales and biases (the usual HF convention).
_NO_DECAY_LEAF_NAMES = frozenset({"scale", "bias"})


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
    """AdamW + warmup-cosine schedule + global-norm clipping.

    Attributes:
      lr: peak learning rate, reached after `warmup_steps` linear steps from 0.
      warmup_steps: linear warmup length (0 = start at the peak).
      total_steps: length of the whole schedule, warmup included; the lr then stays at
        `lr * min_lr_ratio`.
      min_lr_ratio: final lr as a fraction of `lr`.
      b1, b2, eps: Adam moments' decay rates and denominator epsilon.
      weight_decay: decoupled (AdamW) decay, applied to matrices only (not norms or biases).
      max_grad_norm: global gradient norm clipping threshold.
      fp32_master: keep a fp32 copy of the parameters in the optimizer state (for bf16
        parameters; see the module docstring).
    """

    lr: float = 1e-5
    warmup_steps: int = 0
    total_steps: int = 1000
    min_lr_ratio: float = 0.0
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    fp32_master: bool = False

    def __post_init__(self):
        if not 0 <= self.warmup_steps < self.total_steps:
            raise ValueError(
                f"need 0 <= warmup_steps ({self.warmup_steps}) < total_steps ({self.total_steps})"
            )
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ValueError(f"min_lr_ratio={self.min_lr_ratio} must lie in [0, 1]")
        if self.max_grad_norm <= 0:
            raise ValueError(f"max_grad_norm={self.max_grad_norm} must be positive")


def make_schedule(cfg: OptimizerConfig) -> optax.Schedule:
    """Step -> learning rate: linear warmup from 0, then cosine decay to lr * min_lr_ratio."""
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0,
        peak_value=cfg.lr,
        warmup_steps=cfg.warmup_steps,
        decay_steps=cfg.total_steps,
        end_value=cfg.lr * cfg.min_lr_ratio,
    )


def decay_mask(params) -> dict:
    """Pytree of bools like `params`: True where AdamW applies weight decay."""

    def is_decayed(path, _):
        last = path[-1]
        name = getattr(last, "key", getattr(last, "name", None))
        return name not in _NO_DECAY_LEAF_NAMES

    return jax.tree_util.tree_map_with_path(is_decayed, params)


def clip_by_global_norm(max_norm: float) -> optax.GradientTransformationExtraArgs:
    """optax's `clip_by_global_norm`, which can be given the norm, scaling by one factor.

    `update(..., grad_norm=norm)` clips by `norm` instead of the norm of the updates it sees.
    The train step passes the norm of the whole, data-replicated gradients: under ZeRO-1 the
    updates reaching the optimizer are each data-parallel rank's slice, and a norm summed
    slice by slice adds in another order than the replicated step's (not bitwise equal).
    The factor min(1, max_norm / norm) is one scalar multiplied into every element (optax
    divides each element by the norm, then multiplies: XLA rewrites that per program, and the
    sliced and the whole step then round differently).
    """

    def update(updates, state, params=None, *, grad_norm=None, **extra_args):
        del params, extra_args
        g_norm = optax.tree.norm(updates) if grad_norm is None else grad_norm
        scale = jnp.where(g_norm < max_norm, 1.0, max_norm / g_norm)
        return jax.tree.map(lambda t: t * scale.astype(t.dtype), updates), state

    return optax.GradientTransformationExtraArgs(optax.init_empty_state, update)


class MasterState(NamedTuple):
    """State of `with_fp32_master`: fp32 parameters and the wrapped optimizer's state."""

    master: optax.Params
    inner: optax.OptState


def with_fp32_master(inner: optax.GradientTransformation) -> optax.GradientTransformation:
    """Runs `inner` on a fp32 master copy of the parameters.

    `inner` sees fp32 gradients and fp32 parameters, so all its state is fp32. The returned
    updates are fp32 `new_master - params`; `optax.apply_updates` adds them in fp32 and rounds
    once to the parameter dtype, so the new parameters are the master rounded to bf16 (the
    subtraction and addition are exact whenever old and new weights are within a factor 2,
    Sterbenz's lemma, i.e. for every realistic step).
    """

    def to_f32(tree):
        return jax.tree.map(lambda x: x.astype(jnp.float32), tree)

    def init(params):
        master = to_f32(params)
        return MasterState(master=master, inner=inner.init(master))

    def update(updates, state, params=None, **extra_args):
        if params is None:
            raise ValueError("with_fp32_master needs params to express updates against them")
        step_updates, inner_state = inner.update(to_f32(updates), state.inner, state.master,
                                                 **extra_args)
        new_master = optax.apply_updates(state.master, step_updates)
        # Relative to the current (rounded) parameters, so that params + deltas == new master.
        deltas = jax.tree.map(lambda m, p: m - p.astype(jnp.float32), new_master, params)
        return deltas, MasterState(master=new_master, inner=inner_state)

    return optax.GradientTransformationExtraArgs(init, update)


def make_optimizer(cfg: OptimizerConfig) -> optax.GradientTransformation:
    """clip_by_global_norm -> adamw(warmup-cosine), wrapped in a fp32 master when asked;
    `update` takes `grad_norm=` (see `clip_by_global_norm`)."""
    inner = optax.chain(
        clip_by_global_norm(cfg.max_grad_norm),
        optax.adamw(
            learning_rate=make_schedule(cfg), b1=cfg.b1, b2=cfg.b2, eps=cfg.eps,
            weight_decay=cfg.weight_decay, mask=decay_mask,
        ),
    )
    if cfg.fp32_master:
        return with_fp32_master(inner)
    return inner
