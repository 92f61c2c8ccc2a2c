"""Where each role's first parameters come from, decided from the spec before anything loads.

Every role with `models.<role>.path` loads that Hugging Face directory (actor and ref as causal
LMs; critic, reward and cost as sequence classifiers, or a causal LM's trunk with a new zero
score head). Without a path:
  * the actor is initialised by its config (or warm-started, see `run.rl`);
  * the ref is a copy of the actor (`spec.py` gives it the actor's architecture);
  * a critic (or the reward model reward modelling trains) starts from the actor's trunk with a
    zero score head when its trunk has the actor's shapes; of another size it is initialised by
    its own config, unless the actor comes from a directory (then a critic of random weights
    beside a pretrained actor is surely a mistake, and the check says so);
  * a frozen reward or cost model has nothing to start from: the check asks for its path.
"""

from __future__ import annotations

import enum

import flax.linen as nn
import jax

from jaxrlhf.mfc import Role
from jaxrlhf.models.config import ModelConfig
from jaxrlhf.models.sizes import abstract_params
from jaxrlhf.spec import ConfigError, RunSpec

_HEADS = ("lm_head", "score")


class Start(enum.Enum):
    """How one role's parameters begin."""

    LOAD = "load"  # its own HF directory
    INIT = "init"  # random, by its config (a scalar head starts at zero)
    ACTOR_COPY = "actor_copy"  # the actor's parameters (ref)
    ACTOR_TRUNK = "actor_trunk"  # the actor's trunk and a zero score head (critics)


def trunk_shapes(config: ModelConfig) -> dict:
    """The shapes of every parameter but the head (a top-level one) and LoRA's adapters (a
    copy of the actor takes its merged weights), dtypes aside."""
    params = nn.meta.unbox(abstract_params(config.replace(lora=None)))
    return jax.tree.map(lambda x: x.shape, {k: v for k, v in params.items() if k not in _HEADS})


def start_of(spec: RunSpec, role: Role) -> Start:
    """How `role`'s parameters begin (see the module docstring).

    Raises:
      ConfigError: a role without a path where the config requires one, a frozen reward or
        cost model without a path, or a critic that cannot start from a pretrained actor of
        another size.
    """
    model = spec.models[role]
    if model.path:
        return Start.LOAD
    if spec.require_model_paths:
        raise ConfigError(f"models.{role.value}.path: empty; this config starts every model "
                          "from its own Hugging Face directory (require_model_paths)")
    match role:
        case Role.ACTOR:
            return Start.INIT
        case Role.REF:
            return Start.ACTOR_COPY
    if role not in spec.optimizers:
        raise ConfigError(f"models.{role.value}.path: {role.value}.kind=model needs a trained "
                          "Hugging Face model directory")
    if trunk_shapes(model.config) == trunk_shapes(spec.base.config):
        return Start.ACTOR_TRUNK
    if spec.base.path:
        raise ConfigError(
            f"models.{role.value}: no path, and its architecture is not the actor's (from "
            f"models.actor.path={spec.base.path!r}), so it cannot start from the actor's trunk; "
            f"set models.{role.value}.path to a Hugging Face directory (a sequence classifier, "
            "or a causal LM whose trunk gets a new zero score head)")
    return Start.INIT


def starts(spec: RunSpec) -> dict[Role, Start]:
    """role -> Start for every model of the run (raises ConfigError as `start_of`)."""
    return {role: start_of(spec, role) for role in spec.models}
