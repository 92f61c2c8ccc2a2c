"""Every shipped config parses, is locked against unknown keys, and validates before compiling.

Tiny configs are planned on the 8 test devices. Big configs are checked abstractly: their model
sizes match ReaL's Table 1, and each MFC of the plan the planner searches for their cluster
gets parameter shardings on an AbstractMesh whose per-device bytes fit the device, and a model
forward that type-checks under `jax.eval_shape` at the real batch and sequence shapes.
"""

import importlib
import math
import pathlib

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest
from jax.sharding import AbstractMesh

from jaxrlhf.run.layouts import place, searched_plan
from jaxrlhf.spec import run_spec
from jaxrlhf.mfc import Call
from jaxrlhf.models.sizes import abstract_params
from jaxrlhf.models.transformer import Transformer
from jaxrlhf.parallel.layout import Layout
from jaxrlhf.parallel.strategy import MESH_AXIS_NAMES, parse_strategy
from jaxrlhf.parallel import rules

CONFIGS = sorted(p.stem for p in (pathlib.Path(__file__).parents[1] / "configs").glob("*.py")
                 if p.stem not in ("__init__", "base"))
BIG = ("ppo_7b", "ppo_70b", "grpo_qwen3_8b", "grpo_qwen3_30b_a3b")
TINY = [c for c in CONFIGS if c not in BIG]


def load(name, arg=None):
    return importlib.import_module(f"jaxrlhf.configs.{name}").get_config(arg)


@pytest.mark.parametrize("name", CONFIGS)
def test_config_parses_and_rejects_unknown_keys(name):
    config = load(name)
    config.lock()
    with pytest.raises(AttributeError):
        config.no_such_key = 1
    with pytest.raises(AttributeError):
        config.rollout.batch_sizee = 3


@pytest.mark.parametrize("name", TINY)
def test_tiny_config_plans_on_the_test_devices(name):
    spec = run_spec(load(name))
    plan = place(spec)
    assert set(plan.layouts) == {m.name for m in spec.graph.mfcs if not m.host}


@pytest.mark.parametrize("name", CONFIGS)  # each runs in tests/test_config_runs.py and others
def test_smoke_variant(name):
    assert load(name, "smoke").steps == 2


@pytest.mark.parametrize("name", CONFIGS)
def test_unknown_variants_are_rejected(name):
    with pytest.raises(ValueError, match="unknown variant"):
        load(name, "no_such_variant")


def test_variants():
    assert load("ppo_7b", "smoke").steps == 2
    assert load("ppo_70b", "h800").placement.cluster.endswith("h800_16x8.py")
    with pytest.raises(ValueError, match="unknown variant"):
        load("ppo_70b", "nope")


def _abstract_layout(spec: str) -> Layout:
    strategy = parse_strategy(spec)
    return Layout(strategy, AbstractMesh(strategy.mesh_shape, MESH_AXIS_NAMES), rules.DEFAULT)


def _bytes_per_device(boxed, layout: Layout) -> int:
    shardings = jax.tree.leaves(layout.param_shardings(boxed))
    leaves = jax.tree.leaves(nn.unbox(boxed))
    return sum(math.prod(s.shard_shape(x.shape)) * x.dtype.itemsize
               for x, s in zip(leaves, shardings))


@pytest.mark.parametrize("name", BIG)
def test_big_config_plan_fits_and_forward_type_checks(name):
    config = load(name)
    spec = run_spec(config)
    allocation = {name: choice.spec() for name, choice in searched_plan(spec).items()}
    graph, models = spec.graph, spec.model_configs()
    from jaxrlhf.plan.cluster import load_cluster
    hbm = load_cluster(config.placement.cluster).hbm_bytes
    r = config.rollout
    seq = r.max_prompt_len + r.max_new_tokens
    for mfc in graph.mfcs:
        if mfc.host:
            continue
        model = models[mfc.role]
        layout = _abstract_layout(allocation[mfc.name].split(":")[1])
        boxed = abstract_params(model)
        param_bytes = _bytes_per_device(boxed, layout)
        assert param_bytes < hbm, (mfc.name, param_bytes)
        if mfc.call is Call.TRAIN_STEP:  # + fp32 master, Adam m and v, sliced over data (ZeRO-1)
            state = param_bytes * (1 + 6 / layout.strategy.data)
            assert state < hbm, (mfc.name, param_bytes, allocation[mfc.name])
        rows = r.batch_size // layout.dp_size  # one data-parallel shard's rows
        tokens = jax.ShapeDtypeStruct((rows, seq), jnp.int32)
        out, _ = jax.eval_shape(lambda p, t: Transformer(model).apply({"params": p}, t, t, t),
                                nn.unbox(boxed), tokens)
        assert out.shape[:2] == (rows, seq)
