"""Mixture-of-experts feed-forward block: a top-k softmax router over experts stacked per
projection, dispatched by sorting tokens by expert and grouped matmuls (`jax.lax.ragged_dot` on
GPU and TPU, blocks of rows on XLA:CPU: `grouped_experts.grouped_matmul`).

A token's output is `sum_j w_j * expert_{e_j}(x)` over its `top_k` experts e_j, with w_j the
router's softmax probability of e_j (renormalised over the k chosen when `norm_topk_prob`:
Mixtral always, Qwen3-MoE as its config says). Each of the T*k (token, slot) assignments is one
row of the grouped matmuls: the rows are sorted by expert (`argsort`), so expert e's rows are
one contiguous group whose size is its token count, and `ragged_dot` multiplies each group by
its own expert's weight [E, in, out]. No [tokens, experts, ...] array is built, so the work and
memory follow the k chosen experts, not all E. Routing is dropless: every assignment is
computed, whatever the load. On a layout with an expert axis (strategy letter `e`) each rank
holds E/e experts and the assignments travel to them by all-to-all, and with a tensor axis
(`t`) F/t of each expert's width (models/expert_parallel.py).

The router is computed in float32 whatever the compute dtype (a [D, E] matmul): a bf16
logit rounds ties differently between two programs (rollout and training), and a different
top-k is a different network.

Per layer the block also returns its router statistics (`RouterStats`): the Switch
load-balancing loss in Hugging Face's form (E * sum_e f_e * P_e, f_e the share of tokens sent
to e, P_e its mean probability; k at an even load), the ST-MoE router z-loss (mean squared
log-partition), and each expert's share of the assignments, all over valid (non-padding)
tokens. The trainer weighs the losses by `MoeConfig.aux_loss_coef` and `z_loss_coef`
(`RouterLosses`, averaged over sparse layers; over each forward's own tokens, i.e. per packed
row chunk and micro-batch, as Megatron computes it per micro-batch).

Shared experts (Qwen2-MoE, DeepSeek) would be a dense MLP beside the routed ones in this block:
a field of `MoeConfig` and one more term in `MoeBlock.__call__`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxrlhf.models import expert_parallel
from jaxrlhf.models.grouped_experts import Routing


@dataclasses.dataclass(frozen=True)
class MoeConfig:
    """The sparse feed-forward blocks of a decoder.

    num_experts: E routed experts per sparse layer; top_k: experts per token.
    expert_intermediate_size: each expert's SwiGLU width (HF `moe_intermediate_size`, Mixtral's
      `intermediate_size`).
    norm_topk_prob: renormalise the k chosen probabilities to sum to one.
    dense_layers: layers that keep the dense MLP (`ModelConfig.intermediate_size`) instead
      (Qwen3-MoE's `mlp_only_layers` and `decoder_sparse_step`); empty: every layer is sparse.
    aux_loss_coef, z_loss_coef: weights of the load-balancing loss and router z-loss in the
      training loss (averaged over sparse layers).
    """

    num_experts: int
    top_k: int
    expert_intermediate_size: int
    norm_topk_prob: bool = True
    dense_layers: tuple[int, ...] = ()
    aux_loss_coef: float = 0.0
    z_loss_coef: float = 0.0

    def __post_init__(self):
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"top_k={self.top_k} must be in 1..num_experts={self.num_experts}")
        if tuple(sorted(set(self.dense_layers))) != tuple(self.dense_layers):
            raise ValueError(f"dense_layers={self.dense_layers} must be sorted and distinct")

    @property
    def mixed(self) -> bool:
        """Some layers dense, some sparse: every layer then holds both blocks' parameters."""
        return bool(self.dense_layers)

    def sparse_layers(self, num_layers: int) -> tuple[int, ...]:
        return tuple(i for i in range(num_layers) if i not in self.dense_layers)

    def replace(self, **changes) -> "MoeConfig":
        return dataclasses.replace(self, **changes)


class RouterStats(NamedTuple):
    """One layer's router statistics over its valid tokens (see the module docstring).

    balance_loss, z_loss: float32 scalars; load_e: float32 [E], each expert's share of the
    assignments (sums to one); sparse: 1.0 for a sparse layer, 0.0 for a dense layer of a
    mixed model (whose other fields are zero).
    """

    balance_loss: jax.Array
    z_loss: jax.Array
    load_e: jax.Array
    sparse: jax.Array


def route(logits_te: jax.Array, top_k: int, norm_topk_prob: bool,
          experts_tk: jax.Array | None = None) -> Routing:
    """Top-k of the softmax of router logits [T, E] (float32), or the probabilities of the
    given experts `experts_tk` int [T, k] (routing replay: the choice is fixed, the weights
    still follow the router, so it still learns). A token whose given ids are negative (none
    recorded: a rollout's last token, never fed back) takes the router's own top-k."""
    probs_te = jax.nn.softmax(logits_te.astype(jnp.float32), axis=-1)
    weights_tk, fresh_tk = jax.lax.top_k(probs_te, top_k)
    if experts_tk is None:
        experts_tk = fresh_tk
    else:
        given_t = experts_tk[:, 0] >= 0
        experts_tk = jnp.where(given_t[:, None], experts_tk.astype(jnp.int32), fresh_tk)
        weights_tk = jnp.take_along_axis(probs_te, experts_tk, axis=-1)
    if norm_topk_prob:
        weights_tk = weights_tk / jnp.sum(weights_tk, axis=-1, keepdims=True)
    return Routing(weights_tk, experts_tk)


def choices_differ(fresh_k: jax.Array, given_k: jax.Array) -> jax.Array:
    """bool [...]: the expert set `fresh_k` [..., k] is not `given_k` [..., k] (order within
    the k does not count; False where none is given: ids negative, routing replay's no-route)."""
    differ = jnp.any(jnp.sort(fresh_k, axis=-1) != jnp.sort(given_k, axis=-1), axis=-1)
    return differ & (given_k[..., 0] >= 0)


def routes_differ(logits_te: jax.Array, experts_tk: jax.Array) -> jax.Array:
    """bool [T]: the router's own top-k of `logits_te` [T, E] is not the set `experts_tk`
    [T, k] (routing replay's given experts, `choices_differ`)."""
    fresh_tk = jax.lax.top_k(logits_te.astype(jnp.float32), experts_tk.shape[-1])[1]
    return choices_differ(fresh_tk, experts_tk)


def router_stats(logits_te: jax.Array, experts_tk: jax.Array, valid_t: jax.Array) -> RouterStats:
    """`RouterStats` of one sparse layer over the tokens with `valid_t` (bool [T])."""
    num_experts = logits_te.shape[-1]
    logits_te = logits_te.astype(jnp.float32)
    valid_t = valid_t.astype(jnp.float32)
    tokens = jnp.maximum(jnp.sum(valid_t), 1.0)
    probs_te = jax.nn.softmax(logits_te, axis=-1)
    counts_e = jnp.zeros(num_experts, jnp.float32).at[experts_tk].add(
        jnp.broadcast_to(valid_t[:, None], experts_tk.shape))
    mean_prob_e = jnp.sum(probs_te * valid_t[:, None], axis=0) / tokens
    balance = num_experts * jnp.sum(counts_e / tokens * mean_prob_e)
    z = jnp.sum(jnp.square(jax.nn.logsumexp(logits_te, axis=-1)) * valid_t) / tokens
    load_e = counts_e / jnp.maximum(jnp.sum(counts_e), 1.0)
    return RouterStats(balance, z, load_e, jnp.ones((), jnp.float32))


def zero_stats(num_experts: int) -> RouterStats:
    """The statistics a dense layer of a mixed model reports (masked out of every mean)."""
    zero = jnp.zeros((), jnp.float32)
    return RouterStats(zero, zero, jnp.zeros(num_experts, jnp.float32), zero)


def _expert_init(stddev: float = 0.02):
    return nn.initializers.normal(stddev)


class MoeBlock(nn.Module):
    """x [b, t, D] -> (y [b, t, D], RouterStats, experts_btk int32 [b, t, k], changed_bt).

    `experts_btk` given (routing replay): those experts are used, weighed by the router's
    probabilities, and changed_bt (bool [b, t]) says where the router would have chosen others;
    else the router chooses and changed_bt is None.

    Parameters: router [D, E] (logical ("embed", "experts_router")), gate_proj and up_proj
    [E, D, F], down_proj [E, F, D] (logical "experts", "embed", "expert_mlp").
    """

    config: Any  # ModelConfig (models/config.py imports this module)

    @nn.compact
    def __call__(self, x_btd: jax.Array, valid_bt: jax.Array,
                 experts_btk: jax.Array | None = None):
        cfg = self.config
        moe: MoeConfig = cfg.moe
        d, e, f = cfg.hidden_size, moe.num_experts, moe.expert_intermediate_size
        param = lambda name, axes, shape: self.param(
            name, nn.with_logical_partitioning(_expert_init(), axes), shape, cfg.param_dtype)
        router_de = param("router", ("embed", "experts_router"), (d, e))
        gate_edf = param("gate_proj", ("experts", "embed", "expert_mlp"), (e, d, f))
        up_edf = param("up_proj", ("experts", "embed", "expert_mlp"), (e, d, f))
        down_efd = param("down_proj", ("experts", "expert_mlp", "embed"), (e, f, d))

        b, t, _ = x_btd.shape
        x_td = x_btd.reshape(b * t, d).astype(cfg.dtype)
        logits_te = jnp.dot(x_td.astype(jnp.float32), router_de.astype(jnp.float32))
        given_tk = None if experts_btk is None else experts_btk.reshape(b * t, -1)
        routing = route(logits_te, moe.top_k, moe.norm_topk_prob, given_tk)
        routing_btk = Routing(*(a.reshape(b, t, -1) for a in routing))
        y_btd = expert_parallel.expert_swiglu(
            x_btd.astype(cfg.dtype), routing_btk, gate_edf.astype(cfg.dtype),
            up_edf.astype(cfg.dtype), down_efd.astype(cfg.dtype))
        stats = router_stats(logits_te, routing.experts_tk, valid_bt.reshape(-1))
        changed_bt = None if given_tk is None else routes_differ(logits_te, given_tk).reshape(b, t)
        return (y_btd.astype(cfg.dtype), stats,
                routing.experts_tk.reshape(b, t, moe.top_k), changed_bt)


class RouterLosses(NamedTuple):
    """A forward's router terms, over its sparse layers (float32 scalars): the mean
    load-balancing loss and z-loss, and `min_load`, the least-used expert's share of the
    assignments in units of an even share (1 = perfectly even, 0 = an expert left idle)."""

    balance_loss: jax.Array
    z_loss: jax.Array
    min_load: jax.Array


def router_losses(stats_l: RouterStats) -> RouterLosses:
    """`RouterLosses` of `RouterStats` stacked over layers [L, ...] (a mixed model's dense
    layers carry sparse = 0 and count in no term)."""
    sparse_l = stats_l.sparse
    layers = jnp.maximum(jnp.sum(sparse_l), 1.0)
    even_share = stats_l.load_e * stats_l.load_e.shape[-1]
    min_load = jnp.min(jnp.where(sparse_l[:, None] > 0, even_share, jnp.inf))
    return RouterLosses(jnp.sum(stats_l.balance_loss) / layers,
                        jnp.sum(stats_l.z_loss) / layers, min_load)


def sown_router_losses(intermediates) -> RouterLosses:
    """`router_losses` of what a `Transformer` applied with mutable=["intermediates"] sowed."""
    (stats_l,) = intermediates["intermediates"]["layers"]["router"]
    return router_losses(stats_l)
