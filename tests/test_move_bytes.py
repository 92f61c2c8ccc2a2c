"""A parameter move's compiled programs bring the bytes the planner counts
(`hlo_counts.collective_bytes` beside `plan.blocks.missing_share`).
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrlhf.calibration import hlo_counts
from jaxrlhf.models.sizes import abstract_params, get_size
from jaxrlhf.parallel import make_layout
from jaxrlhf.parallel.reshard import collective_hops
from jaxrlhf.parallel.strategy import parse_strategy
from jaxrlhf.plan.blocks import missing_share
from jaxrlhf.plan.choice import CallChoice


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
