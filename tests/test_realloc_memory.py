"""Zero-redundancy reallocation: while a generation copy whose shards contain the training
shards lives, a device holds the generation shard alone (live buffers, exact bytes); the home
parameters come back bitwise; the planner's containment rule agrees with the runtime's."""

import sys
import pathlib

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrlhf.dataflow.runtime import ModelRuntime
from jaxrlhf.engine.optimizer import OptimizerConfig
from jaxrlhf.engine.train_step import init_train_state
from jaxrlhf.mfc import Role
from jaxrlhf.models.sizes import abstract_params, get_size
from jaxrlhf.parallel.layout import make_layout
from jaxrlhf.parallel.reshard import contains_shards
from jaxrlhf.parallel.strategy import parse_strategy
from jaxrlhf.plan.choice import CallChoice
from jaxrlhf.plan.moves import holds_home_shards

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks"))
import realloc_memory  # noqa: E402

MODEL = get_size("tiny", num_kv_heads=4, dtype=jnp.float32)


@pytest.mark.parametrize("train,gen", [
    ("0-7:f4t2", "0-7:d4t2"),
    pytest.param("0-7:p2f2t2", "0-7:p2d2t2", marks=pytest.mark.slow),
])
def test_generation_holds_its_shard_alone(train, gen):
    r = realloc_memory.measure_pair(MODEL, train, gen)
    assert r["zero_redundancy"] == r["generation_shard"]
    assert r["before"] == r["generation_shard"] + r["training_shard"]  # the old copy beside
    assert r["restored_equal"]


@pytest.mark.slow
def test_a_copy_that_does_not_contain_the_home_shards_lives_beside_them():
    """Generation on f4t2 from training on d4t2: each device's copy is a part of its home
    shard, so the home parameters must stay."""
    r = realloc_memory.measure_pair(MODEL, "0-7:d4t2", "0-7:f4t2")
    assert r["zero_redundancy"] == r["before"] == r["generation_shard"] + r["training_shard"]


@pytest.mark.slow
def test_home_parameters_read_while_the_copy_lives_come_back_bitwise():
    train, gen = make_layout("0-3:f4", model=MODEL), make_layout("0-3:d4", model=MODEL)
    state = init_train_state(MODEL, train, OptimizerConfig(), jax.random.key(1))
    want = jax.tree.map(np.asarray, state.params)
    runtime = ModelRuntime(Role.ACTOR, MODEL, train, state=state, readers={gen: 2})
    copy = runtime.params_on(gen)
    jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, copy), want)
    home = runtime.params  # e.g. an inference on the home layout between two generations
    jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, home), want)
    assert runtime.params_on(gen) is copy  # the copy is still the step's
    runtime.done_reading(gen)
    runtime.done_reading(gen)
    jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, runtime.state.params),
                 want)
    shardings = train.param_shardings(abstract_params(MODEL))
    jax.tree.map(lambda x, s: x.sharding.is_equivalent_to(s, x.ndim) or pytest.fail(str(x)),
                 runtime.state.params, shardings)


@pytest.mark.parametrize("home,other", [
    ("0-7:f4t2", "0-7:d4t2"), ("0-7:d4t2", "0-7:f4t2"), ("0-7:p4d2", "0-7:p2d4"),
    ("0-7:p2d4", "0-7:p4d2"), ("0-7:t4d2", "0-7:t2d4"), ("0-7:f8", "0-7:d8"),
    ("0-7:p2f2t2", "0-7:p2d2t2"), ("0-7:f8", "0-3:d4"), ("0-7:t4d2", "0-7:p2t4"),
    ("0-7:p8", "0-7:p2d4"), ("0-7:p2d4", "0-7:d8"),
])
def test_planner_containment_agrees_with_the_shardings(home, other):
    """`plan.moves.holds_home_shards` (degrees) against `reshard.contains_shards` (every
    parameter's device index map) on the tiny model with 8 layers (every dimension it shards
    then divides by 8)."""
    model = MODEL.replace(num_layers=8)
    layouts = [make_layout(s, model=model) for s in (home, other)]
    boxed = abstract_params(model)
    shapes = [x.shape for x in jax.tree.leaves(nn.unbox(boxed))]
    src, dst = (jax.tree.leaves(layout.param_shardings(boxed)) for layout in layouts)
    runtime = all(contains_shards(a, b, shape) for a, b, shape in zip(src, dst, shapes))
    choices = [CallChoice.of(parse_strategy(s)) for s in (home, other)]
    assert holds_home_shards(*choices) == runtime


def test_the_planner_prices_making_a_copy():
    """A plan whose calls fit but whose parameter move does not (both layouts and the gather's
    buffer, `moves.move_memory`) is refused, naming the move: grpo_tiny's actor trained on f4
    generates on d4 over the same 4 devices, gathering each leaf whole."""
    import dataclasses

    from jaxrlhf.configs import grpo_tiny
    from jaxrlhf.plan.cluster import load_cluster
    from jaxrlhf.plan.memory import MoveDoesNotFit, plan_memory
    from jaxrlhf.plan.moves import move_memory
    from jaxrlhf.run.layouts import execution_plan
    from jaxrlhf.spec import run_spec

    config = grpo_tiny.get_config()
    config.models.actor.size = "small"
    config.rollout.batch_size = 2  # 8 rows: the train step's activations below the move
    config.placement.update(kind="manual",
                            allocation="actor_gen=0-3:d4,actor_train=0-3:f4,ref_inf=4-7:d4")
    spec = run_spec(config)
    experiment, plan = spec.experiment(), execution_plan(spec, 8)
    cluster = load_cluster("meshes/cpu_8.py")
    priced = plan_memory(experiment, plan, cluster)
    assert priced.fits and set(priced.moves) == {"actor_gen"}  # the reference keeps its layout
    move = move_memory(experiment.profile(Role.ACTOR), plan["actor_train"], plan["actor_gen"])
    # a gather: the buffer is the destination's shards; the move adds them and the buffer to
    # the resident train state (which holds the source)
    assert move.temporaries == move.destination == 4 * move.source
    assert priced.moves["actor_gen"] > max(priced.peak[n] for n in ("actor_train", "actor_gen"))
    tight = dataclasses.replace(cluster, hbm_bytes=int(
        (priced.moves["actor_gen"] - 1) / cluster.usable_hbm_fraction))
    (refused,) = plan_memory(experiment, plan, tight).violations
    assert isinstance(refused, MoveDoesNotFit) and refused.needed == priced.moves["actor_gen"]
    assert str(refused).startswith("moving actor's parameters to 0-3:d4@1 for MFC actor_gen "
                                   "does not fit on device 0")
