"""A config checked end to end, once, before anything compiles: a `Job`.

`check_config(config, workdir)` builds the run spec (`jaxrlhf.spec.run_spec`), loads the
tokenizer, checks the reward functions, model directories and vocabularies, resolves the
placement (`placement.kind=auto` searches here, once), reads the run's data (a bad row of a user
file is named by file:line), and refuses checkpoints in the workdir that another run wrote
(`checkpoint.resume`). The job then runs what was checked.
"""

from __future__ import annotations

import dataclasses
import pathlib
import tempfile

from ml_collections import ConfigDict

from jaxrlhf.algorithms.spec import BatchKind
from jaxrlhf.checkpoint import CHECKPOINT_DIR, check_resume
from jaxrlhf.data.rewards import resolve_reward
from jaxrlhf.data.sources import Data, read_data, read_pairs
from jaxrlhf.data.tokenizer import Tokenizer, check_vocab, load_tokenizer
from jaxrlhf.engine.microbatch import num_microbatches
from jaxrlhf.fingerprint import run_fingerprint
from jaxrlhf.models import hf_io
from jaxrlhf.run import roles
from jaxrlhf.run.layouts import RunPlan, place
from jaxrlhf.schema import ConfigError, field
from jaxrlhf.spec import RunSpec, run_spec


@dataclasses.dataclass(frozen=True)
class Job:
    """A checked run: its spec, tokenizer and plan, and the directory it writes to."""

    spec: RunSpec
    tokenizer: Tokenizer
    plan: RunPlan
    workdir: pathlib.Path
    fingerprint: dict[str, str]  # what defines the run (checkpoints resume only their own)
    data: Data  # its rows, read (and the built-in task written) once


def load_data(spec: RunSpec, workdir: pathlib.Path, tokenizer) -> Data:
    """The run's rows (`data.sources`): pair algorithms read their preference pairs too."""
    paired = spec.algorithm.batches is BatchKind.PAIRS
    pairs = (read_pairs(spec.data, workdir, spec.rollout.batch_size, spec.algorithm.name)
             if paired else ([], []))
    return read_data(spec.data, workdir, tokenizer, spec.rollout.max_prompt_len, pairs)


def check_config(config: ConfigDict, workdir: str) -> Job:
    """Every check that needs no compile, roughly in the order a user would fix them.

    Raises:
      ConfigError: one line naming the field and the problem.
    """
    spec, workdir = run_spec(config), pathlib.Path(workdir)
    with field("workdir"):  # it exists and takes files
        workdir.mkdir(parents=True, exist_ok=True)
        tempfile.NamedTemporaryFile(dir=workdir, prefix=".write-check-").close()
    with field("tokenizer"):
        if not spec.tokenizer:  # "" would read the current directory
            raise ConfigError('tokenizer: empty; set it to "byte" or to the Hugging Face '
                              "directory of the models' tokenizer (tokenizer.json)")
        tokenizer = load_tokenizer(spec.tokenizer)
    for role, reward in spec.rewards.items():
        with field(f"{role.value}.function"):  # reward or cost
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
    if w.steps:  # it trains the actor on the trained model's layout (`rl.begin`)
        home = plan.home(spec.graph, spec.algorithm.trained_role)
        if w.batch_size % home.dp_size:
            raise ConfigError(f"warm_start.batch_size={w.batch_size}: does not split "
                              f"{home.dp_size} ways over the trained model's layout {home}")
        # The warm start micro-batches its batches the same way.
        with field(f"micro_batches: warm start (warm_start.batch_size={w.batch_size})"):
            num_microbatches(spec.micro, w.batch_size, spec.rollout.seq_len, home.dp_size)
    data = load_data(spec, workdir, tokenizer)
    if spec.data.train_path and len(data.train) < spec.rollout.batch_size:
        raise ConfigError(f"rollout.batch_size={spec.rollout.batch_size}: more than the "
                          f"{len(data.train)} rows of {spec.data.train_path}")
    fingerprint = run_fingerprint(spec.config_json)
    with field("checkpoint"):  # another run's checkpoints are refused
        check_resume(workdir / CHECKPOINT_DIR, fingerprint, spec.checkpoint.resume)
    return Job(spec, tokenizer, plan, workdir, fingerprint, data)
