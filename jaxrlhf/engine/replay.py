"""Routing replay of a mixture-of-experts model (models/moe.py): the experts the rollout chose
for every token, recorded per sparse layer and carried with the rows into the calls that
recompute log-probs and train (docs/ARCHITECTURE.md, "Routing replay").

A row's routes are int [P + N, L, k]: for each of its tokens (prompt, then response) and each
layer, the ids of the k experts that token used when it was generated, in the smallest signed
integer that holds them (`route_dtype`: int8 up to 128 experts), -1 where none was recorded
(padding, a prompt slot not filled, a response's last token: it is never fed back to the
model, and its output predicts nothing a loss reads). The rollout engine records a prompt's
routes at its prefill and each response token's when the next decode step feeds it
(`engine.rollout.programs`), under the weights that sampled the token: a row whose tokens span
policy versions keeps each token's own.

Why: a forward recomputed by another program (the inference and train layouts) rounds the
router's logits differently, and where a near tie flips one token's top-k the two programs
run different networks on it; the log-prob ratio of that token then measures the flip, not
the policy. Replayed, the forward uses the recorded experts (`Transformer`'s `routes_lbtk`)
while the router's probabilities still weigh them, so the router keeps its gradient and its
auxiliary losses. `routing_mismatch` is the share of valid tokens whose fresh top-k differs
from the recorded one in some layer: with replay on, the flips avoided; off, the flips paid.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxrlhf.models import moe

NO_ROUTE = -1  # a token with no recorded experts


def route_dtype(num_experts: int):
    """The smallest signed integer dtype holding ids 0..num_experts - 1 and NO_ROUTE."""
    return np.int8 if num_experts <= 128 else np.int16


def empty_routes(config, rows: int, length: int) -> jax.Array:
    """NO_ROUTE routes [rows, length, L, k] of a model with experts (traceable)."""
    shape = (rows, length, config.num_layers, config.moe.top_k)
    return jnp.full(shape, NO_ROUTE, route_dtype(config.moe.num_experts))


def sown_routes(sown, dtype) -> jax.Array:
    """[b, t, L, k] in `dtype`: the experts every layer chose, from what a `Transformer`
    applied with mutable=["intermediates"] on the plain layer scan sowed ([L, b, t, k])."""
    (routes_lbtk,) = sown["intermediates"]["layers"]["routes"]
    return jnp.transpose(routes_lbtk, (1, 2, 0, 3)).astype(dtype)


def model_routes(routes_btlk: jax.Array) -> jax.Array:
    """The model's `routes_lbtk` int32 [L, b, t, k] of recorded routes [b, t, L, k]."""
    return jnp.transpose(routes_btlk, (2, 0, 1, 3)).astype(jnp.int32)


def changed_counts(sown, recorded_lbtk: jax.Array, valid_bt: jax.Array,
                   replayed: bool) -> jax.Array:
    """float32 [2]: (tokens whose fresh top-k differs from the recorded one in some sparse
    layer, tokens with recorded routes) among the valid tokens (bool [b, t]) of one forward:
    replayed, from the "route_changed" its sparse layers sowed; else its fresh "routes"
    against the recorded ones [L, b, t, k]. Their ratio is `routing_mismatch`."""
    layers = sown["intermediates"]["layers"]
    if replayed:
        (changed_lbt,) = layers["route_changed"]
    else:
        (fresh_lbtk,) = layers["routes"]
        changed_lbt = moe.choices_differ(fresh_lbtk, recorded_lbtk)
    (stats_l,) = layers["router"]
    changed_lbt = changed_lbt & (stats_l.sparse[:, None, None] > 0)  # a mixed model's dense
    recorded_bt = valid_bt & (recorded_lbtk[0, ..., 0] >= 0)
    changed_bt = jnp.any(changed_lbt, axis=0) & recorded_bt
    return jnp.stack([jnp.sum(changed_bt, dtype=jnp.float32),
                      jnp.sum(recorded_bt, dtype=jnp.float32)])


def mismatch(changed_2) -> jax.Array:
    """`routing_mismatch` (float32) of `changed_counts`' (changed, recorded) tokens."""
    return changed_2[0] / jnp.maximum(changed_2[1], 1.0)
