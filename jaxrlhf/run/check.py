"""A config checked end to end, once, before anything compiles: a `Job`.

`check_config(config, workdir)` builds the run spec (`jaxrlhf.spec.run_spec`), locks the workdir
for this run (`run/lock.py`), refuses keys the run does not read (`run/unread.py`), loads the
tokenizer (not the byte tokenizer beside a model that brought its own), checks the reward
functions, model directories and vocabularies, resolves the placement (`placement.kind=auto`
searches here, once; with `placement.compile_check` its next-best plans too, which compile only
after these checks: `calibration/compile_check.py`) and holds it to what the rollout engine and an
asynchronous run's processes can run, reads the run's data (a bad row of a user file is named by file:line), makes the warm
start a job of its own, refuses checkpoints in the workdir that another run wrote, or, forced,
that do not fit its models (`checkpoint.resume`), and points JAX's persistent compilation cache
at `compile.cache_dir` (what the process compiles from then on is kept there, and loaded from
there by the next run). The job then runs what was checked.
"""

from __future__ import annotations

import dataclasses
import pathlib
import tempfile

import jax
from ml_collections import ConfigDict

from jaxrlhf import backend
from jaxrlhf.algorithms import registry
from jaxrlhf.algorithms.routing import Routing
from jaxrlhf.algorithms.spec import BatchKind
from jaxrlhf.checkpoint import CHECKPOINT_DIR, ResumeMode, check_resume, shape_mismatches
from jaxrlhf.data.byte_hf import is_byte_tokenizer
from jaxrlhf.data.rewards import NEEDS_ANSWER, resolve_reward
from jaxrlhf.data.sources import Data, read_data, read_pairs
from jaxrlhf.data.tokenizer import TOKENIZER_FILE, Tokenizer, check_vocab, load_tokenizer
from jaxrlhf.dataflow.graph import build_graph
from jaxrlhf.engine.microbatch import num_microbatches
from jaxrlhf.fingerprint import run_fingerprint
from jaxrlhf.mfc import Call, Role
from jaxrlhf.models import hf_io
from jaxrlhf.run import lock, roles, unread
from jaxrlhf.run.layouts import RunPlan, place, place_candidates, single
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
    warm_start: Job | None = None  # its supervised warm start, a job of its own (`_warm_start`)
    # placement.compile_check: this job on the next-best searched plans, best first, checked
    # as this one is; `calibration/compile_check.py` runs the first that XLA says fits
    fallbacks: tuple[Job, ...] = ()

    @property
    def train_rows(self) -> list:
        """The rows the algorithm's steps are fed: prompts, SFT rows or preference pairs."""
        return {BatchKind.PROMPTS: self.data.train, BatchKind.SFT_ROWS: self.data.sft,
                BatchKind.PAIRS: self.data.pairs}[self.spec.algorithm.batches]


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
        lock.make(workdir)
        tempfile.NamedTemporaryFile(dir=workdir, prefix=".write-check-").close()
        if jax.process_index() == 0:  # one lock for a job (its processes share the workdir)
            lock.hold(workdir)
    unread.check(config, spec)
    with field("tokenizer"):
        if not spec.tokenizer:  # "" would read the current directory
            raise ConfigError('tokenizer: empty; set it to "byte" or to the Hugging Face '
                              "directory of the models' tokenizer (tokenizer.json)")
        tokenizer = load_tokenizer(spec.tokenizer)
    _check_tokenizer_follows(spec)
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
        if model.path:
            with field(f"models.{role.value}.path"):  # a truncated download: named now
                hf_io.check_weights(model.path)
    roles.starts(spec)  # every role has weights to start from
    with field("placement"):
        plans = place_candidates(spec) if spec.placement.compile_check else [place(spec)]
    plan, *others = plans
    _check_plan(spec, plan)
    _check_positions(spec)
    fingerprint = run_fingerprint(spec.config_json)
    job = Job(spec, tokenizer, plan, workdir, fingerprint, load_data(spec, workdir, tokenizer))
    job = dataclasses.replace(job, warm_start=_warm_start(job))
    job = dataclasses.replace(job, fallbacks=_fallbacks(job, others))
    _check_batches(job)
    _check_answers(job)
    if spec.checkpoint.resume is ResumeMode.FORCE:  # before "resuming regardless" is said
        _check_forced_resume(job)
    with field("checkpoint"):  # another run's checkpoints are refused
        check_resume(workdir / CHECKPOINT_DIR, fingerprint, spec.checkpoint.resume)
    try:  # last: a config refused leaves no directory behind
        backend.use_compilation_cache(spec.compile_cache_dir)
    except OSError as e:  # the default's too (a read-only home): say what to set
        raise ConfigError(f"compile.cache_dir: {e} (set a directory that takes files, or \"\" "
                          "for no cache)") from None
    return job


def _check_plan(spec: RunSpec, plan: RunPlan) -> None:
    """What the rollout engine and an asynchronous run's processes can run."""
    _check_rollout_layouts(spec, plan)
    _check_processes(spec, plan)


def _fallbacks(job: Job, plans: list[RunPlan]) -> tuple[Job, ...]:
    """placement.compile_check: `job` on each of the next-best searched `plans`, checked as its
    own plan is (`_check_plan`, its warm start's layout); a plan refused is left out."""
    checked = []
    for plan in plans:
        try:
            _check_plan(job.spec, plan)
            other = dataclasses.replace(job, plan=plan)
            checked.append(dataclasses.replace(other, warm_start=_warm_start(other)))
        except ConfigError:
            continue
    return tuple(checked)


def _check_rollout_layouts(spec: RunSpec, plan: RunPlan) -> None:
    """Asynchronous and multi-turn runs generate on the rollout engine, which decodes each row
    at its own position; a pipelined layout's stages decode every row at one slot (only the
    synchronous static batch runs there), so such a generation layout is refused now rather
    than when the engine is built, after the warm start (engine/rollout keeps its own guard).
    Asynchronous multi-turn generation takes one micro-batch (run/rollout_worker.py's guard).
    A pipelined generation layout records no expert routes, which routing replay reads (and
    measures its mismatch by), whichever engine generates."""
    generates = [m.name for m in spec.graph.mfcs if m.call is Call.GENERATE]
    for name in generates:
        if spec.routing is not Routing.NONE and plan.layouts[name].pipeline > 1:
            raise ConfigError(
                f"placement: {name} runs on {plan.plan[name]}, a pipelined layout, which records "
                f"no expert routes, but routing {spec.routing.value} "
                "(models.actor.moe.replay_routing) reads them: give "
                f"{name} a layout without pipeline stages")
    user = ("async_rl.max_staleness" if spec.async_rl.max_staleness
            else "env.name" if spec.env is not None else None)
    if user is None:
        return
    for name in generates:
        if plan.layouts[name].pipeline > 1:
            raise ConfigError(
                f"placement: {name} runs on {plan.plan[name]}, a pipelined layout, but with "
                f"{user} set it generates on the rollout engine, which decodes each row at its "
                f"own position (pipeline stages decode all rows at one): give {name} a layout "
                "without pipeline stages")
        micro = plan.micro_batches(name)
        if spec.env is not None and spec.async_rl.max_staleness and micro != 1:
            raise ConfigError(
                f"placement: {name} runs on {plan.plan[name]}, {micro} micro-batches, but "
                "asynchronous multi-turn rollouts take one micro-batch of generation (give "
                f"{name} @1)")


def _check_processes(spec: RunSpec, plan: RunPlan) -> None:
    """An asynchronous run across processes has the trainer's process and one per generation
    replica, the generate call on process 1's devices and every other call on process 0's
    (`run/async_procs.replica_layouts`, which the loop reaches only after the warm start)."""
    replicas, processes = spec.placement.gen_replicas, jax.process_count()
    if not spec.async_rl.max_staleness or (processes == 1 and replicas == 1):
        return
    if processes != 1 + replicas:
        raise ConfigError(f"placement.gen_replicas={replicas}: an asynchronous run with "
                          f"generation replicas runs 1 + {replicas} processes, the trainer's and "
                          f"one per replica (launch/local.sh {1 + replicas} ...); this job has "
                          f"{processes}")
    if spec.env is not None:  # the loop (run/async_procs.rl_loop) refuses it too, later
        raise ConfigError(f"env.name={spec.env.spec!r}: multi-turn asynchronous RL runs in one "
                          "process (generation beside training, or disaggregated)")
    (gen,) = [m.name for m in spec.graph.mfcs if m.role is Role.ACTOR and m.call is Call.GENERATE]
    for name, layout in plan.layouts.items():
        want = 1 if name == gen else 0
        if {d.process_index for d in layout.devices} != {want} or (
                name == gen and len(layout.devices) != jax.local_device_count()):
            raise ConfigError(f"placement: {name} runs on {plan.plan[name]}; in a multi-process "
                              f"asynchronous run it must use exactly process {want}'s devices "
                              "(placement.kind=disaggregate places them so)")


def _check_tokenizer_follows(spec: RunSpec) -> None:
    """The byte tokenizer (the default) never drives a model that brought its own: byte ids
    0-271 fed to a model of a 128k vocabulary train silently wrong (loss about ln 128k). The
    run refuses rather than switch tokenizers by itself: one tokenizer serves every role,
    roles' directories may hold different ones, and the config (its fingerprint, and export's
    copy of the tokenizer) should name the one the run uses."""
    if spec.tokenizer != "byte":
        return
    for role, model in {Role.ACTOR: spec.base, **spec.models}.items():
        if (model.path and (pathlib.Path(model.path) / TOKENIZER_FILE).is_file()
                and not is_byte_tokenizer(model.path)):  # an export of a byte-tokenizer run
            raise ConfigError(
                f"tokenizer='byte': models.{role.value}.path={model.path!r} has a tokenizer of "
                f"its own ({TOKENIZER_FILE}); set tokenizer={model.path!r} to train with it "
                "(the byte tokenizer's ids would mean other tokens to this model)")


def _check_forced_resume(job: Job) -> None:
    """A forced resume of checkpoints whose parameters have other shapes (a LoRA rank changed,
    LoRA turned on over full weights) is refused: restoring would fail as on a damaged
    checkpoint, and the fallback would move that run's intact checkpoints aside."""
    directory = job.workdir / CHECKPOINT_DIR
    if mismatches := shape_mismatches(directory, job.spec.model_configs()):
        more = f" (and {len(mismatches) - 1} more)" if len(mismatches) > 1 else ""
        raise ConfigError(
            f"checkpoint.resume=force: the checkpoints in {directory} do not fit this run's "
            f"models ({mismatches[0]}{more}); use another --workdir, or "
            "checkpoint.resume=never to start afresh (they are moved aside)")


def _check_positions(spec: RunSpec) -> None:
    """A step's sequences (prompt and new tokens) fit every model's positions: past them RoPE
    extrapolates silently, and a very long response would ask for a KV cache of terabytes."""
    r = spec.rollout
    for role, model in {Role.ACTOR: spec.base, **spec.models}.items():
        limit = model.config.max_position_embeddings
        if r.seq_len > limit:
            raise ConfigError(
                f"rollout.max_new_tokens={r.max_new_tokens}: with rollout.max_prompt_len="
                f"{r.max_prompt_len} a sequence has {r.seq_len} tokens, more than the "
                f"{limit} positions of models.{role.value} (max_position_embeddings)")


def _check_answers(job: Job) -> None:
    """Every prompt row has a reference answer when a reward function scores against it."""
    for role, reward in job.spec.rewards.items():
        if reward.function not in NEEDS_ANSWER:
            continue
        for rows, path, what in ((job.data.train, job.spec.data.train_path, "data.train_path"),
                                 (job.data.eval, job.spec.data.eval_path, "data.eval_path")):
            missing = [i for i, row in enumerate(rows) if getattr(row, "answer", "") is None]
            if missing:
                raise ConfigError(
                    f"{what}: {len(missing)} of {len(rows)} prompt rows of "
                    f"{path or 'the built-in task'} have no answer (row {missing[0]} first), "
                    f"which {role.value}.function={reward.function!r} scores against")


def _warm_start(job: Job) -> Job | None:
    """The warm start as a job of its own (None without one): `warm_start.sft_steps` steps of
    SFT of the actor alone, with the warm start's optimizer and batch size, on the trained
    model's home (reward modelling then starts its reward model from the actor's trunk)."""
    spec, w, algorithm = job.spec, job.spec.warm_start, registry.warm_start()
    if not w.steps:
        return None
    home = job.plan.home(spec.graph, spec.algorithm.trained_role)
    if w.batch_size % home.dp_size:
        raise ConfigError(f"warm_start.batch_size={w.batch_size}: does not split "
                          f"{home.dp_size} ways over the trained model's layout {home}")
    with field(f"micro_batches: warm start (warm_start.batch_size={w.batch_size})"):
        micro = num_microbatches(spec.micro, w.batch_size, spec.rollout.seq_len, home.dp_size)
    sft_spec = dataclasses.replace(
        spec, algorithm=algorithm, graph=build_graph(algorithm.mfcs), steps=w.steps,
        models={Role.ACTOR: spec.base}, rewards={}, optimizers={Role.ACTOR: w.optimizer},
        oversample=1,
        rollout=dataclasses.replace(spec.rollout, batch_size=w.batch_size, group_size=1))
    return dataclasses.replace(job, spec=sft_spec, plan=single(algorithm.mfcs[0].name, home, micro))


def _check_batches(job: Job) -> None:
    """The rows fill one batch of the run's steps, and of its warm start's (`Job.warm_start`)."""
    _check_rows(job, "rollout.batch_size", "rows")
    w = job.spec.warm_start
    if w.steps and not job.data.sft:  # user data without SFT rows: nothing to warm-start on
        source = "data.sft_path" if job.spec.data.train_path else "data.task.num_sft > 0"
        raise ConfigError(f"warm_start.sft_steps={w.steps}: there are no SFT rows (set "
                          f"{source}, or warm_start.sft_steps=0)")
    if job.warm_start is not None:
        _check_rows(job.warm_start, "warm_start.batch_size", "SFT rows")


def _check_rows(job: Job, key: str, rows: str) -> None:
    """`job.train_rows` fill one of its batches; else a ConfigError naming `key`, its batch size."""
    data, batch = job.spec.data, job.spec.rollout.batch_size
    source = {BatchKind.PROMPTS: data.train_path, BatchKind.SFT_ROWS: data.sft_path,
              BatchKind.PAIRS: data.preference_path}[job.spec.algorithm.batches]
    if len(job.train_rows) < batch:
        raise ConfigError(f"{key}={batch}: more than the {len(job.train_rows)} {rows} of "
                          f"{source or 'the built-in task'}")
