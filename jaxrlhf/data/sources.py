"""Where a run's rows come from (the config's `data` section): user files, else the built-in
task written to the workdir, read once through the same reader.

A bad row of a user file is named by file:line; prompts longer than rollout.max_prompt_len go
by `data.long_prompts`; a problem is one `ConfigError` line naming the field.
"""

from __future__ import annotations

import dataclasses
import pathlib

import jax

from jaxrlhf.data import datasets, tasks
from jaxrlhf.data.chat import ChatTemplateMode
from jaxrlhf.data.long_prompts import LongPrompts, fit_rows
from jaxrlhf.schema import ConfigError, field


@dataclasses.dataclass(frozen=True)
class DataSpec:
    """Where rows come from: user files, else the built-in `task` (see jaxrlhf.data)."""

    train_path: str
    eval_path: str
    sft_path: str
    preference_path: str
    preference_eval_path: str
    preference_holdout: int
    task: tasks.ArithmeticTask | tasks.ReverseTask
    long_prompts: LongPrompts  # prompts longer than rollout.max_prompt_len
    chat_template: ChatTemplateMode  # render prompts with the tokenizer's chat template


@dataclasses.dataclass(frozen=True)
class Data:
    """The run's rows: prompts (train, held-out; fitted to rollout.max_prompt_len), SFT rows,
    and for pair algorithms the preference pairs (train, held-out)."""

    train: list
    eval: list
    sft: list
    pairs: list = dataclasses.field(default_factory=list)
    eval_pairs: list = dataclasses.field(default_factory=list)


def task_dir(workdir: pathlib.Path) -> pathlib.Path:
    """Where the built-in task's files go: one directory per process, so that processes sharing
    a workdir never read a file another one is still writing."""
    return workdir / "data" / (f"process_{jax.process_index()}" if jax.process_count() > 1 else "")


def _read(d: DataSpec, name: str, path, kind: datasets.RowKind, tokenizer,
          max_prompt_len: int = 0) -> list:
    """The rows of `path` (none when empty), prompts fitted; a problem names the field `name`."""
    if not path:
        return []
    with field(name):
        rows = datasets.read_rows(path, kind)
        if kind is not datasets.RowKind.PROMPT:
            return rows
        return fit_rows(rows, tokenizer, max_prompt_len, d.long_prompts, path, d.chat_template)


def read_data(d: DataSpec, workdir: pathlib.Path, tokenizer, max_prompt_len: int,
              pairs: tuple[list, list] = ([], [])) -> Data:
    """The prompt and SFT rows (with the preference `pairs` of `read_pairs`, if any)."""
    kind = datasets.RowKind
    if d.train_path:
        paths = (d.train_path, d.eval_path or d.train_path, d.sft_path)
    else:
        files = tasks.write_task(d.task, task_dir(pathlib.Path(workdir)))
        # num_sft=0 asks for no demonstrations: an empty file, not one that "holds no rows"
        paths = (files.train, files.eval, files.sft if d.task.num_sft else "")
    names = ("data.train_path", "data.eval_path", "data.sft_path")
    kinds = (kind.PROMPT, kind.PROMPT, kind.SFT)
    return Data(*(_read(d, n, p, k, tokenizer, max_prompt_len)
                  for n, p, k in zip(names, paths, kinds)), *pairs)


def read_pairs(d: DataSpec, workdir: pathlib.Path, batch_size: int,
               algorithm: str) -> tuple[list, list]:
    """(train pairs, held-out pairs) of pair `algorithm`: user files, or the built-in task's
    pairs; the held-out ones leave at least one batch of `batch_size` pairs to train on."""
    pairs = datasets.RowKind.PREFERENCE
    if d.preference_path:
        path = d.preference_path
    elif d.train_path:
        raise ConfigError(f"algorithm={algorithm} with user data needs data.preference_path")
    else:  # writing the deterministic task again yields the same files, and their paths
        path = tasks.write_task(d.task, task_dir(pathlib.Path(workdir))).preference
    rows = _read(d, "data.preference_path", path, pairs, None)
    if d.preference_eval_path:
        return rows, _read(d, "data.preference_eval_path", d.preference_eval_path, pairs, None)
    holdout = d.preference_holdout
    if not 0 < holdout < len(rows) - batch_size:
        raise ConfigError(f"data.preference_holdout={holdout} must leave at least one batch of "
                          f"the {len(rows)} pairs in {path} for training")
    return rows[:-holdout], rows[-holdout:]
