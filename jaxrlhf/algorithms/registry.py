"""The algorithm registry: what each algorithm module registers, and how a name finds it.

An algorithm is one module of `jaxrlhf/algorithms/` whose `ALGORITHMS` holds its
`Registration`s (a module may register several variants, as `reinforce.py` does RLOO and
REINFORCE++): the name `algorithm=` selects, the config sections it owns (keys, defaults and
ranges; `jaxrlhf/schema.py` adds them to every config), the sections of others it reads, its
capabilities, and `build`, which turns the config into its graph and losses. Modules are found
by walking the package, so adding an algorithm touches no other library file. Nothing outside
`jaxrlhf/algorithms/` names an algorithm: the spec looks names up here, once
(`tests/test_algorithm_registry.py` checks both).

This module imports nothing of the algorithms at load: the schema (below every config) reads
it, and the algorithm modules read the schema.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import importlib
import pkgutil
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ml_collections import ConfigDict

    from jaxrlhf.algorithms.spec import Algorithm, LossFn, Proximal

DEFAULT = "ppo"  # the `algorithm` of a config that sets none


class Capability(enum.Enum):
    """What an algorithm can run beyond single-turn synchronous steps; the spec refuses the
    rest with one line naming the key."""

    MULTITURN = "multi-turn rollouts (env.name)"
    ASYNC = "asynchronous RL (async_rl.max_staleness > 0, the decoupled objective)"
    CRITIC = "a critic model (GAE)"
    # its actor loss takes π_prox, so the mismatch correction (ppo.tis_cap) applies
    MISMATCH_CORRECTION = "the mismatch correction (ppo.tis_cap > 0)"


# (relation, bound, keys of the section) every listed key must satisfy; relations as in
# `jaxrlhf/schema.py`'s bounds: ">=", ">", "<=", "<"
Bound = tuple[str, Any, tuple[str, ...]]


@dataclasses.dataclass(frozen=True)
class Section:
    """A config section an algorithm owns: `config.<name>.*`, its defaults and ranges."""

    name: str
    defaults: Mapping[str, Any]
    bounds: tuple[Bound, ...] = ()


@dataclasses.dataclass(frozen=True)
class Request:
    """What a run asks of an algorithm's `build`.

    Attributes:
      config: the whole (checked) config; a build reads its own sections and those in
        `Registration.reads`, and shared ones (`rollout`, `reward`).
      cap: the decoupled objective's behav_imp_weight_cap (None: no cap).
      reward_model: a model scores the responses (`reward.kind=model`), else a host function.
      multiturn: rollouts are trajectories of an environment (`env.name`; the graph has no
        reward call).
    """

    config: ConfigDict
    cap: float | None = None
    reward_model: bool = False
    multiturn: bool = False

    @property
    def rows(self) -> int:
        """Sequences a step generates: prompts × responses each."""
        return self.config.rollout.batch_size * self.config.rollout.group_size


@dataclasses.dataclass(frozen=True)
class Built:
    """An algorithm and, where its capabilities take π_prox, its actor loss of π_prox (for
    `decoupled.decouple`)."""

    algorithm: Algorithm
    actor_loss: Callable[[Proximal | None], LossFn] | None = None


@dataclasses.dataclass(frozen=True)
class Registration:
    """One algorithm as the registry knows it.

    Attributes:
      name: the value of `algorithm=`.
      build: the config (a `Request`) -> its graph and losses.
      sections: the config sections it owns.
      reads: sections owned elsewhere (another algorithm's, or the schema's shared `ppo`) that
        its build reads, or their keys ("ppo.clip_eps") where it reads some of a section only:
        the run refuses the others when set (`jaxrlhf/run/unread.py`).
      capabilities: what it runs beyond single-turn synchronous steps.
    """

    name: str
    build: Callable[[Request], Built]
    sections: tuple[Section, ...] = ()
    reads: tuple[str, ...] = ()
    capabilities: frozenset[Capability] = frozenset()

    @property
    def reads_sections(self) -> tuple[str, ...]:
        """Every config section its build reads (some keys of, for a key of `reads`) besides
        the shared ones: its own, then those of `reads`."""
        own = tuple(s.name for s in self.sections)
        return own + tuple(dict.fromkeys(_section_of(entry) for entry in self.reads))

    def reads_key(self, key: str) -> bool:
        """Whether its build reads dotted config key `key` of a section in `reads_sections`."""
        return (_section_of(key) in (*(s.name for s in self.sections), *self.reads)
                or key in self.reads)


def _section_of(key: str) -> str:
    """The section of a dotted key (algorithms' sections are top-level: "ppo.clip_eps" -> "ppo")."""
    return key.split(".", 1)[0]


@functools.cache
def registered() -> tuple[Registration, ...]:
    """Every registration of the package, the most capable first, then by name."""
    import jaxrlhf.algorithms as package

    found = []
    for info in pkgutil.iter_modules(package.__path__):
        module = importlib.import_module(f"{package.__name__}.{info.name}")
        found += getattr(module, "ALGORITHMS", ())
    names = [r.name for r in found]
    if len(set(names)) != len(names):
        raise AssertionError(f"an algorithm name is registered twice: {sorted(names)}")
    return tuple(sorted(found, key=lambda r: (-len(r.capabilities), r.name)))


def names(capability: Capability | None = None) -> tuple[str, ...]:
    """The registered names (with `capability` only, when given)."""
    return tuple(r.name for r in registered() if capability in (None, *r.capabilities))


def lookup(name: str) -> Registration:
    """The registration of `name`; else a ValueError listing the valid names."""
    for r in registered():
        if r.name == name:
            return r
    raise ValueError(f"algorithm={name!r} is not one of: {', '.join(names())}")


def sections() -> tuple[Section, ...]:
    """Every section the algorithms own, in the order of `registered()`."""
    return tuple(s for r in registered() for s in r.sections)


def readers(section: str) -> tuple[str, ...]:
    """The names of the algorithms that read `section` (some of its keys, at least)."""
    return tuple(r.name for r in registered() if section in r.reads_sections)


def key_readers(key: str) -> tuple[str, ...]:
    """The names of the algorithms that read dotted key `key`."""
    return tuple(r.name for r in registered() if r.reads_key(key))


def from_section(cls, section, **typed):
    """Dataclass `cls` from the section's (a ConfigDict's, or another dataclass's) attributes
    of its fields' names; `typed` gives those that the section holds in another form (an enum's
    name, a parsed value; those that are not fields of `cls` are ignored)."""
    return cls(**{f.name: typed[f.name] if f.name in typed else getattr(section, f.name)
                  for f in dataclasses.fields(cls)})


def warm_start() -> Algorithm:
    """The actor's supervised warm start before RL: SFT's graph."""
    return lookup("sft").build(Request(config=None)).algorithm
