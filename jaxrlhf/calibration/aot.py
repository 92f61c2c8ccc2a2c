"""`python -m jaxrlhf.plan --compile`: every call of a plan compiled for the cluster's own
devices from this host, beside what the planner's models say of it.

XLA compiles for devices it has only a description of: libtpu describes a TPU slice by its
topology name (`Cluster.topology`, `jax.experimental.topologies.get_topology_desc`), so a CPU
host compiles what a v5p-128 slice would run. Nothing runs and no weights exist:
  * each call's parameters (a trained model's whole train state) are abstract values of the
    model's `size`, placed on the call's layout over the described devices;
  * each call's batch is the step's worst case, built on the host: every prompt and response
    at full length (`step_buffer`), a train step's batch made from it by the algorithm's own
    `prepare`;
  * each call kind lowers what it would compile for that batch (`lower_for`, module
    `engine.call`): a train step and an inference call one program each; a generate call the
    rollout engine's programs (its fill, a decode chunk at the largest cache, the first
    compaction; or its one program where the call runs at once) or a pipeline's static batch.

Per call (`CallReport`): XLA's peak bytes per device, arguments + outputs + temporaries -
aliased bytes of the program (for generate, the largest of its programs); the memory model's
(`plan.memory.own_memory`, plus the batch arguments, which the model leaves out); whether it
fits the device's limit; XLA's FLOPs (`cost_analysis`, which counts a loop's body once: the
scanned layer stack, a decode loop) beside the cost model's; the attention kernels the
compiled programs call; and the compile seconds.
"""

from __future__ import annotations

import dataclasses
import math
import tempfile
import time
import types
from collections.abc import Callable, Collection, Mapping, Sequence

import flax.linen as nn
import jax
import numpy as np

from jaxrlhf.algorithms import routing
from jaxrlhf.checkpoint import abstract_state
from jaxrlhf.calibration import hlo_counts, peaks, validate
from jaxrlhf.dataflow.executors import padded_batch
from jaxrlhf.engine import replay
from jaxrlhf.engine.inference import InferenceBatch
from jaxrlhf.mfc import MFC, Call, Role
from jaxrlhf.models.config import HeadKind
from jaxrlhf.models.sizes import abstract_params
from jaxrlhf.parallel.reshard import CHUNK_BYTES, chunks, collective_hops
from jaxrlhf.parallel.layout import Layout
from jaxrlhf.plan import cost as cost_lib
from jaxrlhf.plan import memory as memory_lib
from jaxrlhf.plan import moves as moves_lib
from jaxrlhf.plan.choice import ExecutionPlan
from jaxrlhf.plan.cluster import Cluster
from jaxrlhf.plan.experiment import Experiment
from jaxrlhf.run import build
from jaxrlhf.run.layouts import run_plan
from jaxrlhf.spec import RunSpec

# Custom calls that are attention kernels, by the compiler that runs them, as their targets
# begin: cuDNN's name the fused pattern ("__cudnn$fmhaScaleBiasSoftmax", "...Backward").
_KERNEL_CALLS = {"tpu_custom_call": "Mosaic", "__gpu$xla.gpu.triton": "Triton",
                 "__cudnn$fmha": "cuDNN"}

@dataclasses.dataclass(frozen=True)
class Program:
    """One compiled program of a call.

    Attributes:
      name: "train step", "inference", "fill", "decode chunk", "compaction", ...
      peak_bytes: arguments + outputs + temporaries - aliased, per device, plus
        `resident_bytes`.
      batch_bytes: the arguments after the first (the batch, keys, scalars), per device.
      flops: matmul FLOPs per device of the compiled program, loops times their trip
        counts (`hlo_counts`; XLA's `cost_analysis` counts a loop's body once).
      kernels: the attention kernels it calls ("Mosaic", "Triton", "cuDNN"), sorted.
      seconds: lowering + compiling here.
      unbounded_loops: loops bounded by a runtime value, counted once in `flops`.
      model_flops: the cost model's FLOPs of the same work (`model_flops`).
      argument_bytes, temporary_bytes: XLA's arguments and temporaries per device (parts of
        `peak_bytes`).
      live: what XLA holds at the program's peak, by source (`peaks.read_peak`; compiled with
        `explain`), or None.
      resident_bytes: what the call keeps on the device beside a program that does not take
        it as an argument: the parameters, beside the rollout engine's compaction, which
        takes the slots' state alone (`resident_bytes`).
    """

    name: str
    peak_bytes: int
    batch_bytes: int
    flops: float
    kernels: tuple[str, ...]
    seconds: float
    unbounded_loops: int = 0
    model_flops: float = 0.0
    argument_bytes: int = 0
    temporary_bytes: int = 0
    live: peaks.Peak | None = None
    resident_bytes: int = 0


@dataclasses.dataclass(frozen=True)
class CallReport:
    """One MFC compiled for the cluster (or the one-line reason it did not compile).

    Attributes:
      name, spec: the MFC and its layout.
      programs: what it compiled.
      model_bytes: the memory model's peak per device (`own_memory`'s total, plus the
        batch arguments of the program XLA puts highest).
      limit_bytes: what a program may use per device.
      error: XLA's message, one line, where compiling failed.
    """

    name: str
    spec: str
    programs: tuple[Program, ...] = ()
    model_bytes: int = 0
    limit_bytes: int = 0
    error: str = ""

    @property
    def compiled(self) -> bool:
        return not self.error

    @property
    def peak(self) -> Program | None:
        return max(self.programs, key=lambda p: p.peak_bytes, default=None)

    @property
    def xla_bytes(self) -> int:
        return self.peak.peak_bytes if self.programs else 0

    @property
    def fits(self) -> bool:
        return self.compiled and self.xla_bytes <= self.limit_bytes

    @property
    def xla_flops(self) -> float:
        return sum(p.flops for p in self.programs)

    @property
    def model_flops(self) -> float:
        """The cost model's FLOPs of the same programs."""
        return sum(p.model_flops for p in self.programs)

    @property
    def seconds(self) -> float:
        return sum(p.seconds for p in self.programs)

    @property
    def kernels(self) -> tuple[str, ...]:
        return tuple(sorted({k for p in self.programs for k in p.kernels}))

    @property
    def memory_error(self) -> float:
        """model / XLA - 1."""
        return self.model_bytes / max(self.xla_bytes, 1) - 1


def _kernels(text: str) -> tuple[str, ...]:
    """The attention kernels an HLO module's custom calls name."""
    return tuple(sorted({name for target, name in _KERNEL_CALLS.items()
                         if f'custom_call_target="{target}' in text}))


def compile_program(name: str, lower: Callable[[], jax.stages.Lowered],
                    explain: bool = False) -> Program:
    """Lowers and compiles one program; its figures (`explain`: with what XLA holds at its
    peak, read from the live ranges XLA dumps into a temporary directory)."""
    start = time.perf_counter()
    live = None
    if explain:
        with tempfile.TemporaryDirectory() as dump:
            compiled = lower().compile(compiler_options=peaks.compile_options(dump))
            live = peaks.read_peak(dump)
    else:
        compiled = lower().compile()
    seconds = time.perf_counter() - start
    m = compiled.memory_analysis()
    peak = (m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes
            - m.alias_size_in_bytes)
    text = compiled.as_text()
    flops = hlo_counts.program_flops(text)
    return Program(name, int(peak), validate.batch_argument_bytes(compiled), flops.flops,
                   _kernels(text), seconds, flops.unbounded_loops,
                   argument_bytes=m.argument_size_in_bytes,
                   temporary_bytes=m.temp_size_in_bytes, live=live)


# --- the step's worst-case batch --------------------------------------------------------


def stand_in_tokenizer(vocab_size: int):
    """The token ids a compile needs (pad, stop): programs depend on how many stop ids there
    are, never on their values, so any in the vocabulary stand in for the run's tokenizer."""
    return types.SimpleNamespace(pad_id=0, stop_ids=(vocab_size - 1,))


def step_buffer(spec: RunSpec) -> dict[str, np.ndarray]:
    """The step buffer of an RL step at its largest (host arrays): every prompt P tokens (each
    prompt distinct, the same over its group), every response N tokens, each model call's
    output of its shape (`dataflow.executors`: generate writes sequences, sequence mask,
    response mask and log-probs; inference per response token, or per row for scores and
    host rewards)."""
    rows, p, n = spec.step_rows, spec.rollout.max_prompt_len, spec.rollout.max_new_tokens
    # Each prompt its own tokens, repeated over its group (GRPO's n responses): the rollout
    # engine prefills each distinct prompt once.
    prompts_bp = np.ones((rows, p), np.int32)
    prompts_bp[:, 0] = 1 + np.arange(rows) // spec.rollout.group_size
    buf: dict[str, np.ndarray] = {}
    for mfc in spec.algorithm.mfcs:
        if mfc.call is Call.GENERATE:
            tokens, mask = mfc.inputs[:2]
            buf.setdefault(tokens, prompts_bp)
            buf.setdefault(mask, np.ones((rows, p), bool))
            arrays = (np.ones((rows, p + n), np.int32), np.ones((rows, p + n), bool),
                      np.ones((rows, n), bool), np.zeros((rows, n), np.float32))
            outputs = [k for k in mfc.outputs if not routing.is_routes_key(k)]
            buf.update(zip(outputs, arrays, strict=True))
            # Routing replay: the experts the rollout recorded, [rows, s, L, k].
            config = spec.models[mfc.role].config
            for key in mfc.outputs[len(outputs):]:
                buf[key] = np.zeros((rows, p + n, config.num_layers, config.moe.top_k),
                                    replay.route_dtype(config.moe.num_experts))
        elif mfc.call is Call.INFERENCE:
            # a reward (or cost) model's score, or a host function's, per row (`engine_call`)
            per_row = mfc.host or (spec.models[mfc.role].config.head is not HeadKind.LM
                                   and mfc.role not in (Role.CRITIC, Role.COST_CRITIC))
            (out,) = mfc.outputs
            buf[out] = np.zeros((rows,) if per_row else (rows, n), np.float32)
    return buf


def train_batch(spec: RunSpec, mfc: MFC, buf: Mapping[str, np.ndarray]) -> dict:
    """One optimizer update's batch of a train step (host arrays): the algorithm's `prepare`
    of the buffer, cut to one mini-batch."""
    train = spec.algorithm.train[mfc.role]
    scalars = {k: np.float32(v) for k, v in spec.algorithm.controller_init.items()}
    with jax.default_device(jax.local_devices(backend="cpu")[0]):
        batch, _ = jax.jit(train.prepare)({k: buf[k] for k in mfc.inputs if k in buf}, scalars)
    rows = spec.step_rows // train.mini_batches
    return {k: np.asarray(v)[:rows] for k, v in batch.items()}


# --- compiling a plan -------------------------------------------------------------------


def _abstract_params(model_config, layout: Layout):
    """A model's parameters as abstract values on `layout`."""
    boxed = abstract_params(model_config)
    return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                        nn.meta.unbox(boxed), layout.param_shardings(boxed))


# The rollout engine's programs that take the slots' state but not the parameters, which stay
# on the devices while they run.
_WITHOUT_PARAMETERS = frozenset({"compaction"})


def resident_bytes(program: str, params) -> int:
    """Bytes per device the call keeps beside `program` without passing them to it: the
    parameters `params` (abstract, sharded) beside a program of `_WITHOUT_PARAMETERS`, else 0.
    XLA's own peak for such a program leaves them out, though the device holds both."""
    if program not in _WITHOUT_PARAMETERS:
        return 0
    return sum(math.prod(a.sharding.shard_shape(a.shape)) * a.dtype.itemsize
               for a in jax.tree.leaves(params))


def _programs(spec: RunSpec, mfc: MFC, engine, layout: Layout, micro_batches: int,
              buf: Mapping[str, np.ndarray]) -> dict[str, Callable[[], jax.stages.Lowered]]:
    """Each program of `mfc` by name, as a thunk that lowers it (a generate call's are lowered
    here, together: their compile seconds leave the lowering out)."""
    model = spec.models[mfc.role].config
    match mfc.call:
        case Call.TRAIN_STEP:
            state = abstract_state(model, layout, spec.optimizers[mfc.role])
            batch = train_batch(spec, mfc, buf)
            return {"train step": lambda: engine.lower_for(state, batch)}
        case Call.INFERENCE:  # the executor calls it once per micro-batch of the rows
            params = _abstract_params(model, layout)
            rows = len(buf[mfc.inputs[0]]) // micro_batches
            tokens, mask = (buf[k][:rows] for k in mfc.inputs[:2])
            with jax.default_device(jax.local_devices(backend="cpu")[0]):
                batch = InferenceBatch(*map(np.asarray, padded_batch(tokens, mask)))
            return {"inference": lambda: engine.lower_for(params, batch)}
        case Call.GENERATE:  # lowered together here (the rollout engine's programs)
            params = _abstract_params(model, layout)
            # The engine takes all rows in one call (they queue for rows / M slots); a
            # pipeline's static batch is called once per micro-batch (`generate_executor`).
            rows = len(buf[mfc.inputs[0]]) // (1 if engine.on_engine else micro_batches)
            tokens, mask = (buf[k][:rows] for k in mfc.inputs[:2])
            with jax.default_device(jax.local_devices(backend="cpu")[0]):
                key = jax.random.key(0)
            lowered = engine.lower_for(params, tokens, mask, key,
                                       micro_batches if engine.on_engine else 1)
            return {name: (lambda x=x: x) for name, x in lowered.items()}
    raise ValueError(f"unknown call kind {mfc.call}")


def model_flops(experiment: Experiment, mfc: MFC, choice, cluster: Cluster,
                program: Program) -> float:
    """The cost model's FLOPs per device of one program of an MFC (its compute seconds at
    peak), counted as XLA's are (`hlo_counts`): a train step's program is one update; an
    inference program, and a pipeline's static generate, one executor call (one micro-batch
    of M; a pipeline streams it through its stages); a decode loop
    that stops when its rows are done runs an unknown number of steps, so the engine's decode
    programs count one step (and "decode at once", and a pipeline's static generate whose
    loop is so bounded, their prefill and one step). Where attention
    runs in a kernel (a custom call, which XLA does not count), the model's attention FLOPs
    are left out too: every compute term of the cost model is forward passes of
    `ModelProfile.forward_flops_per_token` at the workload's context, so they are its
    attention share."""
    p, work = experiment.profile(mfc.role), experiment.workload
    flops_per_token = p.forward_flops_per_token(work.seq_len)
    share = 2.0 * p.matmul_params / flops_per_token if program.kernels else 1.0
    calls = choice.micro_batches  # the executor's calls of an inference or static generate
    match program.name:
        case "train step":
            cost = cost_lib.train_cost(p, work, choice, cluster, experiment.master(mfc.role))
            cost = cost.times(1 / work.updates)
        case "inference":
            cost = cost_lib.inference_cost(p, work, choice, cluster).times(1 / calls)
        case "generate":  # a pipeline's static batch: one executor call; a token loop that
            # stops when its rows are done XLA counts once, so its prefill and one token
            tokens = 1 if program.unbounded_loops else None
            cost = cost_lib.generate_cost(p, work, choice, cluster, experiment.decode, tokens)
            cost = cost.times(1 / calls)
        case "fill":
            cost = cost_lib.prefill_cost(p, work, choice, cluster)
        case "decode chunk":
            cost = cost_lib.decode_step_cost(p, work, choice, cluster)
        case "decode at once":
            cost = (cost_lib.prefill_cost(p, work, choice, cluster)
                    + cost_lib.decode_step_cost(p, work, choice, cluster))
        case _:  # compaction: no matmul
            return 0.0
    return cost.compute * cluster.peak_bf16_flops * share


def compile_plan(spec: RunSpec, cluster: Cluster, plan: ExecutionPlan,
                 devices: Sequence[jax.Device], limit_bytes: int,
                 log: Callable[[str], None] = lambda line: None,
                 known: dict | None = None, calls: Collection[str] | None = None,
                 explain: bool = False) -> list[CallReport]:
    """Every model MFC of `plan` (or those named in `calls`) compiled for `devices` (the
    cluster's), in graph order; a call that fails to compile is reported with XLA's message
    and the others still compile. `known`: reports by (MFC, choice) of plans compiled before,
    reused (and added to). `explain`: each program with what XLA holds at its peak."""
    known = {} if known is None else known
    experiment = spec.experiment()
    layouts = run_plan(spec, plan, devices).layouts
    tokenizer = stand_in_tokenizer(spec.base.config.vocab_size)
    buf = step_buffer(spec)
    reports = []
    for name, layout in layouts.items():
        if calls is not None and name not in calls:
            continue
        mfc, choice = spec.graph.mfc(name), plan[name]
        if (name, choice) in known:
            reports.append(known[name, choice])
            log(f"{name} ({choice}): as compiled for a plan before")
            continue
        model = spec.models[mfc.role].config
        estimate = memory_lib.own_memory(experiment, mfc, choice, cluster.platform)
        log(f"compiling {name} ({choice}) for {cluster.topology or cluster.name}")
        try:
            engine = build.engine_call(mfc, model, layout,
                                       build.train_micro(spec, choice.micro_batches), spec.rollout,
                                       tokenizer, spec.algorithm, spec.optimizers.get(mfc.role))
            compiled = [compile_program(program, lower, explain) for program, lower in _programs(
                spec, mfc, engine, layout, choice.micro_batches, buf).items()]
            params = _abstract_params(model, layout)
            resident = [resident_bytes(c.name, params) for c in compiled]
            programs = tuple(dataclasses.replace(
                c, model_flops=model_flops(experiment, mfc, choice, cluster, c),
                peak_bytes=c.peak_bytes + r, resident_bytes=r) for c, r in zip(compiled, resident))
        except Exception as e:  # XLA's own refusal (or a lowering error): one line, go on
            message = " ".join(str(e).split())[:400]
            reports.append(CallReport(name, str(choice), limit_bytes=limit_bytes,
                                      model_bytes=estimate.total,
                                      error=f"{type(e).__name__}: {message}"))
            log(f"  {name}: did not compile: {reports[-1].error}")
            known[name, choice] = reports[-1]
            continue
        peak = max(programs, key=lambda p: p.peak_bytes)
        reports.append(CallReport(name, str(choice), programs,
                                  estimate.total + peak.batch_bytes, limit_bytes))
        known[name, choice] = reports[-1]
        log(f"  {name}: {', '.join(f'{p.name} {p.seconds:.1f} s' for p in programs)}")
    return reports


def first_that_fits(spec: RunSpec, cluster: Cluster,
                    plans: Sequence[tuple[str, ExecutionPlan]], devices: Sequence[jax.Device],
                    limit_bytes: int, log: Callable[[str], None] = lambda line: None,
                    explain: bool = False) -> tuple[int, list[CallReport]]:
    """Compiles `plans` ((heading, plan), best first) in turn until every call of one fits by
    XLA's account, logging each plan's heading and `table` (and `explanation`); a call shared
    with a plan compiled before is not compiled again. Returns the index of the first plan that
    fits (else 0, the best by the models) and its reports."""
    known, tried = {}, []
    for heading, plan in plans:
        log(f"\n{heading}")
        reports = compile_plan(spec, cluster, plan, devices, limit_bytes, log, known,
                               explain=explain)
        log(table(reports))
        if explain:
            log(explanation(reports))
        if all(r.fits for r in reports):
            return len(tried), reports
        tried.append(reports)
    return 0, tried[0]


# --- reports ----------------------------------------------------------------------------

_GIB = 1 << 30


def table(reports: Sequence[CallReport]) -> str:
    """One row per call: XLA's peak beside the model's, the limit, FLOPs, kernels, seconds."""
    rows = [("MFC", "layout", "XLA GiB", "model GiB", "model/XLA", "limit GiB", "fits",
             "XLA TFLOP", "model TFLOP", "attention", "programs", "compile s")]
    for r in reports:
        if not r.compiled:
            rows.append((r.name, r.spec, "-", f"{r.model_bytes / _GIB:.2f}", "-",
                         f"{r.limit_bytes / _GIB:.2f}", "no", "-", "-",
                         "-", "did not compile", "-"))
            continue
        rows.append((r.name, r.spec, f"{r.xla_bytes / _GIB:.2f}", f"{r.model_bytes / _GIB:.2f}",
                     f"{r.memory_error:+.1%}", f"{r.limit_bytes / _GIB:.2f}",
                     "yes" if r.fits else "NO", f"{r.xla_flops / 1e12:.3g}",
                     f"{r.model_flops / 1e12:.3g}", "+".join(r.kernels) or "XLA",
                     ", ".join(p.name for p in r.programs), f"{r.seconds:.1f}"))
    errors = [f"{r.name}: {r.error}" for r in reports if not r.compiled]
    return "\n".join([validate.text_table(rows), *errors])


_PEAK_SOURCES = 12  # the largest sources of a peak the JSON lists


def explanation(reports: Sequence[CallReport]) -> str:
    """Per compiled call, what XLA holds at the peak of its largest program (`explain`)."""
    lines = [f"{r.name} ({r.peak.name}): {r.peak.live.describe()}; temporaries "
             f"{r.peak.temporary_bytes / _GIB:.2f} GiB by memory_analysis" for r in reports
             if r.compiled and r.peak.live is not None]
    return "\n".join(lines)


def to_json(reports: Sequence[CallReport]) -> dict:
    """{NAME: {compiled, xla_bytes, model_bytes, limit_bytes, xla_flops, model_flops, seconds,
    kernels, programs, error}} of a compiled plan."""
    return {r.name: {
        "compiled": r.compiled, "fits": r.fits, "layout": r.spec, "xla_bytes": r.xla_bytes,
        "model_bytes": r.model_bytes, "limit_bytes": r.limit_bytes, "xla_flops": r.xla_flops,
        "model_flops": r.model_flops, "seconds": round(r.seconds, 2), "kernels": list(r.kernels),
        "programs": {p.name: {"xla_bytes": p.peak_bytes, "batch_bytes": p.batch_bytes,
                              "xla_flops": p.flops, "model_flops": p.model_flops,
                              "unbounded_loops": p.unbounded_loops,
                              "argument_bytes": p.argument_bytes,
                              "temporary_bytes": p.temporary_bytes,
                              "seconds": round(p.seconds, 2),
                              **({"peak_live_bytes": p.live.live_bytes,
                                  "peak_heap_bytes": p.live.heap_bytes,
                                  "peak_sources": dict(p.live.sources[:_PEAK_SOURCES])}
                                 if p.live else {})}
                     for p in r.programs},
        "error": r.error} for r in reports}


# --- reallocations ----------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ReallocReport:
    """A model's parameters moved from its home layout to another call's, compiled.

    Attributes:
      role, src, dst: the model and the two layouts.
      programs: the collective hops compiled (identity programs; copy hops have none).
      xla_bytes: the bytes their collectives bring from other devices, summed over the devices
        (`hlo_counts.collective_bytes`: comparable to `planned_bytes`).
      planned_bytes: what the planner counts as crossing a link (`cost.realloc_cost`).
      seconds: compiling here.
      error: XLA's message where a hop did not compile.
      xla_peak_bytes: per device, the largest hop's arguments + outputs over its chunks (both
        layouts of the leaves it moves) + the largest chunk program's temporaries - aliased
        (`reshard` runs a hop chunk by chunk, `CHUNK_BYTES`, each chunk one program).
      model_peak_bytes: the memory model's (`moves.move_memory(...).program`).
    """

    role: str
    src: str
    dst: str
    programs: int
    xla_bytes: int
    planned_bytes: int
    seconds: float
    error: str = ""
    xla_peak_bytes: int = 0
    model_peak_bytes: int = 0

    @property
    def memory_error(self) -> float:
        """model / XLA - 1 of the move's peak."""
        return self.model_peak_bytes / max(self.xla_peak_bytes, 1) - 1


def _moves(spec: RunSpec, plan: ExecutionPlan) -> list[tuple[Role, str, str]]:
    """(role, home MFC, other MFC) for every call of a model on another parameter layout than
    its home's (the runtime reshards the home parameters to it)."""
    experiment = spec.experiment()
    moves = []
    for role in spec.models:
        home = experiment.home_mfc(role)
        if home not in plan:
            continue
        for mfc in spec.graph.calls_of(role):
            if (mfc.name in plan and not mfc.host
                    and plan[mfc.name].param_layout != plan[home].param_layout):
                moves.append((role, home, mfc.name))
    return moves


def compile_reallocations(spec: RunSpec, cluster: Cluster, plan: ExecutionPlan,
                          devices: Sequence[jax.Device],
                          log: Callable[[str], None] = lambda line: None
                          ) -> list[ReallocReport]:
    """Every parameter movement between two layouts of `plan`: the collective hops of
    `parallel.reshard` compiled for `devices` (all of a move's parameters in one program per
    hop), their collective bytes beside the planner's."""
    experiment = spec.experiment()
    layouts = run_plan(spec, plan, devices).layouts
    reports = []
    for role, home, other in _moves(spec, plan):
        boxed = abstract_params(spec.models[role].config)
        shapes = jax.tree.leaves(nn.meta.unbox(boxed))
        pairs = zip(jax.tree.leaves(layouts[home].param_shardings(boxed)),
                    jax.tree.leaves(layouts[other].param_shardings(boxed)))
        by_hop: dict[int, list] = {}
        for leaf, (src, dst) in zip(shapes, pairs):
            for i, (at, to) in enumerate(collective_hops(src, dst, leaf.shape)):
                by_hop.setdefault(i, []).append((leaf, at, to))
        profile = experiment.profile(role)
        planned = cost_lib.realloc_cost(profile, plan[home], plan[other], cluster).bytes_moved
        model_peak = moves_lib.move_memory(profile, plan[home], plan[other]).program
        start, total, peak, error = time.perf_counter(), 0, 0, ""
        try:
            for hop in by_hop.values():
                moved, hop_peak = _compile_hop(hop)
                total += moved
                peak = max(peak, hop_peak)
        except Exception as e:  # XLA's refusal: one line
            error = f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"
        reports.append(ReallocReport(role.value, str(plan[home]), str(plan[other]), len(by_hop),
                                     total, planned, time.perf_counter() - start, error,
                                     peak, model_peak))
        log(f"  {role.value}: {plan[home]} -> {plan[other]}: {len(by_hop)} collective hops, "
            f"{total / 2**30:.2f} GiB by XLA, {planned / 2**30:.2f} GiB planned")
    return reports


def _compile_hop(hop: Sequence[tuple]) -> tuple[int, int]:
    """One collective hop of a move ((leaf, from, to) of each leaf it moves), compiled chunk by
    chunk as `reshard` runs it: (collective bytes over all devices, peak bytes per device:
    every chunk's arguments and outputs, which stay, plus the largest chunk's temporaries)."""
    groups = chunks([leaf.size * leaf.dtype.itemsize for leaf, *_ in hop], CHUNK_BYTES)
    total = held = temporaries = 0
    for group in groups:
        args = [jax.ShapeDtypeStruct(hop[i][0].shape, hop[i][0].dtype, sharding=hop[i][1])
                for i in group]
        compiled = jax.jit(lambda *xs: xs, out_shardings=tuple(hop[i][2] for i in group)
                           ).lower(*args).compile()
        total += hlo_counts.collective_bytes(compiled.as_text()) * len(hop[0][1].device_set)
        m = compiled.memory_analysis()
        held += m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes
        temporaries = max(temporaries, m.temp_size_in_bytes)
    return total, held + temporaries


def realloc_table(reports: Sequence[ReallocReport]) -> str:
    """One row per parameter movement: its collective bytes beside the planner's, and its peak
    bytes per device by XLA beside the memory model's."""
    rows = [("model", "from", "to", "hops", "XLA GiB", "planned GiB", "peak XLA GiB",
             "peak model GiB", "model/XLA", "compile s")]
    for r in reports:
        compiled = not r.error
        peak = compiled and r.programs  # copy hops run no program: XLA holds nothing of them
        rows.append((r.role, r.src, r.dst, str(r.programs),
                     f"{r.xla_bytes / _GIB:.2f}" if compiled else "did not compile",
                     f"{r.planned_bytes / _GIB:.2f}",
                     f"{r.xla_peak_bytes / _GIB:.2f}" if peak else "-",
                     f"{r.model_peak_bytes / _GIB:.2f}",
                     f"{r.memory_error:+.1%}" if peak else "-", f"{r.seconds:.1f}"))
    return "\n".join([validate.text_table(rows), *(f"{r.role} {r.src} -> {r.dst}: {r.error}"
                                                   for r in reports if r.error)])
