"""Building a run from its job: data, engine calls, model states and runtimes, reward pools,
the runner. The only place these are written out (train, bench, calibration and tests use it).
"""

from __future__ import annotations

import contextlib
import dataclasses
import pathlib

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxrlhf.algorithms.routing import Routing
from jaxrlhf.algorithms.spec import Algorithm
from jaxrlhf.checkpoint import Checkpointer, HostState, abstract_state
from jaxrlhf.data.datasets import EpochIterator
from jaxrlhf.data.environments import EnvPool
from jaxrlhf.data.rewards import RewardPool
from jaxrlhf.dataflow.executors import HostFunction
from jaxrlhf.dataflow.runtime import ModelRuntime, readers_per_layout
from jaxrlhf.dataflow.trajectories import TrajectoryLimits
from jaxrlhf.engine.buckets import response_widths
from jaxrlhf.engine.generate import make_generate_fn
from jaxrlhf.engine.inference import InferenceConfig, InferenceKind, make_inference_fn
from jaxrlhf.engine.microbatch import MicrobatchConfig, MicrobatchMode
from jaxrlhf.engine.optimizer import OptimizerConfig
from jaxrlhf.engine.train_step import (
    TrainState, create_train_state, default_readout, make_train_step,
)
from jaxrlhf.mfc import MFC, Call, Role
from jaxrlhf.models import hf_io, lora
from jaxrlhf.models.config import HeadKind, ModelConfig
from jaxrlhf.models.sizes import abstract_params
from jaxrlhf.parallel.layout import Layout, init_params
from jaxrlhf.parallel.reshard import reshard
from jaxrlhf.run import roles
from jaxrlhf.run.check import Job
from jaxrlhf.run.check import load_data as load_data  # bench and calibration read data here
from jaxrlhf.run.layouts import RunPlan
from jaxrlhf.run.runner import Runner
from jaxrlhf.spec import ModelSpec, RolloutSpec, RunSpec


# --- engine calls --------------------------------------------------------------------------


def engine_call(mfc: MFC, model: ModelConfig, layout: Layout, micro: MicrobatchConfig,
                rollout: RolloutSpec, tokenizer, algorithm: Algorithm,
                opt: OptimizerConfig | None, replay_routing: bool = False):
    """The compiled-on-first-use engine object of one MFC (`micro`: a train step's
    micro-batching; `replay_routing`: its forward uses the experts the rollout recorded,
    where its batch carries them, `algorithms.routing`)."""
    match mfc.call:
        case Call.GENERATE:
            return make_generate_fn(model, rollout.generate(tokenizer, greedy=mfc.greedy),
                                    layout, prompt_buckets=(rollout.max_prompt_len,))
        case Call.INFERENCE:
            kind = (InferenceKind.LOGPROBS if model.head is HeadKind.LM
                    else InferenceKind.VALUES if mfc.role in (Role.CRITIC, Role.COST_CRITIC)
                    else InferenceKind.SCORES)
            cfg = InferenceConfig(kind, temperature=algorithm.temperature,
                                  replay_routing=replay_routing)
            # The generated batches' lengths, cut after their longest response.
            lengths = [rollout.max_prompt_len + n for n in response_widths(rollout.max_new_tokens)]
            return make_inference_fn(model, cfg, layout, length_buckets=lengths)
        case Call.TRAIN_STEP:
            train = algorithm.train[mfc.role]
            readout = dataclasses.replace(train.readout or default_readout(model),
                                          replay_routing=replay_routing)
            return make_train_step(model, layout, train.loss_fn, opt, micro, readout)


# --- model states --------------------------------------------------------------------------


def load_role(model: ModelSpec, layout: Layout):
    """A role's parameters on `layout` from its HF directory; a scalar head missing there (a
    causal LM's trunk as critic or reward model) starts at zero."""
    config = model.config
    shardings = layout.param_shardings(abstract_params(config))
    return hf_io.load_hf(model.path, shardings=shardings, dtype=config.dtype,
                         param_dtype=config.param_dtype, head=config.head,
                         init_missing_score=config.head is HeadKind.SCALAR)[1]


def initial_actor_params(spec: RunSpec, layout: Layout):
    """The actor's parameters on `layout`: from its HF directory, else freshly initialised;
    LoRA's adapters freshly initialised beside weights loaded from a directory."""
    config, key = spec.base.config, jax.random.key(spec.seed)
    if not spec.base.path:
        return init_params(config, layout, key)
    if config.lora is None:
        return load_role(spec.base, layout)
    base = load_role(dataclasses.replace(spec.base, config=config.replace(lora=None)), layout)
    adapters = init_params(config, layout, key, lambda p: lora.partition(p, config.lora)[0])
    return lora.combine(adapters, base)


def actor_copy(actor_params, model: ModelConfig, layout: Layout):
    """The actor's parameters that `model` has (all of them for the ref, the trunk for a
    critic), on `layout` in buffers of their own and in `model`'s dtypes (a role may store its
    copy in another dtype); a head the actor lacks (a critic's score) starts at zero."""
    boxed = abstract_params(model)
    shardings, abstract = layout.param_shardings(boxed), nn.meta.unbox(boxed)
    shared = {k: v for k, v in actor_params.items() if k in abstract}
    moved, _ = reshard(shared, {k: shardings[k] for k in shared})
    # reshard returns a leaf as is when its sharding does not change; the copy must outlive
    # the actor's buffers, which its train step donates.
    own = lambda new, old, a: (jnp.copy(new) if new is old else new).astype(a.dtype)
    params = jax.tree.map(own, moved, shared, {k: abstract[k] for k in shared})
    return {**params, **{k: jax.device_put(jnp.zeros(a.shape, a.dtype), shardings[k])
                         for k, a in abstract.items() if k not in params}}


def initial_states(spec: RunSpec, plan: RunPlan, params) -> dict:
    """Every model's state at the start of training (each role's start: `run.roles`):
    TrainStates of trained models, parameters of frozen ones, on their home layouts. `params`
    are the (warm-started) actor's parameters on its home layout."""
    states = {}
    for role, start in roles.starts(spec).items():
        home, model = plan.home(spec.graph, role), spec.models[role]
        match start:
            case _ if role is Role.ACTOR:
                first = params  # loaded or initialised (and maybe warm-started) by the caller
            case roles.Start.LOAD:
                first = load_role(model, home)
            case roles.Start.INIT:  # its own stream: not the actor's initialisation again
                key = jax.random.fold_in(jax.random.key(spec.seed), list(Role).index(role) + 1)
                first = init_params(model.config, home, key)
            case roles.Start.ACTOR_COPY | roles.Start.ACTOR_TRUNK:  # LoRA: merged weights
                lora_cfg = spec.base.config.lora
                actor = params if lora_cfg is None else lora.merged(params, lora_cfg)
                first = actor_copy(actor, model.config, home)
        opt = spec.optimizers.get(role)
        states[role] = first if opt is None else create_train_state(first, model.config, home, opt)
    return states


def runtimes(spec: RunSpec, plan: RunPlan, states: dict) -> dict[Role, ModelRuntime]:
    """ModelRuntimes around initial or checkpointed states (TrainState = trained); models that
    share devices with others wait in host memory as `placement.offload_*` say."""
    graph = spec.graph
    devices_of = {role: {d.id for m in graph.calls_of(role) if not m.host
                         for d in plan.layouts[m.name].devices} for role in spec.models}
    # A frozen model waits in host memory only where its devices hold other models too.
    shares = lambda role: any(devices_of[role] & ds for r, ds in devices_of.items() if r != role)
    out = {}
    for role, model in spec.model_configs().items():
        state, p = states[role], spec.placement
        held = (dict(state=state, offload_trainable=p.offload_trainable and shares(role))
                if isinstance(state, TrainState)
                else dict(params=state, offload=p.offload_frozen and shares(role)))
        out[role] = ModelRuntime(role, model, plan.home(graph, role), **held,
                                 readers=readers_per_layout(graph.calls_of(role), plan.layouts))
    return out


@contextlib.contextmanager
def host_pools(spec: RunSpec):
    """A process pool (and error budget) per role the algorithm runs as a host function; with
    an environment (`spec.env`), its pool under the actor's role, which rolls out with it."""
    with contextlib.ExitStack() as stack:
        pools = {role: HostFunction(stack.enter_context(RewardPool(
            r.function, num_workers=r.workers, timeout_s=r.timeout)), r.max_error_rate)
                 for role, r in spec.rewards.items()}
        if spec.env is not None:
            e = spec.env
            pools[Role.ACTOR] = HostFunction(stack.enter_context(EnvPool(
                e.spec, num_workers=e.workers, timeout_s=e.timeout)), e.max_error_rate)
        yield pools


@dataclasses.dataclass
class JobStart:
    """Where `job` begins in its checkpoint directory (`start`): the newest intact checkpoint
    there, if any (`resume`: its host state; `states`: every model's state on its home layout in
    this job, whatever layouts wrote it)."""

    job: Job
    checkpoints: Checkpointer
    resume: HostState | None
    states: dict | None

    @property
    def step(self) -> int:
        return 0 if self.resume is None else self.resume.step

    def runner(self, pools, actor_params=None) -> Runner:
        """The job's runner: continuing the checkpoint, else fresh (`fresh_runner`)."""
        if self.resume is None:
            return fresh_runner(self.job, pools, actor_params)
        out = runner(self.job, self.states, pools)
        out.restore(self.resume.runner)
        self.states = None  # the runner's now (its steps donate them)
        return out

    def rows(self) -> EpochIterator:
        """Endless batches of the job's rows (`Job.train_rows`) from where the checkpoint left
        them."""
        job = self.job
        out = EpochIterator(job.train_rows, job.spec.rollout.batch_size, seed=job.spec.seed)
        if self.resume is not None:
            out.restore(self.resume.iterator)
        return out


@contextlib.contextmanager
def start(job: Job, directory: pathlib.Path):
    """The job's `JobStart` in checkpoint `directory` (damaged newer checkpoints are skipped);
    leaving the context closes the checkpoints (waits for background writes)."""
    spec = job.spec
    with contextlib.closing(Checkpointer(directory, spec.checkpoint)) as checkpoints:
        restored = checkpoints.restore_intact({
            role: abstract_state(model, job.plan.home(spec.graph, role), spec.optimizers.get(role))
            for role, model in spec.model_configs().items()})
        yield JobStart(job, checkpoints, *(restored or (None, None)))


def train_micro(spec: RunSpec, planned: int) -> MicrobatchConfig:
    """A train step's micro-batching: a token budget (`micro_batch_tokens`) is applied to each
    batch's packed rows as it comes (the plan's count, from padded rows, is its most); else
    the plan's count."""
    if spec.micro.mode is MicrobatchMode.TOKEN_BUDGET:
        return spec.micro
    return MicrobatchConfig.by_count(planned)


def runner(job: Job, states: dict, pools) -> Runner:
    """The job's runner around `states` (see `initial_states`, or a checkpoint's)."""
    spec, plan = job.spec, job.plan
    calls = {m.name: engine_call(m, spec.models[m.role].config, plan.layouts[m.name],
                                 train_micro(spec, plan.micro_batches(m.name)), spec.rollout,
                                 job.tokenizer, spec.algorithm, spec.optimizers.get(m.role),
                                 spec.routing is Routing.REPLAY)
             for m in spec.algorithm.mfcs if not m.host}
    limits = None if spec.env is None else TrajectoryLimits(
        spec.env.max_turns, spec.rollout.max_prompt_len, spec.rollout.max_new_tokens,
        spec.env.max_error_rate)
    return Runner(spec.algorithm, spec.graph, plan, runtimes(spec, plan, states), calls,
                  job.tokenizer, pools, spec.seed, trajectories=limits)


def fresh_runner(job: Job, pools, actor_params=None) -> Runner:
    """The runner with every model started from `actor_params` (default: freshly initialised
    on the actor's home layout)."""
    if actor_params is None:
        home = job.plan.home(job.spec.graph, job.spec.algorithm.trained_role)
        actor_params = initial_actor_params(job.spec, home)
    return runner(job, initial_states(job.spec, job.plan, actor_params), pools)
