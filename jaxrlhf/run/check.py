"""A run spec checked against files and devices, once, before anything compiles: a `Job`.

`prepare(spec, workdir)` loads the tokenizer, checks the reward functions, model directories
and vocabularies, resolves the placement (`placement.kind=auto` searches here, once), and reads
the run's data (a bad row of a user file is named by file:line), and refuses checkpoints in the workdir
that another run wrote (`checkpoint.resume`). The job then runs what was checked.
"""

from __future__ import annotations

import dataclasses
import pathlib
import tempfile

import jax
from ml_collections import ConfigDict

from jaxrlhf.algorithms.pairs import check_pair_split
from jaxrlhf.algorithms.spec import BatchKind
from jaxrlhf.checkpoint import CHECKPOINT_DIR, CheckpointError, check_resume
from jaxrlhf.data import datasets, tasks
from jaxrlhf.data.long_prompts import fit_rows
from jaxrlhf.data.rewards import resolve_reward
from jaxrlhf.data.tokenizer import Tokenizer, check_vocab, load_tokenizer
from jaxrlhf.engine.microbatch import num_microbatches
from jaxrlhf.fingerprint import run_fingerprint
from jaxrlhf.mfc import Call, Role
from jaxrlhf.models import hf_io
from jaxrlhf.run import roles
from jaxrlhf.run.layouts import RunPlan, place
from jaxrlhf.spec import ConfigError, RunSpec, field, run_spec


@dataclasses.dataclass(frozen=True)
class Data:
    """The run's rows: prompts (train, held-out; fitted to rollout.max_prompt_len), SFT rows,
    and for pair algorithms the preference pairs (train, held-out)."""

    train: list
    eval: list
    sft: list
    pairs: list = dataclasses.field(default_factory=list)
    eval_pairs: list = dataclasses.field(default_factory=list)


@dataclasses.dataclass(frozen=True)
class Job:
    """A checked run: its spec, tokenizer and plan, and the directory it writes to."""

    spec: RunSpec
    tokenizer: Tokenizer
    plan: RunPlan
    workdir: pathlib.Path
    fingerprint: dict[str, str]  # what defines the run (checkpoints resume only their own)
    data: Data  # its rows, read (and the built-in task written) once


def task_dir(workdir: pathlib.Path) -> pathlib.Path:
    """Where the built-in task's files go: one directory per process, so that processes sharing
    a workdir never read a file another one is still writing."""
    return workdir / "data" / (f"process_{jax.process_index()}" if jax.process_count() > 1 else "")


def _read(spec: RunSpec, name: str, path, kind: datasets.RowKind, tokenizer) -> list:
    """The rows of `path` (none when empty), prompts fitted; a problem names the field `name`."""
    if not path:
        return []
    with field(name):
        rows = datasets.read_rows(path, kind)
        if kind is not datasets.RowKind.PROMPT:
            return rows
        d = spec.data
        return fit_rows(rows, tokenizer, spec.rollout.max_prompt_len, d.long_prompts, path,
                        d.chat_template)


def load_data(spec: RunSpec, workdir: pathlib.Path, tokenizer) -> Data:
    """User files when given, else the built-in task written to workdir/data (same reader);
    prompts longer than rollout.max_prompt_len go by `data.long_prompts`."""
    d, kind = spec.data, datasets.RowKind
    if d.train_path:
        paths = (d.train_path, d.eval_path or d.train_path, d.sft_path)
    else:
        files = tasks.write_task(d.task, task_dir(pathlib.Path(workdir)))
        paths = (files.train, files.eval, files.sft)
    names = ("data.train_path", "data.eval_path", "data.sft_path")
    kinds = (kind.PROMPT, kind.PROMPT, kind.SFT)
    paired = spec.algorithm.batches is BatchKind.PAIRS
    pairs = load_preferences(spec, workdir) if paired else ([], [])
    return Data(*(_read(spec, n, p, k, tokenizer) for n, p, k in zip(names, paths, kinds)),
                *pairs)


def load_preferences(spec: RunSpec, workdir: pathlib.Path) -> tuple[list, list]:
    """(train pairs, held-out pairs): user files, or the built-in task's pairs."""
    d, pairs = spec.data, datasets.RowKind.PREFERENCE
    if d.preference_path:
        path = d.preference_path
    elif d.train_path:
        raise ConfigError(f"algorithm={spec.algorithm.name} with user data needs "
                          "data.preference_path")
    else:  # writing the deterministic task again yields the same files, and their paths
        path = tasks.write_task(d.task, task_dir(pathlib.Path(workdir))).preference
    rows = _read(spec, "data.preference_path", path, pairs, None)
    if d.preference_eval_path:
        return rows, _read(spec, "data.preference_eval_path", d.preference_eval_path, pairs, None)
    holdout = d.preference_holdout
    if not 0 < holdout < len(rows) - spec.rollout.batch_size:
        raise ConfigError(f"data.preference_holdout={holdout} must leave at least one batch of "
                          f"the {len(rows)} pairs in {path} for training")
    return rows[:-holdout], rows[-holdout:]


def prepare(spec: RunSpec, workdir: str) -> Job:
    """Every check that needs no compile, roughly in the order a user would fix them.

    Raises:
      ConfigError: one line naming the field and the problem.
    """
    workdir = pathlib.Path(workdir)
    with field("workdir"):  # it exists and takes files
        workdir.mkdir(parents=True, exist_ok=True)
        tempfile.NamedTemporaryFile(dir=workdir, prefix=".write-check-").close()
    with field("tokenizer"):
        if not spec.tokenizer:  # "" would read the current directory
            raise ConfigError('tokenizer: empty; set it to "byte" or to the Hugging Face '
                              "directory of the models' tokenizer (tokenizer.json)")
        tokenizer = load_tokenizer(spec.tokenizer)
    for role, reward in spec.rewards.items():
        with field(f"{'reward' if role is Role.REWARD else 'cost'}.function"):
            resolve_reward(reward.function)
    for role, model in spec.models.items():
        if model.path and not any((pathlib.Path(model.path) / f).is_file()
                                  for f in (hf_io.SINGLE_FILE, hf_io.INDEX_FILE)):
            raise ConfigError(f"models.{role.value}.path={model.path!r}: no {hf_io.SINGLE_FILE} "
                              f"or {hf_io.INDEX_FILE} (a Hugging Face model directory has its "
                              "weights)")
        with field(f"models.{role.value}"):  # one tokenizer serves every role
            check_vocab(tokenizer, model.config.vocab_size)
    roles.starts(spec)  # every role has weights to start from
    with field("placement"):
        plan = place(spec)
    w = spec.warm_start
    if Role.ACTOR in spec.models and w.steps:
        home = plan.home(spec.graph, Role.ACTOR)
        if w.batch_size % home.dp_size:
            raise ConfigError(f"warm_start.batch_size={w.batch_size}: does not split "
                              f"{home.dp_size} ways over the actor's layout {home}")
        # The warm start micro-batches its batches the same way.
        with field(f"micro_batches: warm start (warm_start.batch_size={w.batch_size})"):
            num_microbatches(spec.micro, w.batch_size, spec.rollout.seq_len, home.dp_size)
    data = load_data(spec, workdir, tokenizer)
    if spec.data.train_path and len(data.train) < spec.rollout.batch_size:
        raise ConfigError(f"rollout.batch_size={spec.rollout.batch_size}: more than the "
                          f"{len(data.train)} rows of {spec.data.train_path}")
    for mfc in spec.graph.mfcs:  # micro-batches must keep each chosen row with its rejected
        if spec.algorithm.batches is BatchKind.PAIRS and mfc.call is Call.TRAIN_STEP:
            with field("micro_batches"):
                check_pair_split(spec.rollout.batch_size, plan.micro_batches(mfc.name),
                                 "the number of micro-batches")
    fingerprint = run_fingerprint(spec.config_json)
    try:
        check_resume(workdir / CHECKPOINT_DIR, fingerprint, spec.checkpoint.resume)
    except CheckpointError as error:
        raise ConfigError(str(error)) from None
    return Job(spec, tokenizer, plan, workdir, fingerprint, data)


def check_config(config: ConfigDict, workdir: str) -> Job:
    """`prepare(run_spec(config), ...)`: the config checked end to end, as the entry point does."""
    return prepare(run_spec(config), workdir)
