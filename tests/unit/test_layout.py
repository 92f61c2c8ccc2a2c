"""Layouts: meshes, logical->mesh shardings, sharded init, and constraints binding under jit."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from jaxrlhf.models.sizes import abstract_params, get_size
from jaxrlhf.models.transformer import Transformer
from jaxrlhf.parallel import check_batch_divisible, init_params, make_layout
from jaxrlhf.parallel.reshard import reshard
from jaxrlhf.parallel import rules

TINY = get_size("tiny", dtype=jnp.float32)


def test_mesh_of_strategy():
    layout = make_layout("4-7:d2t2", model=TINY)
    assert dict(layout.mesh.shape) == {"pipeline": 1, "data": 2, "fsdp": 1, "expert": 1,
                                       "tensor": 2}
    assert [d.id for d in layout.devices] == [4, 5, 6, 7]
    assert layout.dp_size == 2
    assert str(layout) == "4-7:d2t2"
    assert hash(layout) == hash(make_layout("4-7:d2t2", model=TINY))


def test_param_shardings_follow_rules():
    layout = make_layout("0-7:d2f2t2", model=TINY)
    specs = jax.tree.map(lambda s: s.spec, layout.param_shardings(abstract_params(TINY)))
    assert specs["embed_tokens"]["embedding"] == P("tensor", "fsdp")
    assert specs["lm_head"] == P("fsdp", "tensor")
    attn = specs["layers"]["self_attn"]
    assert attn["q_proj"]["kernel"] == P(None, "fsdp", "tensor", None)
    assert attn["k_proj"]["kernel"] == P(None, "fsdp", "tensor", None)
    assert attn["o_proj"]["kernel"] == P(None, "tensor", None, "fsdp")
    assert specs["layers"]["mlp"]["down_proj"]["kernel"] == P(None, "tensor", "fsdp")
    assert specs["norm"]["scale"] == P("fsdp")


def test_batch_sharding_and_replicated():
    assert make_layout("0-7:d2f2t2").batch_sharding(2).spec == P(("data", "fsdp"), None)
    # Size-1 mesh axes are dropped, so equal placements compare equal.
    assert make_layout("4-7:d2t2").batch_sharding(3).spec == P("data", None, None)
    assert make_layout("0-1:t2").replicated().is_fully_replicated


def test_non_dividing_dims_replicate():
    odd_vocab = TINY.replace(vocab_size=273)
    layout = make_layout("0-1:t2", model=odd_vocab)
    assert dict(layout.rules)["vocab"] is None
    assert dict(layout.rules)["act_vocab"] is None
    assert dict(layout.rules)["mlp"] == "tensor"
    specs = jax.tree.map(lambda s: s.spec, layout.param_shardings(abstract_params(odd_vocab)))
    assert specs["embed_tokens"]["embedding"] == P(None, None)
    # Without a model the shape-aware spec applies the same fallback per array.
    plain = make_layout("0-7:f8")
    assert plain.spec(("vocab", "embed"), (273, 64)) == P(None, "fsdp")
    assert plain.spec(("embed",), (12,)) == P(None)
    assert plain.spec(("embed",)) == P("fsdp")


def test_rule_presets_are_complete():
    from jaxrlhf.models.transformer import LOGICAL_AXES

    for preset in (rules.DEFAULT, rules.REPLICATED_PARAMS):
        assert sorted(name for name, _ in preset) == sorted(LOGICAL_AXES)
    layout = make_layout("0-7:d2f2t2", rules=rules.REPLICATED_PARAMS)
    specs = jax.tree.map(lambda s: s.spec, layout.param_shardings(abstract_params(TINY)))
    assert all(spec == P(*[None] * len(spec)) for spec in jax.tree.leaves(specs))


def test_check_batch_divisible():
    layout = make_layout("0-7:d2f2t2")
    check_batch_divisible(layout, 8, "train batch")
    with pytest.raises(ValueError, match="train batch size 6 is not divisible by data×fsdp×expert=4"):
        check_batch_divisible(layout, 6, "train batch")


@pytest.fixture(scope="module")
def single_params():
    """Tiny-model params on one device: the reference every sharded result must equal."""
    return init_params(TINY, make_layout("0:d1", model=TINY), jax.random.key(0))


def test_init_params_sharded_equals_single_device(single_params):
    layout = make_layout("0-7:d2f2t2", model=TINY)
    params = init_params(TINY, layout, jax.random.key(0))
    expected = layout.param_shardings(abstract_params(TINY))
    jax.tree.map(lambda x, s: (x.sharding == s) or pytest.fail(f"{x.sharding} != {s}"),
                 params, expected)
    q_kernel = params["layers"]["self_attn"]["q_proj"]["kernel"]
    assert q_kernel.shape == (2, 64, 4, 16)
    assert {s.data.shape for s in q_kernel.addressable_shards} == {(2, 32, 2, 16)}
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(single_params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def _forward(config, params, tokens_bt):
    positions_bt = jnp.broadcast_to(jnp.arange(tokens_bt.shape[1]), tokens_bt.shape)
    segments_bt = jnp.ones_like(tokens_bt)
    return Transformer(config).apply({"params": params}, tokens_bt, positions_bt, segments_bt)[0]


def test_constraints_bind_and_match_single_device(single_params):
    # d2f2t2 exercises tensor (t2) together with batch and fsdp splits.
    layout = make_layout("0-7:d2f2t2", model=TINY)
    params, _ = reshard(single_params, layout.param_shardings(abstract_params(TINY)))
    tokens_bt = np.random.default_rng(0).integers(1, TINY.vocab_size, (4, 8), dtype=np.int32)
    fwd = jax.jit(_forward, static_argnums=0)
    on_one_device = single_params["norm"]["scale"].sharding
    ref_btv = fwd(TINY, single_params, jax.device_put(tokens_bt, on_one_device))

    tokens_bt = jax.device_put(tokens_bt, layout.batch_sharding(2))
    unbound_hlo = fwd.lower(TINY, params, tokens_bt).as_text()
    with layout.activation_context():
        hlo = fwd.lower(TINY, params, tokens_bt).as_text()
        logits_btv = fwd(TINY, params, tokens_bt)
    assert "sharding_constraint" not in unbound_hlo
    assert hlo.count("sharding_constraint") >= 5  # embed, q, k, attn out, mlp, logits
    assert logits_btv.sharding.spec == P(("data", "fsdp"), None, "tensor")
    np.testing.assert_allclose(np.asarray(logits_btv), np.asarray(ref_btv), atol=1e-5, rtol=1e-5)
