"""Checkpointer: restore onto other layouts and device counts, retention, refusal of non-finite
states, donation-safe async saves (the loop's metrics trimming and Ctrl-C handling:
tests/test_loop.py)."""

import json
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxrlhf.schema import base_config
from jaxrlhf import checkpoint
from jaxrlhf.checkpoint import Checkpointer, CheckpointConfig, HostState
from jaxrlhf.engine.optimizer import OptimizerConfig, make_optimizer
from jaxrlhf.engine.train_step import TrainState
from jaxrlhf.mfc import Role
from jaxrlhf.models.config import HeadKind
from jaxrlhf.models.sizes import abstract_params, get_size
from jaxrlhf.parallel.layout import make_layout
from jaxrlhf.spec import NanPolicy

ACTOR = get_size("tiny", dtype=jnp.float32)  # fp32 compute, as jaxrlhf/schema.py has it
CRITIC = get_size("tiny", dtype=jnp.float32, head=HeadKind.SCALAR)
OPT = OptimizerConfig(lr=1e-2, total_steps=10)


def random_params(model, layout, seed: int):
    """Parameters at O(1)-activation scales (init's are small), placed on `layout`."""
    rng = np.random.default_rng(seed)
    boxed = abstract_params(model)
    shardings = layout.param_shardings(boxed)

    def draw(path, leaf, sharding):
        name = path[-1].key if path[-1].key != "kernel" else path[-2].key
        noise = rng.standard_normal(leaf.shape).astype(np.float32)
        fan_in = model.intermediate_size if name == "down_proj" else model.hidden_size
        value = (1.0 + 0.2 * noise if name == "scale" else 0.5 * noise if name == "embedding"
                 else noise / math.sqrt(fan_in))
        return jax.device_put(value.astype(leaf.dtype), sharding)

    return jax.tree_util.tree_map_with_path(draw, nn.unbox(boxed), shardings)


@jax.jit
def _one_update(params, seed):
    """One AdamW update with gradients sin(3p + seed): non-zero moments, step 1."""
    optimizer = make_optimizer(OPT)
    grads = jax.tree.map(lambda p: jnp.sin(p * 3.0 + seed), params)
    updates, opt_state = optimizer.update(grads, optimizer.init(params), params)
    return TrainState(params=optax.apply_updates(params, updates), opt_state=opt_state,
                      step=jnp.ones((), jnp.int32))


def trained_state(model, layout, seed: int) -> TrainState:
    return _one_update(random_params(model, layout, seed), seed)


def host_state(step: int, config=None, trained=("actor",), frozen=("ref",)) -> HostState:
    config = config or base_config()
    return HostState(step=step, iterator={"epoch": 1, "batch": 2},
                     runner={"step_index": step, "controller": {"kl_coef": 0.05 + step},
                             "reward_errors": 0},
                     config=config.to_json(), trained=trained, frozen=frozen,
                     evaluation_before={"accuracy": 0.25, "reward": 0.5})


def _assert_equal_on(tree, want, target) -> None:
    """Bitwise equal values, and every leaf on its target's sharding."""
    for got, expected, spec in zip(jax.tree.leaves(tree), jax.tree.leaves(want),
                                   jax.tree.leaves(target)):
        assert got.sharding == spec.sharding
        np.testing.assert_array_equal(np.asarray(got), expected)


def test_restore_under_other_layouts_and_device_counts(tmp_path):
    # Saved from a split plan: the models on different sub-meshes.
    states = {Role.ACTOR: trained_state(ACTOR, make_layout("0-7:d8", model=ACTOR), 0),
              Role.REF: random_params(ACTOR, make_layout("4-7:t2d2", model=ACTOR), 1)}
    want = {role: jax.device_get(state) for role, state in states.items()}
    ckpts = Checkpointer(tmp_path, CheckpointConfig(every=1, keep=2, async_save=True))
    assert ckpts.save(states, host_state(3))
    ckpts.wait()
    for actor_spec, ref_spec in [("0-7:d2f2t2", "0-3:d4"), ("4-7:f2t2", "0:d1")]:
        targets = {
            Role.ACTOR: checkpoint.abstract_state(ACTOR, make_layout(actor_spec, model=ACTOR),
                                                  OPT),
            Role.REF: checkpoint.abstract_state(ACTOR, make_layout(ref_spec, model=ACTOR)),
        }
        restored = ckpts.restore_models(3, targets)
        for role in targets:
            _assert_equal_on(restored[role], want[role], targets[role])
    # Tensor parallelism really split a parameter (the restore is not replicated).
    kernel = restored[Role.ACTOR].params["layers"]["mlp"]["up_proj"]["kernel"]
    assert kernel.addressable_shards[0].data.shape[-1] == ACTOR.intermediate_size // 2
    assert ckpts.restore_host() == host_state(3)
    ckpts.close()


def test_async_save_is_safe_against_donation_and_keeps_the_newest(tmp_path):
    layout = make_layout("0-7:d8", model=ACTOR)
    ckpts = Checkpointer(tmp_path, CheckpointConfig(every=1, keep=2, async_save=True))
    wants = {}
    for step in (1, 2, 3):
        state = trained_state(ACTOR, layout, step)
        wants[step] = jax.device_get(state)
        assert ckpts.save({Role.ACTOR: state}, host_state(step))
        # What a donating train_step does to its input right after the save returned.
        jax.tree.map(lambda x: x.delete(), state)
    assert not ckpts.save({}, host_state(3))  # step 3 is there already
    ckpts.wait()
    assert ckpts.all_steps() == [2, 3]
    target = {Role.ACTOR: checkpoint.abstract_state(ACTOR, layout, OPT)}
    for step in (2, 3):
        _assert_equal_on(ckpts.restore_models(step, target)[Role.ACTOR], wants[step],
                         target[Role.ACTOR])
    ckpts.close()
    # A new Checkpointer on the same directory (a resumed run) sees the same checkpoints.
    assert Checkpointer(tmp_path, None).all_steps() == [2, 3]


def test_non_finite_state_is_never_saved(tmp_path):
    layout = make_layout("0-7:d8", model=ACTOR)
    ckpts = Checkpointer(tmp_path, CheckpointConfig(every=1, keep=3, async_save=False))
    good = trained_state(ACTOR, layout, 0)
    assert ckpts.save({Role.ACTOR: good}, host_state(1))
    bad = trained_state(ACTOR, layout, 1)
    mu = bad.opt_state[1][0].mu  # Adam's first moment: a NaN hiding in the optimizer state
    mu["norm"]["scale"] = mu["norm"]["scale"].at[3].set(jnp.inf)
    with pytest.raises(checkpoint.NonFiniteError, match="step 2: .*latest checkpoint: 1"):
        ckpts.save({Role.ACTOR: bad}, host_state(2))
    assert ckpts.all_steps() == [1]
    assert checkpoint.all_finite([good]) and not checkpoint.all_finite([bad])


def test_checkpoint_config_validates():
    config = base_config()
    assert CheckpointConfig.of(config) == CheckpointConfig(every=20, keep=3, async_save=True)
    assert CheckpointConfig(every=20, keep=1, async_save=True).due(40)
    assert not CheckpointConfig(every=0, keep=1, async_save=True).due(40)
    with pytest.raises(ValueError, match="keep=0"):
        CheckpointConfig(every=1, keep=0, async_save=True)
    assert NanPolicy(config.nan_policy) is NanPolicy.STOP


def test_host_state_round_trips_and_reads_an_older_checkpoints_accuracy():
    state = host_state(3)
    assert HostState.from_json(json.loads(json.dumps(state.to_json()))) == state
    older = {k: v for k, v in state.to_json().items() if k != "evaluation_before"}
    older["accuracy_before"] = 0.25  # written before the whole evaluation was kept
    assert HostState.from_json(older).evaluation_before == {"accuracy": 0.25}
    older["accuracy_before"] = None  # a warm-start checkpoint
    assert HostState.from_json(older).evaluation_before == {}
