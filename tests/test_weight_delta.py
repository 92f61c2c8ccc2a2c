"""Delta weight sync (parallel/delta.py): after N versions the generator's weights are bit for
bit a full sync's, and only the tensors that changed moved."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrlhf.models.sizes import abstract_params, get_size
from jaxrlhf.parallel import delta, make_layout
from jaxrlhf.parallel.reshard import reshard

MODEL = get_size("tiny", num_kv_heads=4)


def _trees():
    boxed = abstract_params(MODEL)
    train = make_layout("0-3:f4", model=MODEL).param_shardings(boxed)
    gen = make_layout("4-7:t4", model=MODEL).param_shardings(boxed)
    shapes = jax.tree.map(lambda b: b.value, boxed, is_leaf=lambda b: hasattr(b, "names"))
    return train, gen, shapes


def test_delta_equals_full_bit_for_bit_over_versions_and_moves_only_changes():
    train, gen, shapes = _trees()
    rng = np.random.default_rng(0)
    host = [rng.standard_normal(s.shape).astype(np.float32) for s in jax.tree.leaves(shapes)]
    treedef = jax.tree.structure(shapes)
    tracker, weights = delta.Tracker(), None
    for version in range(6):
        # Version v changes a different subset of tensors (none at v = 3), by one ulp in one
        # element for the first changed one: a change no tolerance would see.
        touched = [] if version == 3 else list(range(version % 3, len(host), 3))
        for k, i in enumerate(touched):
            if k == 0:
                flat = host[i].reshape(-1)
                flat[0] = np.nextafter(flat[0], np.float32(np.inf))
            else:
                host[i] = host[i] + np.float32(0.5)
        params = jax.tree.unflatten(treedef, [
            jax.device_put(x, s) for x, s in zip(host, jax.tree.leaves(train))])
        changed = tracker.changed(params)
        assert changed == (list(range(len(host))) if version == 0 else touched)
        weights, stats = delta.apply(params, weights, gen, changed)
        full, _ = reshard(params, gen)
        assert stats.bytes_moved == sum(host[i].nbytes for i in changed)
        for a, b, s in zip(jax.tree.leaves(weights), jax.tree.leaves(full), jax.tree.leaves(gen)):
            assert a.sharding == s
            np.testing.assert_array_equal(np.asarray(a).view(np.uint32),
                                          np.asarray(b).view(np.uint32))


def test_a_first_sync_needs_every_tensor():
    train, gen, shapes = _trees()
    params = jax.tree.map(lambda s, sh: jax.device_put(jnp.zeros(s.shape, s.dtype), sh),
                          shapes, train)
    with pytest.raises(ValueError, match="a first sync needs every tensor"):
        delta.apply(params, None, gen, [0])
