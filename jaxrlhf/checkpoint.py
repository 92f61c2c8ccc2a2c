"""Checkpoints of a run (RL or offline): storage only (the loop's guards, which decide when a
run saves or stops, are `jaxrlhf/run/guards.py`).

A checkpoint is one orbax step directory under `workdir/checkpoints/<steps done>/` with items

  <role>_params  every model's parameters, frozen ones included (the ref is the warm-started
                 actor: saving it is simpler than re-running the warm start, and exact)
  <role>_opt     a trained model's optimizer state and update count ({"opt_state", "step"})
  host           JSON: steps done, the prompt (or training row) iterator's position, the
                 runner's controller state and counters, the held-out evaluation before
                 training, the experiment config

The supervised warm start of the actor, which runs before the first step, has checkpoints of its
own in `workdir/checkpoints/warm_start/<warm-start steps done>/` (the actor's TrainState under
the warm-start optimizer, and the SFT row iterator): a run stopped in its warm start resumes
there, and once the run has a checkpoint of its own the warm start is never run again.

Generation randomness is `fold_in(key(seed), step)`, so the step count restores it too; a run
resumed from a checkpoint repeats the uninterrupted run's steps exactly.

Arrays are restored straight onto target shardings (`abstract_state`): orbax reads, for every
device, the slice its shard of the target needs, so a checkpoint saved under one plan resumes
under another plan or on another number of devices.

Saves are atomic (orbax writes a temporary directory and renames it when complete, so a run
killed mid-save leaves the previous checkpoint as the latest), keep the newest `keep`, and with
`async_save` write files in the background. The device-to-host copy finishes before `save`
returns, so the next train_step may donate the saved buffers.

A checkpoint never holds a non-finite value: `Checkpointer.save` refuses one (and the loop's
`NanGuard` stops the run or discards the bad step before it could be saved).
"""

from __future__ import annotations

import dataclasses
import enum
import json
import logging
import os
import shutil
import pathlib
import sys
import time
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp
from ml_collections import ConfigDict

from jaxrlhf.engine.optimizer import OptimizerConfig, make_optimizer
from jaxrlhf.engine.train_step import TrainState, state_shardings
from jaxrlhf.fingerprint import differences as fingerprint_differences
from jaxrlhf.metrics import METRICS_FILE, TENSORBOARD_DIR
from jaxrlhf.mfc import Role
from jaxrlhf.models import lora
from jaxrlhf.models.config import ModelConfig
from jaxrlhf.models.sizes import abstract_params
from jaxrlhf.parallel.layout import Layout
from jaxrlhf.parallel.reshard import fetch, reshard, spanning

HOST_ITEM = "host"
CHECKPOINT_DIR = "checkpoints"
WARM_START_DIR = "warm_start"  # inside CHECKPOINT_DIR: the warm start's own checkpoints

ModelState = Any  # a TrainState (trained model) or a parameter tree (frozen model)


class NonFiniteError(RuntimeError):
    """A step produced NaN/inf; nothing of it was checkpointed."""


class ResumeMode(enum.Enum):
    """What a rerun does with the checkpoints in its workdir (`checkpoint.resume`)."""

    AUTO = "auto"  # resume the newest intact one if it was written by this same run, else refuse
    NEVER = "never"  # start afresh: existing checkpoints are moved aside, never deleted
    FORCE = "force"  # resume even if another run wrote it (differences are printed)


class CheckpointError(ValueError):
    """Checkpoints that cannot be resumed (reported in one line `checkpoint: ...`)."""


class CheckpointWriteError(RuntimeError):
    """A checkpoint could not be written (disk full, a directory that refuses writes): the run
    stops, its previous checkpoints intact (orbax writes a temporary directory and renames it
    only once complete)."""


class _QuietOrbaxErrors(logging.Filter):
    """Drops orbax's own ERROR records (a tracebacks per file and thread of a failed save, over
    a thousand lines for one disk-full save): the failure reaches `Checkpointer.save` or
    `wait` as one exception, which the run reports in one line (`CheckpointWriteError`). Also
    its warnings that a read-only manager is read-only (two lines each time the checks look at
    a workdir's checkpoints, `Checkpointer(directory, None)`): that is what was asked for."""

    def filter(self, record: logging.LogRecord) -> bool:
        if f"{os.sep}orbax{os.sep}" not in record.pathname:
            return True
        read_only = record.levelno == logging.WARNING and "read only" in record.getMessage(
            ).replace("read_only", "read only")
        return not (record.levelno >= logging.ERROR or read_only)


_QUIET_ORBAX = _QuietOrbaxErrors()


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
    """Attributes:
      every: save after every `every` RL steps (0 = only at the end and on Ctrl-C).
      keep: newest checkpoints kept on disk.
      async_save: write files in the background while training goes on.
      resume: what a rerun does with existing checkpoints.
    """

    every: int
    keep: int
    async_save: bool
    resume: ResumeMode = ResumeMode.AUTO

    def __post_init__(self):
        if self.every < 0 or self.keep < 1:
            raise ValueError(f"checkpoint.every={self.every} must be >= 0 and checkpoint.keep="
                             f"{self.keep} >= 1")

    @classmethod
    def of(cls, config: ConfigDict) -> "CheckpointConfig":
        c = config.checkpoint
        modes = [m.value for m in ResumeMode]
        if c.resume not in modes:
            raise ValueError(f"checkpoint.resume={c.resume!r}: must be one of {modes}")
        return cls(every=c.every, keep=c.keep, async_save=c.async_save,
                   resume=ResumeMode(c.resume))

    def due(self, steps_done: int) -> bool:
        return self.every > 0 and steps_done % self.every == 0


@dataclasses.dataclass(frozen=True)
class HostState:
    """The non-array part of a checkpoint.

    Attributes:
      step: steps done (the runner's step index; the next metrics step).
      iterator: the prompt (or training row) iterator's `state()` as a dict.
      runner: `Runner.state()` (controller values, counters).
      config: the experiment config as JSON (export rebuilds the model configs from it).
      trained: roles saved with optimizer state.
      frozen: roles saved as parameters only.
      fingerprint: what defines the run that wrote it (`jaxrlhf.fingerprint`).
      evaluation_before: the held-out evaluation before training (metric name -> value; not
        recomputed on resume); empty in a warm-start checkpoint (it comes after the warm start).
    """

    step: int
    iterator: dict[str, int]
    runner: dict[str, Any]
    config: str
    trained: tuple[str, ...]
    frozen: tuple[str, ...]
    fingerprint: dict[str, str] = dataclasses.field(default_factory=dict)
    evaluation_before: dict[str, float] = dataclasses.field(default_factory=dict)

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, d: dict) -> "HostState":
        d = dict(d)
        if (accuracy := d.pop("accuracy_before", None)) is not None:  # older checkpoints
            d["evaluation_before"] = d.get("evaluation_before") or {"accuracy": accuracy}
        return cls(**{**d, "trained": tuple(d["trained"]), "frozen": tuple(d["frozen"])})

    def experiment_config(self) -> ConfigDict:
        return ConfigDict(json.loads(self.config))


def _with_sharding(abstract, shardings):
    return jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings)


def abstract_state(model: ModelConfig, layout: Layout,
                   opt_cfg: OptimizerConfig | None = None) -> ModelState:
    """A restore target on `layout`: ShapeDtypeStructs carrying the layout's shardings.

    Args:
      model: the model's architecture.
      layout: where the restored arrays go (any plan, any device count).
      opt_cfg: the optimizer of a trained model (target is a TrainState); None for a frozen one
        (target is the parameter tree).
    """
    boxed = abstract_params(model)
    params = nn.unbox(boxed)
    if opt_cfg is None:
        return _with_sharding(params, layout.param_shardings(boxed))
    shardings = state_shardings(model, layout, opt_cfg)
    trained, _ = lora.partition(params, model.lora)  # with LoRA the adapters' state alone
    opt_state = jax.eval_shape(make_optimizer(opt_cfg).init, trained)
    step = jax.ShapeDtypeStruct((), jnp.int32)
    return TrainState(params=_with_sharding(params, shardings.params),
                      opt_state=_with_sharding(opt_state, shardings.opt_state),
                      step=_with_sharding(step, shardings.step))


@jax.jit
def _all_finite(tree) -> jax.Array:
    checks = [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)
              if jnp.issubdtype(x.dtype, jnp.inexact)]
    return jnp.all(jnp.stack(checks)) if checks else jnp.array(True)


def all_finite(states) -> bool:
    """True when no floating leaf of any of `states` holds NaN or inf.

    Args:
      states: model states (TrainStates or parameter trees), each on the devices of its own
        layout; one fused reduction per state (states on different sub-meshes cannot share a
        computation).
    """
    return all(bool(fetch(_all_finite(state))) for state in states)  # any process


class Checkpointer:
    """Saves and restores a run's checkpoints in `directory` (see the module docstring).

    Args:
      directory: the checkpoint directory (workdir/checkpoints).
      cfg: how often and how many to keep; None opens the directory read-only (export, while
        a run may be writing to it: nothing is saved, deleted or cleaned up).
    """

    def __init__(self, directory: str | os.PathLike, cfg: CheckpointConfig | None):
        self.directory = pathlib.Path(directory).absolute()
        self.cfg = cfg
        logging.getLogger("absl").addFilter(_QUIET_ORBAX)  # once: the same filter object
        if cfg is None:
            options = ocp.CheckpointManagerOptions(read_only=True, create=False)
        else:
            options = ocp.CheckpointManagerOptions(
                max_to_keep=cfg.keep, enable_async_checkpointing=cfg.async_save,
                cleanup_tmp_directories=True)  # leftovers of a run killed mid-save
        self._manager = ocp.CheckpointManager(self.directory, options=options)

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def all_steps(self) -> list[int]:
        return sorted(self._manager.all_steps())

    def save(self, states: dict[Role, ModelState], host: HostState) -> bool:
        """Saves checkpoint `host.step` unless it exists; returns whether it saved.

        Raises:
          NonFiniteError: a model state holds NaN/inf (nothing is written).
          CheckpointWriteError: the disk has no room for it, or the write failed (with
            `async_save`, a background write's failure is raised by the next `save` or `wait`).
        """
        if host.step in self.all_steps():
            return False
        if not all_finite(list(states.values())):
            raise NonFiniteError(f"step {host.step}: a model state holds NaN/inf; not saved "
                                 f"(latest checkpoint: {self.latest_step()})")
        self._check_room(host.step, states)
        items = {HOST_ITEM: ocp.args.JsonSave(host.to_json())}
        # Multi-process: orbax only saves arrays that span every process.
        states = {role: reshard(state, jax.tree.map(lambda x: spanning(x.sharding), state))[0]
                  for role, state in states.items()}
        for role, state in states.items():
            if isinstance(state, TrainState):
                items[f"{role.value}_params"] = ocp.args.StandardSave(state.params)
                items[f"{role.value}_opt"] = ocp.args.StandardSave(
                    {"opt_state": state.opt_state, "step": state.step})
            else:
                items[f"{role.value}_params"] = ocp.args.StandardSave(state)
        try:
            return self._manager.save(host.step, args=ocp.args.Composite(**items), force=True)
        except Exception as error:  # noqa: BLE001 - whatever the storage says: one line
            raise self._write_error(host.step, error) from None

    def _check_room(self, step: int, states: dict[Role, ModelState]) -> None:
        """Refuses a save the disk has no room for, before orbax starts writing it (a save
        that runs out of space midway fails in every writer thread at once)."""
        needed = sum(x.nbytes for x in jax.tree.leaves(list(states.values())))
        free = shutil.disk_usage(self.directory).free
        if free < needed:
            raise CheckpointWriteError(
                f"checkpoint: no room for checkpoint {step} in {self.directory} (it needs "
                f"{needed / 2**20:.1f} MiB, {free / 2**20:.1f} MiB free); {self._last_good()}")

    def _write_error(self, step: int, error: BaseException) -> CheckpointWriteError:
        text = " ".join(str(error).split())
        if "No space left on device" in text:
            text = "No space left on device"
        return CheckpointWriteError(f"checkpoint: writing checkpoint {step} in {self.directory} "
                                    f"failed ({type(error).__name__}: {text[:200]}); "
                                    f"{self._last_good()}")

    def latest_saved(self) -> int | None:
        """The newest checkpoint finished on disk (orbax renames a step's directory to its
        number only once it is complete; `latest_step` also counts a save in flight)."""
        return max((int(p.name) for p in self.directory.iterdir() if p.name.isdigit()),
                   default=None)

    def _last_good(self) -> str:
        latest = self.latest_saved()
        return ("nothing saved before it" if latest is None
                else f"the last good checkpoint is {latest}, intact")

    def restore_host(self, step: int | None = None) -> HostState | None:
        """The host part of checkpoint `step` (default: the latest); None if there is none."""
        step = self.latest_step() if step is None else step
        if step is None:
            return None
        restored = self._manager.restore(step, args=ocp.args.Composite(
            **{HOST_ITEM: ocp.args.JsonRestore()}))
        return HostState.from_json(restored[HOST_ITEM])

    def restore_models(self, step: int, targets: dict[Role, ModelState]
                       ) -> dict[Role, ModelState]:
        """Model states of checkpoint `step`, each on its target's shardings (`abstract_state`)."""
        wanted = {role: jax.tree.map(lambda t: t.sharding, target)
                  for role, target in targets.items()}
        # Multi-process: orbax only restores arrays that span every process; moved back below.
        targets = {role: jax.tree.map(lambda t: jax.ShapeDtypeStruct(
            t.shape, t.dtype, sharding=spanning(t.sharding)), target)
            for role, target in targets.items()}
        items = {}
        for role, target in targets.items():
            params = target.params if isinstance(target, TrainState) else target
            items[f"{role.value}_params"] = ocp.args.StandardRestore(params)
            if isinstance(target, TrainState):
                items[f"{role.value}_opt"] = ocp.args.StandardRestore(
                    {"opt_state": target.opt_state, "step": target.step})
        restored = self._manager.restore(step, args=ocp.args.Composite(**items))
        states = {}
        for role, target in targets.items():
            params = restored[f"{role.value}_params"]
            if isinstance(target, TrainState):
                opt = restored[f"{role.value}_opt"]
                states[role] = TrainState(params=params, opt_state=opt["opt_state"],
                                          step=opt["step"])
            else:
                states[role] = params
        return {role: reshard(state, wanted[role], free_source=True)[0]
                for role, state in states.items()}

    def step_path(self, step: int) -> pathlib.Path:
        return self.directory / str(step)

    def newest_host(self) -> HostState | None:
        """The host part of the newest checkpoint whose host item reads (None if none does);
        a damaged newer one is reported and skipped."""
        for step in reversed(self.all_steps()):
            try:
                return self.restore_host(step)
            except Exception as error:  # noqa: BLE001 - any damage: try the previous one
                _warn_damaged(self.step_path(step), error, "")
        return None

    def restore_intact(self, targets: dict[Role, ModelState]
                       ) -> tuple[HostState, dict[Role, ModelState]] | None:
        """The newest checkpoint that restores completely: (host, model states on `targets`).

        A checkpoint that fails to restore (a truncated or missing file, unreadable metadata)
        is skipped for the previous one, and, unless the directory is open read-only, moved
        aside to `<step>.damaged-N` (one warning line naming both): the run then saves the
        step it trains again under its number. None when there are no checkpoints.

        Raises:
          CheckpointError: checkpoints exist but none of them restores.
        """
        steps = self.all_steps()
        for step in reversed(steps):
            try:
                host = self.restore_host(step)
                return host, self.restore_models(step, targets)
            except Exception as error:  # noqa: BLE001 - any damage: try the previous one
                self._set_aside(step, error)
        if steps:
            raise CheckpointError(f"checkpoint: none of the checkpoints {steps} in "
                                  f"{self.directory} can be restored (see the warnings above)")
        return None

    def _set_aside(self, step: int, error: BaseException) -> None:
        """Warns that checkpoint `step` cannot be restored and (writable) renames it to a free
        `<step>.damaged-N`, which orbax does not count as a step (process 0 renames; every
        process then rereads the directory)."""
        path = self.step_path(step)
        if self.cfg is None:
            _warn_damaged(path, error, "")
            return
        n = 1
        while path.with_name(f"{step}.damaged-{n}").exists():
            n += 1
        aside = path.with_name(f"{step}.damaged-{n}")
        if jax.process_index() == 0:
            path.rename(aside)
        _wait_gone(path)
        self._manager.reload()
        _warn_damaged(path, error, f"moved to {aside.name}; ")

    def wait(self) -> None:
        """Blocks until background writes are on disk.

        Raises:
          CheckpointWriteError: a background write failed.
        """
        saving = self._manager.latest_step()
        try:
            self._manager.wait_until_finished()
        except Exception as error:  # noqa: BLE001 - whatever the storage says: one line
            raise self._write_error(saving, error) from None

    def close(self) -> None:
        self._manager.close()


def _warn_damaged(path: pathlib.Path, error: BaseException, done: str) -> None:
    text = " ".join(str(error).split())[:300]
    print(f"warning: checkpoint {path} cannot be restored ({type(error).__name__}: {text}); "
          f"{done}trying the previous one", file=sys.stderr, flush=True)


def _wait_gone(path: pathlib.Path, seconds: float = 60) -> None:
    """Waits until `path` is gone (a shared workdir: process 0 renames, the others see it)."""
    deadline = time.monotonic() + seconds
    while path.exists():
        if time.monotonic() > deadline:
            raise CheckpointError(f"checkpoint: {path} was not moved aside within {seconds} s")
        time.sleep(0.2)


def check_resume(directory: pathlib.Path, fingerprint: dict[str, str], mode: ResumeMode) -> None:
    """Refuses, before anything compiles, to resume checkpoints another run wrote.

    `NEVER` moves existing checkpoints aside (to `checkpoints.replaced-N`, never deleting
    work); `FORCE` prints what differs and resumes anyway. Multi-process, every process looks
    at the shared directory before any of them goes on to write into it: a process that saw a
    directory another had just created would open one checkpoint manager more than the others,
    and orbax's collective steps would then pair different operations (a job-killing mismatch).

    Raises:
      CheckpointError: (AUTO) the newest readable checkpoint's fingerprint differs from
        `fingerprint`, naming the keys that differ.
    """
    _check_resume(directory, fingerprint, mode)
    if jax.process_count() > 1:
        from jax._src import distributed  # the coordination service (no device collective)

        check_resume.calls = getattr(check_resume, "calls", 0) + 1  # a barrier id is used once
        distributed.global_state.client.wait_at_barrier(
            f"jaxrlhf_check_resume_{check_resume.calls}", timeout_in_ms=600_000)


def _check_resume(directory: pathlib.Path, fingerprint: dict[str, str], mode: ResumeMode
                  ) -> None:
    found = _newest_host(directory)
    if found is None:
        return
    path, host = found
    if mode is ResumeMode.NEVER:
        _move_aside(directory)
        return
    if not host.fingerprint:
        print(f"warning: checkpoint {path} records no fingerprint (an older jaxrlhf wrote it); "
              "resuming it unchecked", file=sys.stderr, flush=True)
        return
    differ = fingerprint_differences(host.fingerprint, fingerprint)
    if not differ:
        return
    listed = "; ".join(differ[:8]) + (f"; and {len(differ) - 8} more" if len(differ) > 8 else "")
    if mode is ResumeMode.FORCE:
        print(f"warning: checkpoint.resume=force: resuming {path}, written "
              f"by another run ({listed})", file=sys.stderr, flush=True)
        return
    raise CheckpointError(
        f"checkpoint: {path} was written by another run ({listed}); "
        "use another --workdir, or --config.checkpoint.resume=never to start afresh (the old "
        "checkpoints are moved aside) or =force to resume it anyway")


def shape_mismatches(directory: pathlib.Path, models: dict[Role, ModelConfig]) -> list[str]:
    """What keeps the checkpoint a rerun would resume from restoring onto `models` (the run's
    architectures; its warm start's checkpoints hold the actor alone): `role: what` for a role
    it lacks and for every parameter whose shape differs or that only one side has, from the
    checkpoint's metadata alone (no array is read, nothing compiles). Empty when it fits or
    there is none. A forced resume checks this first: orbax would fail on such a checkpoint
    as on a damaged one, and the fallback would set another run's intact work aside."""
    found = _newest_host(directory)
    if found is None:
        return []
    path, _ = found
    if path.parent.name == WARM_START_DIR:
        models = {Role.ACTOR: models[Role.ACTOR]}
    out = []
    for role, model in models.items():
        item = path / f"{role.value}_params"
        if not item.is_dir():
            out.append(f"{role.value}: no parameters in {path}")
            continue
        try:  # the handler's metadata: the item's tree alone (the checkpointer's also looks
            # for a step metadata file an item does not have, and warns)
            stored = _shapes(ocp.StandardCheckpointHandler().metadata(item.absolute()).tree)
        except Exception:  # noqa: BLE001 - damaged metadata: the restore's fallback handles it
            continue
        wanted = _shapes(nn.unbox(abstract_params(model)))
        out += [f"{role.value}: {key} {list(stored[key]) if key in stored else '(absent)'} "
                f"where this run has {list(wanted[key]) if key in wanted else '(absent)'}"
                for key in sorted(set(stored) | set(wanted)) if stored.get(key) != wanted.get(key)]
    return out


def _shapes(tree) -> dict[str, tuple[int, ...]]:
    """'a.b.c' -> shape of every array leaf of a nested dict of arrays or array metadata."""
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {".".join(str(getattr(k, "key", k)) for k in path): tuple(leaf.shape)
            for path, leaf in leaves}


def _newest_host(directory: pathlib.Path) -> tuple[pathlib.Path, HostState] | None:
    """(path, host state) of the checkpoint a rerun would resume: the newest readable one of
    the run, else of its warm start; None when there is none."""
    for where in (directory, directory / WARM_START_DIR):
        if not where.is_dir():
            continue
        checkpoints = Checkpointer(where, None)
        try:
            host = checkpoints.newest_host()
        finally:
            checkpoints.close()
        if host is not None:
            return where / str(host.step), host
    return None


def _move_aside(directory: pathlib.Path) -> None:
    """Renames `directory` to a free `<name>.replaced-N` (process 0; the others wait), and the
    metrics beside it (which describe the run of those checkpoints) to `<name>.replaced-N...`."""
    if jax.process_index() == 0:
        n = 1
        while directory.with_name(f"{directory.name}.replaced-{n}").exists():
            n += 1
        target = directory.with_name(f"{directory.name}.replaced-{n}")
        directory.rename(target)
        for name in (METRICS_FILE, TENSORBOARD_DIR):
            metrics = directory.with_name(name)
            if metrics.exists():
                stem, dot, suffix = name.partition(".")
                metrics.rename(directory.with_name(f"{stem}.replaced-{n}{dot}{suffix}"))
        print(f"checkpoint.resume=never: the existing checkpoints moved to {target}", flush=True)
    _wait_gone(directory)


def save_run(checkpoints: Checkpointer, runner, prompts, evaluation_before: dict[str, float],
             config_json: str, fingerprint: dict[str, str]) -> bool:
    """Checkpoints `runner` (a Runner) fed by `prompts` (an EpochIterator of prompts, training
    rows or pairs) after its last step, with the held-out evaluation from before training.

    Trained models are saved as TrainStates, frozen ones as parameters; a frozen model waiting
    in host memory is brought back to read it and offloaded again once the save has copied it.
    Returns whether a checkpoint was written (not if this step has one already).
    """
    runtimes = runner.runtimes
    states = {role: rt.state if rt.trainable else rt.params for role, rt in runtimes.items()}
    host = HostState(
        step=runner.step_index, iterator=prompts.state().to_dict(), runner=runner.state(),
        config=config_json,
        trained=tuple(r.value for r, rt in runtimes.items() if rt.trainable),
        frozen=tuple(r.value for r, rt in runtimes.items() if not rt.trainable),
        fingerprint=fingerprint,
        evaluation_before={k: float(v) for k, v in evaluation_before.items()})
    saved = checkpoints.save(states, host)
    for runtime in runtimes.values():
        runtime.after_call()  # a no-op for trained models and models that stay on devices
    return saved
