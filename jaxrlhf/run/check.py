"""A run spec checked against files and devices, once, before anything compiles: a `Job`.

`prepare(spec, workdir)` loads the tokenizer, checks the reward functions, model directories
and vocabularies, resolves the placement (`placement.kind=auto` searches here, once), and reads
the user's data files (a bad row is named by file:line), and refuses checkpoints in the workdir
that another run wrote (`checkpoint.resume`). The job then runs what was checked.
"""

from __future__ import annotations

import dataclasses
import pathlib
import tempfile

import jax
from ml_collections import ConfigDict

from jaxrlhf.checkpoint import CHECKPOINT_DIR, CheckpointError, check_resume
from jaxrlhf.data import datasets
from jaxrlhf.data.long_prompts import fit_rows
from jaxrlhf.data.rewards import resolve_reward
from jaxrlhf.data.tokenizer import Tokenizer, check_vocab, load_tokenizer
from jaxrlhf.mfc import Role
from jaxrlhf.engine.microbatch import num_microbatches
from jaxrlhf.fingerprint import run_fingerprint
from jaxrlhf.models import hf_io
from jaxrlhf.dataflow.placement import Placement
from jaxrlhf.plan.cluster import load_cluster
from jaxrlhf.run import roles
from jaxrlhf.run.layouts import RunPlan, place
from jaxrlhf.spec import ConfigError, RunSpec, field, run_spec


@dataclasses.dataclass(frozen=True)
class Job:
    """A checked run: its spec, tokenizer and plan, and the directory it writes to."""

    spec: RunSpec
    tokenizer: Tokenizer
    plan: RunPlan
    workdir: pathlib.Path
    fingerprint: dict[str, str]  # what defines the run (checkpoints resume only their own)


def _check_workdir(workdir: str) -> None:
    path = pathlib.Path(workdir)
    path.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=path, prefix=".write-check-"):
        pass


def _check_model_files(spec: RunSpec, role: Role) -> None:
    path = spec.models[role].path
    if path and not any((pathlib.Path(path) / f).is_file()
                        for f in (hf_io.SINGLE_FILE, hf_io.INDEX_FILE)):
        raise ConfigError(f"models.{role.value}.path={path!r}: no {hf_io.SINGLE_FILE} or "
                          f"{hf_io.INDEX_FILE} (a Hugging Face model directory has its weights)")


def _check_cluster_size(spec: RunSpec, devices) -> None:
    """placement.kind=auto plans for a cluster file: this job must have its device count."""
    p = spec.placement
    if p.kind is not Placement.AUTO or not p.cluster:
        return
    cluster = load_cluster(p.cluster)
    have = len(devices or jax.devices())
    if cluster.num_devices != have:
        raise ConfigError(
            f"placement.cluster={p.cluster!r}: the plan is made for its {cluster.hosts} × "
            f"{cluster.devices_per_host} = {cluster.num_devices} devices, but this job has "
            f"{have}; run on that cluster or set placement.cluster to a file for this one")


def _check_data(spec: RunSpec, tokenizer: Tokenizer) -> None:
    """User files parse, their prompts fit (`data.long_prompts`); one batch of prompts exists."""
    d = spec.data
    if not d.train_path:
        return  # the built-in task, already checked by run_spec
    kinds = {"data.train_path": (d.train_path, datasets.RowKind.PROMPT),
             "data.eval_path": (d.eval_path, datasets.RowKind.PROMPT),
             "data.sft_path": (d.sft_path, datasets.RowKind.SFT),
             "data.preference_path": (d.preference_path, datasets.RowKind.PREFERENCE),
             "data.preference_eval_path": (d.preference_eval_path, datasets.RowKind.PREFERENCE)}
    rows = {}
    for name, (path, kind) in kinds.items():
        if path:
            with field(name):
                rows[name] = datasets.read_rows(path, kind)
                if kind is datasets.RowKind.PROMPT:
                    rows[name] = fit_rows(rows[name], tokenizer, spec.rollout.max_prompt_len,
                                          d.long_prompts, path, d.chat_template)
    batch = spec.rollout.batch_size
    if len(rows["data.train_path"]) < batch:
        raise ConfigError(f"rollout.batch_size={batch}: more than the "
                          f"{len(rows['data.train_path'])} rows of {d.train_path}")


def prepare(spec: RunSpec, workdir: str, devices=None) -> Job:
    """Every check that needs no compile, roughly in the order a user would fix them.

    Raises:
      ConfigError: one line naming the field and the problem.
    """
    with field("workdir"):
        _check_workdir(workdir)
    with field("tokenizer"):
        if not spec.tokenizer:  # "" would read the current directory
            raise ConfigError('tokenizer: empty; set it to "byte" or to the Hugging Face '
                              "directory of the models' tokenizer (tokenizer.json)")
        tokenizer = load_tokenizer(spec.tokenizer)
    for role, reward in spec.rewards.items():
        with field(f"{'reward' if role is Role.REWARD else 'cost'}.function"):
            resolve_reward(reward.function)
    for role, model in spec.models.items():
        _check_model_files(spec, role)
        with field(f"models.{role.value}"):  # one tokenizer serves every role
            check_vocab(tokenizer, model.config.vocab_size)
    roles.starts(spec)  # every role has weights to start from
    with field("placement"):
        _check_cluster_size(spec, devices)
        plan = place(spec, devices)
    w = spec.warm_start
    if Role.ACTOR in spec.models and w.steps:
        home = plan.home(spec.graph, Role.ACTOR)
        if w.batch_size % home.dp_size:
            raise ConfigError(f"warm_start.batch_size={w.batch_size}: does not split "
                              f"{home.dp_size} ways over the actor's layout {home}")
        try:  # the warm start micro-batches its batches the same way
            num_microbatches(spec.micro, w.batch_size, spec.rollout.seq_len, home.dp_size)
        except ValueError as error:
            raise ConfigError(f"micro_batches: warm start (warm_start.batch_size="
                              f"{w.batch_size}): {error}") from None
    _check_data(spec, tokenizer)
    fingerprint = run_fingerprint(spec.config_json)
    try:
        check_resume(pathlib.Path(workdir) / CHECKPOINT_DIR, fingerprint, spec.checkpoint.resume)
    except CheckpointError as error:
        raise ConfigError(str(error)) from None
    return Job(spec, tokenizer, plan, pathlib.Path(workdir), fingerprint)


def check_config(config: ConfigDict, workdir: str, devices=None) -> Job:
    """`prepare(run_spec(config), ...)`: the config checked end to end, as the entry point does."""
    return prepare(run_spec(config), workdir, devices)
