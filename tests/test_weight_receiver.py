"""WeightReceiver: a version received beside the caller's work (or inline), handed over once."""

import threading

import jax
import jax.numpy as jnp
import pytest

from jaxrlhf.models.sizes import abstract_params, get_size
from jaxrlhf.parallel import make_layout
from jaxrlhf.run.weight_receiver import WeightReceiver, bytes_per_device, second_copy_fits


def test_overlapped_receipt_runs_beside_the_caller_and_is_handed_over_once():
    release, calls = threading.Event(), []

    def receive(version):
        calls.append(version)
        release.wait(timeout=30)
        return jnp.full((4,), version)

    receiver = WeightReceiver(receive, overlap=True)
    receiver.start(3)
    assert receiver.busy and receiver.ready() is None  # still receiving: the caller goes on
    with pytest.raises(RuntimeError, match="weights v4 before v3 arrived"):
        receiver.start(4)
    release.set()
    params, version = receiver.join()
    assert version == 3 and params.tolist() == [3, 3, 3, 3] and calls == [3]
    assert not receiver.busy and receiver.ready() is None and receiver.join() is None


def test_inline_receipt_is_complete_when_start_returns_and_errors_reach_the_caller():
    receiver = WeightReceiver(lambda v: v * 10, overlap=False)
    receiver.start(2)
    assert receiver.ready() == (20, 2)

    def broken(version):
        raise ValueError(f"v{version} broke")

    receiver = WeightReceiver(broken, overlap=True)
    receiver.start(5)
    with pytest.raises(ValueError, match="v5 broke"):
        receiver.join()


def test_second_copy_room_and_bytes_per_device():
    model = get_size("tiny", num_kv_heads=4)
    boxed = abstract_params(model)
    shardings = make_layout("0-3:t4", model=model).param_shardings(boxed)
    leaves = jax.tree.leaves(jax.tree.map(lambda b: b.value, boxed,
                                          is_leaf=lambda b: hasattr(b, "names")))
    expected = sum(x.size // (4 if s.spec and any(s.spec) else 1) * x.dtype.itemsize
                   for x, s in zip(leaves, jax.tree.leaves(shardings)))
    assert bytes_per_device(shardings, leaves) == expected
    # XLA:CPU reports no memory figures: the host's available memory decides.
    assert second_copy_fits(jax.devices()[:4], expected)
    assert not second_copy_fits(jax.devices()[:4], 1 << 50)
