"""ZeRO-1 (`parallel.zero`): the optimizer state sharded over data parallelism, bitwise equal
in fp32 to the step that keeps a full optimizer state on every data-parallel rank."""

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec

from jaxrlhf.engine import microbatch as mb
from jaxrlhf.engine import train_step as ts
from jaxrlhf.parallel.layout import make_layout
from jaxrlhf.parallel.zero import shard_over_data
from test_train_step import MODEL, OPT, host_params, make_batch, token_ce  # noqa: F401


def test_shard_over_data_adds_data_to_the_last_dividing_dimension():
    layout = make_layout("0-7:d2f2t2", model=MODEL)
    spec = lambda names, shape: shard_over_data(layout.sharding(names, shape), shape).spec
    # [embed (fsdp), mlp (tensor)]: the last dimension, beside tensor.
    assert spec(("embed", "mlp"), (64, 256)) == PartitionSpec("fsdp", ("tensor", "data"))
    # 3 does not split over tensor × data = 4: the first dimension takes it.
    assert spec(("embed", None), (64, 3)) == PartitionSpec(("fsdp", "data"), None)
    # Nothing divides: replicated over data as before.
    assert spec((None,), (3,)) == PartitionSpec(None)
    no_data = make_layout("0-3:f2t2", model=MODEL)
    assert shard_over_data(no_data.sharding(("embed",), (64,)), (64,)) == \
        no_data.sharding(("embed",), (64,))


def _local_bytes(tree) -> int:
    """Bytes device 0 holds of `tree`'s array leaves (not the scalar step counts)."""
    return sum(s.data.nbytes for x in jax.tree.leaves(tree) if x.ndim
               for s in x.addressable_shards if s.device.id == 0)


def _run(host, layout, shard_optimizer: bool, steps: int = 2):
    step = ts.make_train_step(MODEL, layout, token_ce, OPT, mb.MicrobatchConfig.by_count(2),
                              shard_optimizer=shard_optimizer)
    state = ts.create_train_state(host, MODEL, layout, OPT, shard_optimizer=shard_optimizer)
    opt_bytes = _local_bytes(state.opt_state)
    metrics = []
    for i in range(steps):
        state, m = step(state, make_batch(i))
        metrics.append(m)
    return jax.tree.map(np.asarray, (state.params, state.opt_state, metrics)), opt_bytes


@pytest.mark.parametrize("spec", [
    "0-3:d4",
    pytest.param("0-1:d2", marks=pytest.mark.slow),
    pytest.param("0-3:d2t2", marks=pytest.mark.slow),
    pytest.param("0-3:d2p2", marks=pytest.mark.slow),
])
def test_zero1_step_is_bitwise_the_replicated_step(host_params, spec):  # noqa: F811
    """Two steps of two micro-batches (clipping engaged, weight decay on): parameters,
    optimizer state and metrics bitwise equal; device 0 holds 1/d of the optimizer state."""
    layout = make_layout(spec, model=MODEL)
    got, sharded_bytes = _run(host_params, layout, shard_optimizer=True)
    want, whole_bytes = _run(host_params, layout, shard_optimizer=False)
    jax.tree.map(np.testing.assert_array_equal, got, want)
    data = layout.mesh.shape["data"]
    # Every tiny-model leaf has a dimension that data divides.
    assert sharded_bytes * data == whole_bytes
