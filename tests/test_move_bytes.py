"""A parameter move's compiled programs bring the bytes the planner counts
(`hlo_counts.collective_bytes` beside `plan.blocks.missing_share`), and a mixture's expert
stacks moved between an fsdp/tensor layout and an expert-parallel one (`parallel.stages`) are
exact.

One identity program for d4f2 -> d2e2t2 (the experts split over a former data axis, the tensor
axis taking the former fsdp one) made XLA gather each whole stack on every device and slice it
(4 stacks' bytes crossed where 1 must); on a v5p-64, Qwen3-30B-A3B's d8f2t2 -> d4e2t4 moved
1319 GiB where the planner counts 180.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrlhf.calibration import hlo_counts
from jaxrlhf.models.sizes import abstract_params, get_size
from jaxrlhf.parallel import make_layout
from jaxrlhf.parallel.reshard import collective_hops, reshard
from jaxrlhf.parallel.strategy import parse_strategy
from jaxrlhf.plan.blocks import missing_share
from jaxrlhf.plan.choice import CallChoice

MOE = get_size("tiny-moe", dtype=jnp.float32)
STACKS = ("gate_proj", "up_proj", "down_proj")  # [L, E, D, F] / [L, E, F, D]
MOVES = [("0-7:d4f2", "0-7:d2e2t2"), ("0-7:d2e2t2", "0-7:d4f2"),
         ("0-7:d2f2t2", "0-7:d2e2t2"), ("0-7:d2e2t2", "0-7:d2f2t2")]


def _stacks(src: str, dst: str):
    """(name, shape/dtype, source sharding, destination sharding) of each expert stack."""
    boxed = abstract_params(MOE)
    shardings = [jax.tree_util.tree_leaves_with_path(make_layout(s, model=MOE)
                                                     .param_shardings(boxed))
                 for s in (src, dst)]
    leaves = jax.tree.leaves(nn.meta.unbox(boxed))
    return [(jax.tree_util.keystr(path), leaf, a, b)
            for leaf, (path, a), (_, b) in zip(leaves, *shardings)
            if any(name in jax.tree_util.keystr(path) for name in STACKS)]


def _compiled_bytes(leaf, src, dst) -> int:
    """Bytes the move's compiled programs bring from other devices, over all devices."""
    total = 0
    for at, to in collective_hops(src, dst, leaf.shape):
        arg = jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=at)
        compiled = jax.jit(lambda x: x, out_shardings=to).lower(arg).compile()
        total += hlo_counts.collective_bytes(compiled.as_text()) * len(at.device_set)
    return total


def _planned_bytes(leaf, src: str, dst: str) -> float:
    """The planner's bytes for one leaf: each destination device's shard times the share of
    it the device does not hold (`plan.blocks.missing_share`)."""
    a, b = (CallChoice.of(parse_strategy(s)) for s in (src, dst))
    shard = leaf.size * leaf.dtype.itemsize / (b.fsdp * b.tensor * b.expert * b.pipeline)
    return float(np.sum(shard * missing_share(a, b)))


@pytest.mark.parametrize("src,dst", [("0-7:d2f2t2", "0-7:d4t2"), ("0-7:f8", "0-7:d8")])
def test_a_gather_counts_only_what_crosses(src, dst):
    """An all-gather's result holds each device's own shard, which crosses no link: the
    counted bytes are the planner's, not twice them (f2: 1/2 of each result arrives, f8: 7/8)."""
    model = get_size("tiny", dtype=jnp.float32, num_kv_heads=4)
    boxed = abstract_params(model)
    shardings = [jax.tree.leaves(make_layout(s, model=model).param_shardings(boxed))
                 for s in (src, dst)]
    leaves = jax.tree.leaves(nn.meta.unbox(boxed))
    compiled = sum(_compiled_bytes(leaf, a, b) for leaf, a, b in zip(leaves, *shardings)
                   if leaf.ndim > 1)
    planned = sum(_planned_bytes(leaf, src, dst) for leaf in leaves if leaf.ndim > 1)
    assert compiled == pytest.approx(planned, rel=0.01)


@pytest.mark.parametrize("src,dst", MOVES)
def test_expert_stacks_move_the_bytes_the_planner_counts(src, dst):
    """Each stack's programs bring what the planner counts (the expert axis cuts a stack)."""
    for name, leaf, a, b in _stacks(src, dst):
        planned = _planned_bytes(leaf, src, dst)
        assert planned > 0
        assert _compiled_bytes(leaf, a, b) == pytest.approx(planned, rel=0.1), name


# Two mesh axes onto the experts at once: two all-to-alls, each bringing half of a destination
# shard where 3/4 of it must arrive (one program gathered whole stacks: 4x the planner's).
TWO_AXES = [("0-7:d2f2t2", "0-7:d2e4"), ("0-7:d2e4", "0-7:d2f2t2"), ("0-7:d2f4", "0-7:e4t2")]


@pytest.mark.parametrize("src,dst", TWO_AXES)
def test_two_axes_onto_the_experts_move_by_one_all_to_all_each(src, dst):
    for name, leaf, a, b in _stacks(src, dst):
        assert _compiled_bytes(leaf, a, b) == pytest.approx(
            4 / 3 * _planned_bytes(leaf, src, dst), rel=0.01), name


@pytest.mark.parametrize("src,dst", MOVES[:2] + TWO_AXES)
def test_expert_stacks_move_exactly(src, dst):
    rng = np.random.default_rng(0)
    stacks = _stacks(src, dst)
    values = [rng.standard_normal(leaf.shape).astype(leaf.dtype) for _, leaf, _, _ in stacks]
    placed = [jax.device_put(v, a) for v, (_, _, a, _) in zip(values, stacks)]
    moved, _ = reshard(placed, [b for *_, b in stacks])
    for value, x, (name, _, _, b) in zip(values, moved, stacks):
        assert x.sharding.is_equivalent_to(b, x.ndim), name
        np.testing.assert_array_equal(np.asarray(x), value, err_msg=name)


@pytest.mark.parametrize("groups,size", [("{'axis_1'}", 2), ("{'axis_0','axis_2'}", 16),
                                         ("{'axis_0':(2)2}", 2), ("{'axis_0':(1)2,'axis_1'}", 4)])
def test_replica_groups_named_by_mesh_axes_and_their_parts(groups, size):
    """A collective's groups named over the program's mesh, as libtpu writes them: whole axes,
    or a part of one (`'axis_0':(2)2`, the size-2 minor part of axis_0: Qwen3-30B-A3B's move
    d4f4t2 -> d4e2t4 on a v5p-64 wrote it, and reading it as an axis name stopped the
    compile report)."""
    attrs = (f"replica_groups=mesh['axis_0'=4,'axis_1'=2,'axis_2'=4], "
             f"device_ids=([4,2,2,2]T(3,2,1,0)) {groups}, dimensions={{0}}")
    assert hlo_counts._group_size(attrs, 32) == size
