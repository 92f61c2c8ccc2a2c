"""Expert parallelism: a sparse block's experts split over the mesh's "expert" axis, tokens
sent to their experts' devices by all-to-all and back (strategy letter `e`,
docs/ARCHITECTURE.md's parallel layer).

On a layout with e > 1 each expert rank holds E/e experts (rule `experts -> expert`, the
weights' E dim) and its own share of the batch (rule `batch -> (data, fsdp, expert)`: for
attention and the dense layers an expert rank is a data-parallel rank, as in Megatron and
MaxText). `expert_swiglu` then runs, per device (`jax.shard_map` over the whole mesh):

  1. its T tokens' A = T*k (token, slot) assignments, sorted by expert (stable), are written
     into a send buffer [e, A, D]: row (g, j) is the j-th assignment bound for expert rank g
     (whose experts are g*E/e .. (g+1)*E/e - 1), with each row's local expert id [e, A]
     (E/e marks an empty row);
  2. `all_to_all` over "expert" swaps dim 0: row (s, j) is now source s's j-th row for me;
  3. the e*A received rows are sorted by local expert and run through the grouped matmuls
     of the local experts (`grouped_experts.grouped_matmul`), empty rows counted in the last group (they
     are zeros and come out zeros);
  4. a second `all_to_all` returns every row to its source, which reads each assignment back
     from (rank, row) and sums its k rows weighed by the router, as `grouped_experts.experts_swiglu` does.

Dropless with a static worst-case buffer per device pair, not `ragged_all_to_all`: any one
rank may route all A of its assignments to one expert rank, and all e ranks may route to the
same one, so without dropping a buffer holds A rows per peer: send, receive and return
buffers of e*A*D elements each per device (e.g. 4096 tokens, k=8, D=2048, e=8, bf16:
1 GiB each), the local experts' gate/up intermediates e*A*F, and all-to-all traffic of
(e-1)*A*D elements each way where a ragged exchange moves only the A*D that are real. The
grouped matmuls run over the e*A buffer rows (on XLA:CPU's blocked form the work follows the
buffer, not the load). What it buys: plain `all_to_all` lowers on every backend (XLA:CPU
included, where the test suite runs; XLA:CPU rejects `ragged_all_to_all`: "HLO opcode
`ragged-all-to-all` is not supported by XLA:CPU ThunkEmitter", jax 0.10.2), its shapes are
static, and every layout computes exactly the assignments a one-device run computes, so the
results agree to rounding. A capacity factor would cut the buffers to a fraction and drop
tokens past it; ragged all-to-all on GPU/TPU would cut the traffic: both are left for later.

Tensor parallelism (strategy letter `t`, rule `expert_mlp -> tensor`) splits each expert's
hidden width F as Megatron splits a dense MLP: a tensor rank holds F/t columns of every local
expert's gate and up projections and F/t rows of its down projection, so a device holds
1/(e*t) of the expert weights. The rows of a tensor group are the same (the batch is not split
over "tensor"), so routing and dispatch are the same on each rank; each computes its F/t of
every row's SwiGLU, and the ranks' partial outputs [b, t, D] are summed over "tensor" (one
all-reduce per sparse block, as after a dense MLP) once the rows are combined: the combine is
linear, and the sum then moves T*D elements, not the k times more of the assignments. With
t > 1 and no e the same shard_map runs the local experts' F/t and the sum.

Composes with d, f (each device gathers its experts' embed dim) and p (inference and
generation: a pipeline's stages are a vmap over the "pipeline" axis, which the shard_map is
batched over; a model with experts trains without a pipeline, engine/train_step). Where
neither axis splits the experts (absent, of size 1, not dividing E or F, or already manual:
inside the rollout engine's per-device `shard_map`, where the weights arrive whole) the block
computes its experts locally (`grouped_experts.experts_swiglu`).
"""

from __future__ import annotations

import functools
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from jaxrlhf.models.grouped_experts import Routing, experts_swiglu, grouped_matmul


def _rule_axis(logical: str, dim: int) -> str | None:
    """The mesh axis the logical rules in scope map `logical` to, where the context mesh has
    it with a size > 1 that divides `dim` and it is not already manual; else None. Asked of
    the rules, not named here: the model layer does not know the strategy's axes."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return None
    (axis,) = nn.logical_to_mesh_axes((logical,))
    if not isinstance(axis, str) or axis not in mesh.axis_names or axis in mesh.manual_axes:
        return None
    return axis if mesh.shape[axis] > 1 and dim % mesh.shape[axis] == 0 else None


def expert_axis(num_experts: int) -> str | None:
    """The mesh axis the experts' E dim is split over (rule "experts": the strategy's expert
    axis), or None: no mesh in scope, no such axis, or already manual (the block then
    computes its experts locally)."""
    return _rule_axis("experts", num_experts)


def expert_tensor_axis(expert_width: int) -> str | None:
    """The mesh axis each expert's hidden width F is split over (rule "expert_mlp": the
    strategy's tensor axis), or None as for `expert_axis`."""
    return _rule_axis("expert_mlp", expert_width)


def _batch_axes(rows: int) -> tuple[str, ...]:
    """The mesh axes the batch dim of `rows` rows is split over under the logical rules in
    scope (replicated where their product does not divide it, as `Layout.spec` decides)."""
    mesh = jax.sharding.get_abstract_mesh()
    (target,) = nn.logical_to_mesh_axes(("batch",))
    axes = () if target is None else (target,) if isinstance(target, str) else tuple(target)
    axes = tuple(a for a in axes if mesh.shape[a] > 1)
    return axes if rows % math.prod(mesh.shape[a] for a in axes) == 0 else ()


def _local_experts_swiglu(x_rd: jax.Array, local_r: jax.Array, gate_edf: jax.Array,
                          up_edf: jax.Array, down_efd: jax.Array) -> jax.Array:
    """Rows x [R, D] through the SwiGLU of their local expert `local_r` int32 [R] in 0..E_l
    (E_l = the local experts, weights [E_l, ...]; E_l marks an empty row, a zero row): [R, D].

    Rows are sorted by expert (empty rows last, counted in the last group: their zeros give
    zeros), grouped-multiplied and put back in place."""
    local_experts = gate_edf.shape[0]
    order_r = jnp.argsort(local_r, stable=True)
    sizes_e = jnp.bincount(local_r, length=local_experts + 1).astype(jnp.int32)
    sizes_e = sizes_e[:local_experts].at[-1].add(sizes_e[local_experts])
    xs_rd = jnp.take(x_rd, order_r, axis=0)
    h_rf = (nn.silu(grouped_matmul(xs_rd, gate_edf, sizes_e))
            * grouped_matmul(xs_rd, up_edf, sizes_e))
    ys_rd = grouped_matmul(h_rf, down_efd, sizes_e)
    return jnp.zeros_like(ys_rd).at[order_r].set(ys_rd, unique_indices=True)


def _dispatch_compute_combine(axis: str, x_btd: jax.Array, experts_btk: jax.Array,
                              weights_btk: jax.Array, gate_edf: jax.Array, up_edf: jax.Array,
                              down_efd: jax.Array) -> jax.Array:
    """One device's part (under shard_map over the expert mesh axis `axis`): its tokens
    x [b, t, D] and routing [b, t, k], its E/e experts' weights; returns its tokens' outputs
    [b, t, D] (module docstring)."""
    b, t, d = x_btd.shape
    top_k = experts_btk.shape[-1]
    ways = jax.lax.axis_size(axis)
    local_experts = gate_edf.shape[0]
    assignments = b * t * top_k
    x_td = x_btd.reshape(b * t, d)
    experts_a = experts_btk.reshape(-1)  # a = token * k + slot
    order_a = jnp.argsort(experts_a, stable=True)
    expert_s = experts_a[order_a]  # s: the assignments in expert order
    rank_s = expert_s // local_experts
    count_g = jnp.bincount(rank_s, length=ways)
    row_s = jnp.arange(assignments) - (jnp.cumsum(count_g) - count_g)[rank_s]
    send_gad = jnp.zeros((ways, assignments, d), x_td.dtype).at[rank_s, row_s].set(
        jnp.take(x_td, order_a // top_k, axis=0), unique_indices=True)
    local_ga = jnp.full((ways, assignments), local_experts, jnp.int32).at[rank_s, row_s].set(
        expert_s % local_experts, unique_indices=True)
    exchange = lambda a: jax.lax.all_to_all(a, axis, 0, 0, tiled=True)
    recv_gad, recv_local_ga = exchange(send_gad), exchange(local_ga)
    y_rd = _local_experts_swiglu(recv_gad.reshape(ways * assignments, d),
                                 recv_local_ga.reshape(-1), gate_edf, up_edf, down_efd)
    back_gad = exchange(y_rd.reshape(ways, assignments, d))
    y_sd = back_gad[rank_s, row_s]
    y_tkd = jnp.zeros_like(y_sd).at[order_a].set(y_sd, unique_indices=True).reshape(
        b * t, top_k, d)
    y_td = jnp.einsum("tkd,tk->td", y_tkd, weights_btk.reshape(b * t, top_k).astype(y_tkd.dtype))
    return y_td.reshape(b, t, d)


def _device_swiglu(expert_axis: str | None, tensor_axis: str | None, x_btd: jax.Array,
                   experts_btk: jax.Array, weights_btk: jax.Array, gate_edf: jax.Array,
                   up_edf: jax.Array, down_efd: jax.Array) -> jax.Array:
    """One device's part under the shard_map of `expert_swiglu`: its tokens [b, t, D] through
    its experts (E/e of them over `expert_axis` by all-to-all, else all E locally) and its
    F/t columns of their gate and up and rows of their down projections; with a tensor axis
    the ranks' partial outputs [b, t, D] are summed over it (Megatron's MLP all-reduce)."""
    if expert_axis is None:
        b, t, d = x_btd.shape
        routing_tk = Routing(weights_btk.reshape(b * t, -1), experts_btk.reshape(b * t, -1))
        y_btd = experts_swiglu(x_btd.reshape(b * t, d), routing_tk, gate_edf, up_edf,
                               down_efd).reshape(b, t, d)
    else:
        y_btd = _dispatch_compute_combine(expert_axis, x_btd, experts_btk, weights_btk,
                                          gate_edf, up_edf, down_efd)
    return y_btd if tensor_axis is None else jax.lax.psum(y_btd, tensor_axis)


def expert_swiglu(x_btd: jax.Array, routing_btk: Routing, gate_edf: jax.Array,
                  up_edf: jax.Array, down_efd: jax.Array) -> jax.Array:
    """sum_j w_j * expert_{e_j}(x) for x [b, t, D] and a routing of [b, t, k]: [b, t, D].

    Split over the context mesh's expert axis (the E dim) and tensor axis (each expert's F)
    where it has them (module docstring), else computed locally by
    `grouped_experts.experts_swiglu`. Weights [E, in, out] in x's dtype."""
    b, t, d = x_btd.shape
    e_axis = expert_axis(gate_edf.shape[0])
    t_axis = expert_tensor_axis(gate_edf.shape[-1])
    device_part = functools.partial(_device_swiglu, e_axis, t_axis)
    if e_axis is None and t_axis is None:
        return device_part(x_btd, routing_btk.experts_tk, routing_btk.weights_tk, gate_edf,
                           up_edf, down_efd)
    rows = PartitionSpec(_batch_axes(b) or None)
    columns, cut_rows = PartitionSpec(e_axis, None, t_axis), PartitionSpec(e_axis, t_axis, None)
    # check_vma off: inside a pipeline's stage vmap (parallel/pipeline.py, spmd_axis_name
    # "pipeline") the checker takes the output for varying over "pipeline" too, where the
    # batching rule splits it there; over the tensor axis it is replicated indeed: every rank
    # holds the same rows, and the psum makes their outputs the same sum.
    local = jax.shard_map(device_part, in_specs=(rows, rows, rows, columns, columns, cut_rows),
                          out_specs=rows, check_vma=False)
    return local(x_btd, routing_btk.experts_tk, routing_btk.weights_tk, gate_edf, up_edf,
                 down_efd)
