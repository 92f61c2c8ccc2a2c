"""The experts' computation once a router has chosen: each token's k (expert, weight) pairs
(`Routing`) through the chosen experts' SwiGLU by grouped matmuls over the assignments sorted
by expert (`experts_swiglu`), `jax.lax.ragged_dot` on TPU, blocks of rows on XLA:CPU and GPU
(`grouped_matmul`). The router and the block are models/moe.py; the expert-parallel dispatch
that runs these on each expert rank's share is models/expert_parallel.py.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxrlhf.kernels import target


class Routing(NamedTuple):
    """A router's choice for T tokens: weights_tk float32 [T, k] (the combine weights),
    experts_tk int32 [T, k] (expert ids, in descending probability unless given)."""

    weights_tk: jax.Array
    experts_tk: jax.Array



def block_layout(rows: int, groups: int) -> tuple[int, int]:
    """(rows of a block, blocks) of `blocked_grouped_matmul` over `rows` rows in `groups`
    groups: a block is about a quarter of an even group, a power of two in 8..1024, and the
    blocks are enough for any split of the rows (a group's padding is under a block, so
    sum_e ceil(size_e / block) is at most rows / block + groups).
    Each block holds a copy of its group's weight [in, out], so blocks of few rows hold more
    weight than rows: at 128 rows Qwen3-30B-A3B's log-probs on f4t2 of 8 H100s (3.1M rows,
    128 experts of [2048, 384]) gathered 36 GiB a projection, 4.7 GiB at 1024."""
    block = int(min(1024, max(8, 2 ** int(math.log2(max(1, rows // (4 * groups)))))))
    return block, -(-rows // block) + groups


def blocked_grouped_matmul(x_ad: jax.Array, w_eio: jax.Array,
                           group_sizes_e: jax.Array) -> jax.Array:
    """`jax.lax.ragged_dot(x_ad, w_eio, group_sizes_e)` for rows sorted by group, as one
    batched matmul over blocks of rows: each group's rows are padded to whole blocks, and each
    block is multiplied by its group's weight (gathered per block).

    Why: XLA:CPU has no ragged dot; JAX lowers it there to a dense masked product over all E
    groups ([E, rows, in] and E times the work; a train step of `bench` with 8 experts, top-2,
    took 4.3x a dense step of the same active parameters). Here the work is the rows plus
    under one block of padding per group.
    """
    rows, d_in = x_ad.shape
    groups = w_eio.shape[0]
    block, blocks = block_layout(rows, groups)
    blocks_e = (group_sizes_e + block - 1) // block
    block_end_e = jnp.cumsum(blocks_e)
    row_end_e = jnp.cumsum(group_sizes_e)
    row_a = jnp.arange(rows, dtype=group_sizes_e.dtype)
    group_a = jnp.minimum(jnp.searchsorted(row_end_e, row_a, side="right"), groups - 1)
    at_a = ((block_end_e - blocks_e)[group_a] * block
            + row_a - (row_end_e - group_sizes_e)[group_a])
    x_nbi = jnp.zeros((blocks * block, d_in), x_ad.dtype).at[at_a].set(
        x_ad, unique_indices=True).reshape(blocks, block, d_in)
    group_n = jnp.minimum(jnp.searchsorted(block_end_e, jnp.arange(blocks), side="right"),
                          groups - 1)  # blocks past the last group's hold zeros
    y_nbo = jnp.einsum("nbi,nio->nbo", x_nbi, jnp.take(w_eio, group_n, axis=0))
    return y_nbo.reshape(blocks * block, -1)[at_a]


def grouped_matmul(x_ad: jax.Array, w_eio: jax.Array, group_sizes_e: jax.Array) -> jax.Array:
    """x [A, in] (rows sorted by group) times each group's weight of w [E, in, out]: [A, out].
    `ragged_dot` where the program's devices have a grouped matmul (TPU: libtpu's kernel),
    else blocked. XLA:GPU expands `ragged_dot` into a dense product over all E groups, as JAX
    does on CPU: [65,536, 2,048] rows times [128, 2,048, 384] bf16 experts compiled for an
    H100 held 32 GiB of temporaries, the blocked form 1.31 GiB, and Qwen3-30B-A3B's
    log-probs on f4t2 of 8 H100s 1,566 GiB a GPU (105 GiB blocked).

    The devices are the mesh's (`kernels.target.platform`), not the default backend: a call
    compiled for a TPU slice on a CPU host (`plan --compile`) took the blocked form, whose
    per-block weight copies put Qwen3-30B-A3B's inference on f32 of a v5p-64 at 81.6 GiB.

    bf16 operands contract at the default precision whatever `jax_default_matmul_precision`
    says: libtpu's grouped-matmul kernel refuses a bf16 matmul at fp32 contract precision
    ("Bad lhs type"), which the test suite's "highest" asked for, and bf16 x bf16 products
    accumulate exactly in fp32 at the default precision anyway."""
    if target.platform() == "tpu":
        bf16 = x_ad.dtype == w_eio.dtype == jnp.bfloat16
        return jax.lax.ragged_dot(x_ad, w_eio, group_sizes_e,
                                  precision=jax.lax.Precision.DEFAULT if bf16 else None)
    return blocked_grouped_matmul(x_ad, w_eio, group_sizes_e)


def experts_swiglu(x_td: jax.Array, routing: Routing, gate_edf: jax.Array, up_edf: jax.Array,
                   down_efd: jax.Array) -> jax.Array:
    """sum_j w_j * down_e(silu(gate_e(x)) * up_e(x)) over each token's experts: [T, D].

    The T*k assignments are sorted by expert (a stable sort, so a group keeps token order),
    each projection is one grouped matmul over those groups (`grouped_matmul`), and the rows are scattered back to
    their (token, slot) place and weighed. Weights [E, in, out] in the compute dtype of x.
    """
    tokens, top_k = routing.experts_tk.shape
    num_experts = gate_edf.shape[0]
    experts_a = routing.experts_tk.reshape(-1)  # a = token * k + slot
    order_a = jnp.argsort(experts_a, stable=True)
    group_sizes_e = jnp.bincount(experts_a, length=num_experts).astype(jnp.int32)
    x_ad = jnp.take(x_td, order_a // top_k, axis=0)
    gate_af = grouped_matmul(x_ad, gate_edf, group_sizes_e)
    up_af = grouped_matmul(x_ad, up_edf, group_sizes_e)
    h_af = nn.silu(gate_af) * up_af
    y_ad = grouped_matmul(h_af, down_efd, group_sizes_e)
    y_tkd = jnp.zeros_like(y_ad).at[order_a].set(y_ad, unique_indices=True).reshape(
        tokens, top_k, -1)
    return jnp.einsum("tkd,tk->td", y_tkd, routing.weights_tk.astype(y_tkd.dtype))
