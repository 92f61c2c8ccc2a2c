"""The run spec: an experiment config turned, once, into frozen typed specs.

`run_spec(config)` is the last place a `ConfigDict` exists. It checks every key against
`jaxrlhf/schema.py` (names, types and ranges), and every enum, builds the algorithm, its
graph and each role's `ModelConfig`, and returns a `RunSpec`; everything below takes the parts
it needs. A problem is a `ConfigError`: one line naming the field (`field: problem`).
The checks that need files, devices or the planner run on the spec (`jaxrlhf.run.check`).
"""

from __future__ import annotations

import dataclasses
import enum
import pathlib
from collections.abc import Mapping

import jax.numpy as jnp
from ml_collections import ConfigDict

from jaxrlhf.algorithms import decoupled, registry
from jaxrlhf.algorithms.routing import Routing, with_recorded_routes
from jaxrlhf.algorithms.registry import Capability
from jaxrlhf.algorithms.registry import from_section as _of
from jaxrlhf.algorithms.reward_norm import RewardNormConfig, with_reward_norm
from jaxrlhf.algorithms.spec import Algorithm, BatchKind
from jaxrlhf.checkpoint import CheckpointConfig
from jaxrlhf.data import environments, tasks
from jaxrlhf.data.chat import ChatTemplateMode
from jaxrlhf.data.long_prompts import parse_long_prompts
from jaxrlhf.data.sources import DataSpec
from jaxrlhf.dataflow.graph import DataflowGraph, build_graph
from jaxrlhf.dataflow.placement import Placement
from jaxrlhf.engine.generate import GenerateConfig
from jaxrlhf.engine.microbatch import MicrobatchConfig
from jaxrlhf.engine.optimizer import OptimizerConfig
from jaxrlhf.engine.rollout.scheduler import OnNewVersion
from jaxrlhf.metrics import WandbMode, WandbSpec, wandb_available
from jaxrlhf.mfc import Call, Role
from jaxrlhf.models import attention, hf_io, lora
from jaxrlhf.models.config import HeadKind, ModelConfig, RematPolicy
from jaxrlhf.models.sizes import get_size
from jaxrlhf.parallel.delta import WeightSync
from jaxrlhf.plan.experiment import Experiment, Workload
from jaxrlhf.schema import (
    REWARD_KINDS, ConfigError, check_keys, check_ranges, enum_value, field,
)
from jaxrlhf.schema import model as schema_model


class NanPolicy(enum.Enum):
    """What a step with a non-finite loss, gradient norm or model state does (the loop's
    `run.guards.NanGuard`)."""

    STOP = "stop"  # raise NonFiniteError; the latest checkpoint is the last good state
    SKIP = "skip"  # discard the step's updates and controller change; go on with the next batch


_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
_TASKS = {"reverse": tasks.ReverseTask, "arithmetic": tasks.ArithmeticTask,  # data.task.kind
          "tool_arithmetic": tasks.ToolArithmeticTask, "lookup": tasks.LookupTask}


# --- the specs ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """One role's model: its architecture and, if it starts from one, its HF directory."""

    config: ModelConfig
    path: str = ""


@dataclasses.dataclass(frozen=True)
class RolloutSpec:
    """Shapes and sampling of one step: `batch_size` prompts × `group_size` responses each."""

    batch_size: int
    group_size: int
    max_prompt_len: int
    max_new_tokens: int
    temperature: float
    top_k: int
    top_p: float
    force_max_length: bool
    expected_new_tokens: float = 0.0  # 0: max_new_tokens

    @property
    def mean_new_tokens(self) -> float | None:
        """The responses' expected mean length the planner prices (None: max_new_tokens)."""
        return self.expected_new_tokens or None

    @property
    def rows(self) -> int:
        """Sequences per step."""
        return self.batch_size * self.group_size

    @property
    def seq_len(self) -> int:
        return self.max_prompt_len + self.max_new_tokens

    def generate(self, tokenizer, *, greedy: bool = False) -> GenerateConfig:
        return GenerateConfig(
            max_new_tokens=self.max_new_tokens, eos_token_id=tuple(tokenizer.stop_ids),
            pad_token_id=tokenizer.pad_id, temperature=0.0 if greedy else self.temperature,
            top_k=0 if greedy else self.top_k, top_p=1.0 if greedy else self.top_p,
            force_max_length=self.force_max_length)


@dataclasses.dataclass(frozen=True)
class RewardSpec:
    """A host reward (or cost) function run in a process pool."""

    function: str
    workers: int
    timeout: float
    max_error_rate: float  # a step with a larger fraction of failed calls stops the run


@dataclasses.dataclass(frozen=True)
class EnvSpec:
    """The environment of multi-turn rollouts (`env.*`), run in a process pool."""

    spec: str  # env.name
    max_turns: int
    workers: int
    timeout: float
    max_error_rate: float


def _env(config: ConfigDict) -> EnvSpec | None:
    e = config.env
    if not e.name:
        return None
    if Capability.MULTITURN not in _registration(config).capabilities or config.ppo.tis_cap:
        multiturn = " or ".join(sorted(registry.names(Capability.MULTITURN)))
        raise ConfigError(f"env.name={e.name!r}: multi-turn rollouts train with "
                          f"algorithm={multiturn}, without ppo.tis_cap")
    with field("env.name"):
        environments.resolve_env_class(e.name)
    return EnvSpec(e.name, e.max_turns, e.workers, e.timeout, e.max_error_rate)


@dataclasses.dataclass(frozen=True)
class EvalSpec:
    """Held-out evaluation during RL (`jaxrlhf/run/evaluate.py`).

    every: RL steps between evaluations (0 = only before and after training); samples: sampled
    responses per prompt for pass@k / mean@k (0 = greedy only); max_prompts: held-out prompts
    used (0 = all).
    """

    every: int
    samples: int
    max_prompts: int


@dataclasses.dataclass(frozen=True)
class WarmStartSpec:
    """Supervised steps of the actor before RL (0 = none), with their own optimizer."""

    steps: int
    batch_size: int
    optimizer: OptimizerConfig


@dataclasses.dataclass(frozen=True)
class PlacementSpec:
    kind: Placement
    cluster: str  # auto: the cluster file the planner searches for
    strategy: str  # colocate's degrees
    allocation: str  # manual: NAME=RANGE:STRATEGY[@MICRO_BATCHES],...
    offload_frozen: bool
    offload_trainable: bool  # trained models wait in host memory while others run
    gen_replicas: int  # disaggregate: generation replicas, one device block each
    compile_check: bool  # auto: the best plan XLA says fits (calibration/compile_check.py)


@dataclasses.dataclass(frozen=True)
class AsyncRLSpec:
    """Asynchronous RL (AReaL); see jaxrlhf/run/async_loop.py.

    Attributes:
      max_staleness: η; 0 = the synchronous loop.
      decoupled: the algorithm trains with the decoupled PPO objective (η > 0 only).
      chunk_tokens: tokens decoded between checks for new weights.
      on_new_version: what a row still decoding does when new weights come (read by the
        rollout workers only).
      weight_sync: what a publish of new weights sends to generation (every tensor, or those
        that changed).
    """

    max_staleness: int
    decoupled: bool
    chunk_tokens: int
    on_new_version: OnNewVersion
    weight_sync: WeightSync


@dataclasses.dataclass(frozen=True)
class RunSpec:
    """Everything a run needs, typed and validated (see the module docstring).

    Attributes:
      models: role -> ModelSpec for every role with a model-backed MFC.
      base: the actor's model, which every model without weights of its own starts from (the
        reward model of reward modelling starts from its trunk).
      optimizers: role -> OptimizerConfig for every trained role.
      rewards: role -> RewardSpec for every role the graph runs as a host function.
      micro: train_step micro-batching (an MFC's `@N` in the allocation overrides it).
      config_json: the config as JSON, for checkpoints (export rebuilds specs from it).
      wandb: the W&B run the metrics also go to; None: none.
      compile_cache_dir: JAX's persistent compilation cache (`backend.use_compilation_cache`,
        which `run/check.py` calls); None: none.
    """

    algorithm: Algorithm
    graph: DataflowGraph
    models: Mapping[Role, ModelSpec]
    base: ModelSpec
    rollout: RolloutSpec
    micro: MicrobatchConfig
    mini_batches: int
    epochs: int
    optimizers: Mapping[Role, OptimizerConfig]
    rewards: Mapping[Role, RewardSpec]
    placement: PlacementSpec
    checkpoint: CheckpointConfig
    nan_policy: NanPolicy
    data: DataSpec
    warm_start: WarmStartSpec
    tokenizer: str
    seed: int
    steps: int
    config_json: str
    async_rl: AsyncRLSpec
    require_model_paths: bool  # every role loads its own HF directory
    evaluation: EvalSpec
    compile_cache_dir: pathlib.Path | None
    wandb: WandbSpec | None = None
    env: EnvSpec | None = None  # multi-turn rollouts' environment; None: single turns
    oversample: int = 1  # generated rows per trained row (DAPO's dynamic sampling keeps 1/k)
    routing: Routing = Routing.NONE  # the rollout's experts: replayed, recorded, or neither

    @property
    def train_rows(self) -> int:
        """Rows a step's train calls are fed (all of `step_rows` but with DAPO's oversampling)."""
        return self.step_rows // self.oversample

    @property
    def step_rows(self) -> int:
        """Sequences one step feeds an MFC: a pair is two rows (chosen, then rejected)."""
        return self.rollout.rows * (2 if self.algorithm.batches is BatchKind.PAIRS else 1)

    def model_configs(self) -> dict[Role, ModelConfig]:
        return {role: m.config for role, m in self.models.items()}

    def experiment(self) -> Experiment:
        """The planner's view of the run: graph, models, shapes of one step."""
        r = self.rollout
        workload = Workload(batch_size=r.rows, prompt_len=r.max_prompt_len,
                            new_tokens=r.max_new_tokens, mini_batches=self.mini_batches,
                            epochs=self.epochs, mean_new_tokens=r.mean_new_tokens,
                            group_size=r.group_size)
        master = {role: opt.fp32_master for role, opt in self.optimizers.items()}
        return Experiment.of(self.graph, self.model_configs(), workload, fp32_master=master,
                             offload_frozen=self.placement.offload_frozen,
                             offload_trainable=self.placement.offload_trainable)


# --- config -> spec ------------------------------------------------------------------------

def model_config_of(cfg: ConfigDict, role: Role, where: str) -> ModelConfig:
    """The ModelConfig of one role: from its HF directory, or from the size registry."""
    dtype = enum_value(_DTYPES, cfg.dtype, f"{where}.dtype")
    param_dtype = enum_value(_DTYPES, cfg.param_dtype, f"{where}.param_dtype")
    remat = enum_value(RematPolicy, cfg.remat, f"{where}.remat")
    attn = enum_value(attention.AttentionImpl, cfg.attention, f"{where}.attention")
    if (reason := attention.unavailable_reason(attn)) is not None:
        raise ValueError(f"{where}.attention={cfg.attention!r}: {reason}")
    head = HeadKind.LM if role in (Role.ACTOR, Role.REF) else HeadKind.SCALAR  # policies
    adapters = _lora(cfg.lora, role, f"{where}.lora")
    if cfg.path:
        if not (pathlib.Path(cfg.path) / "config.json").is_file():
            raise FileNotFoundError(f"{where}.path={cfg.path!r} has no config.json")
        base = hf_io.load_hf_config(cfg.path, dtype=dtype, param_dtype=param_dtype, head=head)
    else:
        with field(f"{where}.size"):
            base = get_size(cfg.size, dtype=dtype, param_dtype=param_dtype, head=head)
    return base.replace(scan_layers=cfg.scan_layers, remat=remat, attention=attn, lora=adapters)


_LORA_DEFAULTS = schema_model().lora


def _check_adapters(cfg: ConfigDict, model: ModelConfig, where: str) -> None:
    """`models.<role>.lora` trains something: no key set at rank 0, alpha > 0, a rank no
    projection's width caps. For a run only: export rebuilds a checkpoint's models with
    `model_config_of` whatever an older run accepted."""
    if not cfg.rank:
        for key, value in cfg.items():  # set, and nothing would read it
            if key != "rank" and value != _LORA_DEFAULTS[key]:
                raise ConfigError(f"{where}.{key}={value!r}: {where}.rank=0 adapts nothing (set "
                                  "a rank > 0 to train adapters)")
        return
    if cfg.alpha <= 0:  # the adapters' output is scaled by alpha / rank: 0 trains nothing
        raise ConfigError(f"{where}.alpha={cfg.alpha}: must be > 0 (the adapters' output is "
                          "scaled by alpha / rank)")
    if model.lora is not None and (problem := lora.rank_problem(model.lora, model)):
        raise ConfigError(f"{where}.{problem}")


def _lora(cfg: ConfigDict, role: Role, where: str) -> lora.LoraConfig | None:
    """`models.<role>.lora` as a LoraConfig; None at rank 0. Only the actor takes adapters."""
    if not cfg.rank:
        return None
    if role is not Role.ACTOR:
        raise ConfigError(f"{where}.rank={cfg.rank}: LoRA adapts the actor only")
    with field(f"{where}.targets"):
        targets = lora.parse_targets(cfg.targets)
    with field(where):
        return lora.LoraConfig(rank=cfg.rank, alpha=cfg.alpha, targets=targets)


def _registration(config: ConfigDict) -> registry.Registration:
    """The registry's entry of `algorithm`; a ConfigError listing the names if none."""
    with field("algorithm"):
        return registry.lookup(config.algorithm)


def _refuse_incapable(config: ConfigDict, entry: registry.Registration) -> None:
    """Asynchronous RL and the mismatch correction run only the algorithms that can."""
    a, tis_cap = config.async_rl, config.ppo.tis_cap
    if a.max_staleness and Capability.ASYNC not in entry.capabilities:
        raise ConfigError(f"async_rl.max_staleness={a.max_staleness}: asynchronous RL runs "
                          f"{' and '.join(registry.names(Capability.ASYNC))}, not {entry.name}")
    if tis_cap > 0 and Capability.MISMATCH_CORRECTION not in entry.capabilities:
        able = ", ".join(registry.names(Capability.MISMATCH_CORRECTION))
        raise ConfigError(f"ppo.tis_cap={tis_cap}: the mismatch correction runs {able}, not "
                          f"{entry.name}")


def make_algorithm(config: ConfigDict, decoupled_objective: bool = False,
                   multiturn: bool = False) -> Algorithm:
    """The configured algorithm (the registry's `algorithm`), over trajectories when
    `multiturn`; with AReaL's decoupled objective when asked (async_rl.decoupled); with the
    mismatch correction (`ppo.tis_cap` > 0) where its actor loss takes π_prox."""
    entry = _registration(config)
    _refuse_incapable(config, entry)
    tis = config.ppo.tis_cap > 0
    cap = (config.async_rl.behav_imp_weight_cap or None) if decoupled_objective else None
    reward_model = enum_value(REWARD_KINDS, config.reward.kind, "reward.kind")
    built = entry.build(registry.Request(config, cap, reward_model, multiturn))
    if decoupled_objective or tis:
        return decoupled.decouple(built.algorithm, built.actor_loss, prox_call=tis)
    return built.algorithm



def _data(d: ConfigDict) -> DataSpec:
    with field("data.task"):  # the task class of `kind`; ops: arithmetic only
        task = _of(enum_value(_TASKS, d.task.kind, "data.task.kind"), d.task,
                   ops=tuple(tasks.Op(c) for c in d.task.ops))
    with field("data.long_prompts"):
        long_prompts = parse_long_prompts(d.long_prompts)
    chat_template = enum_value(ChatTemplateMode, d.chat_template, "data.chat_template")
    return _of(DataSpec, d, task=task, long_prompts=long_prompts, chat_template=chat_template)


def _models(config: ConfigDict, graph: DataflowGraph) -> tuple[dict[Role, ModelSpec], ModelSpec]:
    """(role -> ModelSpec of every model-backed role, the actor's model (the base))."""
    def model(role: Role) -> ModelSpec:
        cfg, where = config.models[role.value], f"models.{role.value}"
        built = model_config_of(cfg, role, where)
        _check_adapters(cfg.lora, built, f"{where}.lora")
        return ModelSpec(built, cfg.path)

    with field("models"):
        models = {role: model(role) for role in graph.roles()
                  if not all(m.host for m in graph.calls_of(role))}
        base = models.get(Role.ACTOR) or model(Role.ACTOR)
    if Role.REF in models and not models[Role.REF].path:  # a copy of the actor: its shapes
        ref = models[Role.REF].config
        models[Role.REF] = ModelSpec(base.config.replace(  # the base model, without adapters
            dtype=ref.dtype, param_dtype=ref.param_dtype, scan_layers=ref.scan_layers,
            remat=ref.remat, attention=ref.attention, lora=None))
    return models, base


class ReplayRouting(enum.Enum):
    """`models.actor.moe.replay_routing` (schema.py)."""

    AUTO = "auto"
    ON = "on"
    OFF = "off"


def _routing(config: ConfigDict, algorithm: Algorithm, base: ModelSpec) -> Routing:
    """What the run does with the experts its rollout chose (`algorithms.routing`): the
    actor's `moe.replay_routing` checked against the run, one ConfigError line naming it."""
    where = "models.actor.moe.replay_routing"
    for role, model in config.models.items():
        if role != Role.ACTOR.value and model.moe.replay_routing != "auto":
            raise ConfigError(f"models.{role}.moe.replay_routing={model.moe.replay_routing!r}: "
                              "only the actor's is read (the reference replays its routes)")
    mode = enum_value(ReplayRouting, config.models.actor.moe.replay_routing, where)
    why_not = (
        "the actor has no experts" if base.config.moe is None
        else f"{algorithm.name} trains on offline batches, not rollouts" if algorithm.offline
        else f"{algorithm.name} trains on other rows than it generates"
        if algorithm.oversample > 1 else None)
    if why_not is not None:
        if mode is not ReplayRouting.AUTO:  # set, and nothing to replay or record: refused
            raise ConfigError(f"{where}={mode.value!r}: {why_not}")
        return Routing.NONE
    return Routing.RECORD if mode is ReplayRouting.OFF else Routing.REPLAY


def _wandb(w: ConfigDict) -> WandbSpec | None:
    """`logging.wandb` as a spec; None when no project is set."""
    mode = enum_value(WandbMode, w.mode, "logging.wandb.mode")
    if not w.project:
        if w.name:
            raise ConfigError(f"logging.wandb.name={w.name!r}: set logging.wandb.project too")
        return None
    if not wandb_available():
        raise ConfigError("logging.wandb.project: logging to W&B needs the wandb package "
                          "(pip install 'jaxrlhf[wandb]')")
    return WandbSpec(project=w.project, name=w.name, mode=mode)


def _cache_dir(value: str) -> pathlib.Path | None:
    """`compile.cache_dir` as an absolute path (`~` expanded: JAX takes it as given); None
    when empty (no cache)."""
    if not value:
        return None
    path = pathlib.Path(value).expanduser().absolute()
    if path.exists() and not path.is_dir():
        raise ConfigError(f"compile.cache_dir={value!r}: not a directory")
    return path


def run_spec(config: ConfigDict) -> RunSpec:
    """The typed, checked spec of `config`; raises ConfigError naming the field."""
    check_keys(config)
    check_ranges(config)
    a = config.async_rl
    async_rl = _of(AsyncRLSpec, a, decoupled=bool(a.max_staleness and a.decoupled),
                   on_new_version=enum_value(OnNewVersion, a.on_new_version,
                                             "async_rl.on_new_version"),
                   weight_sync=enum_value(WeightSync, a.weight_sync, "async_rl.weight_sync"))
    env = _env(config)
    with field("algorithm"):
        algorithm = make_algorithm(config, async_rl.decoupled, multiturn=env is not None)
        graph = build_graph(algorithm.mfcs, roles=set(Role))
    with field("reward"):  # the same graph: normalisation changes how models train
        algorithm = with_reward_norm(algorithm, _of(RewardNormConfig, config.reward))
    rewards = {m.role: _of(RewardSpec, config[m.role.value]) for m in graph.mfcs if m.host}
    models, base = _models(config, graph)
    routing = _routing(config, algorithm, base)
    if routing is not Routing.NONE:
        algorithm = with_recorded_routes(algorithm)
        graph = build_graph(algorithm.mfcs, roles=set(Role))
    train = algorithm.train[algorithm.trained_role]  # offline algorithms: 1 x 1 updates
    updates = config.steps * train.epochs * train.mini_batches
    optimizer = lambda c: _of(OptimizerConfig, c, total_steps=max(updates, c.warmup_steps + 1))
    optimizers = {role: optimizer(config.optimizer[role.value])
                  for role in models if any(m.call is Call.TRAIN_STEP for m in graph.calls_of(role))}
    micro = (MicrobatchConfig.by_token_budget(config.micro_batch_tokens)
             if config.micro_batch_tokens else MicrobatchConfig.by_count(config.micro_batches))
    p = config.placement
    kind = enum_value(Placement, p.kind, "placement.kind")
    if p.gen_replicas > 1 and (kind is not Placement.DISAGGREGATE
                               or not config.async_rl.max_staleness):
        raise ConfigError(f"placement.gen_replicas={p.gen_replicas}: generation replicas need "
                          "placement.kind=disaggregate and async_rl.max_staleness > 0")
    w = config.warm_start
    warm = WarmStartSpec(w.sft_steps, w.batch_size, OptimizerConfig(
        lr=w.lr, total_steps=w.sft_steps + 1, min_lr_ratio=0.1,
        max_grad_norm=config.optimizer.actor.max_grad_norm))
    with field("checkpoint"):
        checkpoint = CheckpointConfig.of(config)
    return RunSpec(
        algorithm=algorithm, graph=graph, models=models, base=base,
        rollout=_of(RolloutSpec, config.rollout), micro=micro,
        mini_batches=train.mini_batches, epochs=train.epochs, optimizers=optimizers,
        rewards=rewards, placement=_of(PlacementSpec, p, kind=kind), checkpoint=checkpoint,
        nan_policy=enum_value(NanPolicy, config.nan_policy, "nan_policy"),
        data=_data(config.data), warm_start=warm, tokenizer=config.tokenizer, seed=config.seed,
        steps=config.steps, config_json=config.to_json(), async_rl=async_rl,
        require_model_paths=config.require_model_paths, evaluation=_of(EvalSpec, config.eval),
        compile_cache_dir=_cache_dir(config.compile.cache_dir),
        wandb=_wandb(config.logging.wandb), env=env,
        oversample=algorithm.oversample, routing=routing)
