"""Keys set but not read: a key whose value differs from the schema's default, in a part of the
config this run never reads, is refused in one line before anything compiles. The user meant
it to change the run, and it would not.

What a run reads is derived from the schema, the registry and the run spec, not listed key by
key:
- placement: the keys each `placement.kind` reads, micro-batching's count or token budget, the
  reference's size only beside a path of its own, and offline algorithms' evaluation
  (`_PLACEMENT_RULES`);
- the algorithm: the sections (or, of the shared `ppo`, the keys) its registration reads
  (`Registration.reads_key`); another algorithm's section is refused;
- features: a section read only while its switch is on (`FEATURES`: the environment, the
  asynchronous loop, its decoupled objective's cap, the warm start, W&B);
- roles: `models.<role>` of the roles the graph runs a model for, `optimizer.<role>` of those it
  trains, and the host-function keys of `reward`/`cost` (`RewardSpec`'s fields) of the roles a
  function scores;
- the built-in task: the fields of the task class `data.task.kind` names.

Messages keep the project's form `KEY=VALUE: why` (`error: ` and exit 2 are the CLI's).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator

from ml_collections import ConfigDict

from jaxrlhf.algorithms import registry
from jaxrlhf.dataflow.placement import Placement
from jaxrlhf.mfc import Call, Role
from jaxrlhf.schema import ConfigError, base_config
from jaxrlhf.spec import RewardSpec, RunSpec


@dataclasses.dataclass(frozen=True)
class Feature:
    """Keys under `prefix` are read only while the feature is on (`on`); `switch`, the key that
    turns it on, is read always; `off` says why it is off."""

    prefix: str
    switch: str
    on: Callable[[RunSpec], bool]
    off: str


FEATURES = (
    Feature("env", "env.name", lambda s: s.env is not None,
            "env.name is empty (single-turn rollouts read no env.*)"),
    Feature("async_rl", "async_rl.max_staleness", lambda s: s.async_rl.max_staleness > 0,
            "async_rl.max_staleness=0 (the synchronous loop reads no async_rl.*)"),
    # the decoupled objective's cap (an asynchronous run without it trains PPO's objective)
    Feature("async_rl.behav_imp_weight_cap", "async_rl.decoupled",
            lambda s: s.async_rl.decoupled, "async_rl.decoupled=False"),
    Feature("warm_start", "warm_start.sft_steps", lambda s: s.warm_start.steps > 0,
            "warm_start.sft_steps=0 (no warm start)"),
    Feature("logging.wandb", "logging.wandb.project", lambda s: s.wandb is not None,
            "logging.wandb.project is empty (no W&B run)"),
)
# The warm start clips its gradients as the actor's optimizer does (spec.WarmStartSpec), also
# when the run trains another model (reward modelling).
_WARM_START_READS = "optimizer.actor.max_grad_norm"
_DEFAULT_SIZE = base_config().models.ref.size  # what a config that never set it has


def check(config: ConfigDict, spec: RunSpec) -> None:
    """Refuses the first key set (differs from the schema's default) that this run does not
    read.

    Raises:
      ConfigError: `KEY=VALUE: why this run does not read it`.
    """
    for set_, key, reason in _placement_rules(config, spec):
        if set_:
            raise ConfigError(f"{key}: {reason}")
    for key, value in changed(config, base_config()):
        if (why := unread(key, config, spec)) is not None:
            raise ConfigError(f"{key}={value!r}: {why}")


def changed(section: ConfigDict, default: ConfigDict, prefix: str = "") -> list[tuple[str, object]]:
    """(dotted key, value) of every leaf of `section` that differs from `default`'s."""
    out = []
    for key, value in section.items():
        if isinstance(value, ConfigDict):
            out += changed(value, default[key], f"{prefix}{key}.")
        elif value != default[key]:
            out.append((f"{prefix}{key}", value))
    return out


def unread(key: str, config: ConfigDict, spec: RunSpec) -> str | None:
    """Why this run does not read dotted `key`; None when it does."""
    for rule in (_algorithm, _feature, _role, _task):
        if (why := rule(key, config, spec)) is not None:
            return why
    return None


def _under(key: str, prefix: str) -> bool:
    return key == prefix or key.startswith(prefix + ".")


def _algorithm(key: str, config: ConfigDict, spec: RunSpec) -> str | None:
    """A key of a section some algorithm reads, which this one does not (the registry's
    `reads_key`: its own sections, those of `reads`, the keys of `ppo` it names)."""
    section, name = key.split(".", 1)[0], config.algorithm
    entry = registry.lookup(name)
    if not any(section in r.reads_sections for r in registry.registered()):
        return None  # a shared section, not an algorithm's
    if section not in entry.reads_sections:
        return f"algorithm={name} does not read {section}.* (read by " \
               f"{', '.join(registry.readers(section))})"
    if not entry.reads_key(key):
        return f"algorithm={name} does not read it (read by " \
               f"{', '.join(registry.key_readers(key))})"
    return None


def _feature(key: str, config: ConfigDict, spec: RunSpec) -> str | None:
    """A key of a feature that is off (`FEATURES`; the first that holds the key says why)."""
    for f in FEATURES:
        if _under(key, f.prefix) and key != f.switch and not f.on(spec):
            return f.off
    return None


def _role(key: str, config: ConfigDict, spec: RunSpec) -> str | None:
    """A key of a model, optimizer or scoring function of a role this run does not have."""
    parts, name = key.split("."), config.algorithm
    roles = {r.value: r for r in Role}
    if parts[0] == "models" and (role := roles[parts[1]]) not in (*spec.models, Role.ACTOR):
        why = (f"{role.value}.kind={config[role.value].kind}" if role in spec.rewards
               else f"algorithm={name}")
        return f"this run has no {role.value} model ({why})"
    if parts[0] == "optimizer" and (role := roles[parts[1]]) not in spec.optimizers:
        if key == _WARM_START_READS and spec.warm_start.steps:
            return None
        return f"this run trains no {role.value} model (algorithm={name})"
    if parts[0] in roles and parts[1] in _scoring_keys():  # reward.*, cost.*
        role = roles[parts[0]]
        if not any(m.host or m.call is Call.INFERENCE for m in spec.graph.calls_of(role)):
            return f"this run scores no {role.value} (algorithm={name}" + (
                ", env.name: the environment scores the trajectories)" if spec.env else ")")
        if parts[1] != "kind" and role not in spec.rewards:
            return f"{role.value}.kind={config[role.value].kind} (models.{role.value} scores)"
    return None


def _scoring_keys() -> set[str]:
    """The keys of a scoring section (`reward`, `cost`) that say who scores: its kind, and the
    host function's (RewardSpec's fields)."""
    return {"kind", *(f.name for f in dataclasses.fields(RewardSpec))}


def _task(key: str, config: ConfigDict, spec: RunSpec) -> str | None:
    """A key of the built-in task that its kind's task class has no field for."""
    if not _under(key, "data.task") or key == "data.task.kind":
        return None
    task = type(spec.data.task)
    fields = [f.name for f in dataclasses.fields(task)]
    if key.rsplit(".", 1)[1] in fields:
        return None
    return (f"data.task.kind={config.data.task.kind} does not read it ({task.__name__} reads "
            f"{', '.join(fields)})")


def _placement_rules(config: ConfigDict, spec: RunSpec) -> Iterator[tuple[bool, str, str]]:
    """(set, `KEY=VALUE`, why) of the keys that placement, micro-batching and evaluation read
    only in some runs."""
    p, kind = config.placement, spec.placement.kind
    yield (p.strategy and kind is not Placement.COLOCATE, f"placement.strategy={p.strategy!r}",
           f"placement.kind={kind.value} ignores it (colocate reads it; manual: set each MFC's "
           "strategy in placement.allocation)")
    yield (p.allocation and kind is not Placement.MANUAL, f"placement.allocation={p.allocation!r}",
           f"placement.kind={kind.value} ignores it (it is read with placement.kind=manual)")
    yield (p.cluster and kind is not Placement.AUTO, f"placement.cluster={p.cluster!r}",
           f"placement.kind={kind.value} ignores it (it is read with placement.kind=auto; set "
           "placement.cluster= to clear it)")
    yield (p.compile_check and kind is not Placement.AUTO,
           f"placement.compile_check={p.compile_check}", f"placement.kind={kind.value} ignores "
           "it (it compiles the searched plans of placement.kind=auto; `python -m jaxrlhf.plan "
           "--compile` compiles any plan)")
    yield (config.micro_batch_tokens and config.micro_batches != 1,
           f"micro_batches={config.micro_batches}", f"micro_batch_tokens="
           f"{config.micro_batch_tokens} > 0 splits micro-batches by tokens instead")
    yield (Role.REF in spec.models and not config.models.ref.path
           and config.models.ref.size not in (config.models.actor.size, _DEFAULT_SIZE),
           f"models.ref.size={config.models.ref.size!r}", "without models.ref.path the reference "
           f"is a copy of the actor (models.actor.size={config.models.actor.size!r})")
    if spec.algorithm.offline:
        for k in ("every", "samples"):
            yield (config.eval[k], f"eval.{k}={config.eval[k]}",
                   f"{spec.algorithm.name} evaluates before and after training only, greedily")
