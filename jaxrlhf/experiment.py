"""A run built from its config: algorithm, graph, layouts, models, engine calls, scheduler.

Everything that can be wrong with a config is checked here, in `plan_layouts`, before a single
function compiles: the graph, the placement, every MFC's strategy against its model and batch.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import enum
import functools
import pathlib
import re
import tempfile

import jax
import jax.numpy as jnp
from ml_collections import ConfigDict

from jaxrlhf.algorithms import dpo, grpo, ppo, remax, rw, safe_rlhf, sft
from jaxrlhf.algorithms import kl as kl_lib
from jaxrlhf.algorithms import losses
from jaxrlhf.algorithms.spec import Algorithm
from jaxrlhf.dataflow.graph import DataflowGraph, build_graph
from jaxrlhf.dataflow.placement import Placement, PlacementError, resolve_placement
from jaxrlhf.engine.generate import GenerateConfig, make_generate_fn
from jaxrlhf.engine.inference import InferenceConfig, InferenceKind, make_inference_fn
from jaxrlhf.engine.microbatch import MicrobatchConfig
from jaxrlhf.engine.optimizer import OptimizerConfig
from jaxrlhf.engine.train_step import make_train_step
from jaxrlhf.mfc import MFC, Call, Role
from jaxrlhf.models import hf_io
from jaxrlhf.models.config import HeadKind, ModelConfig, RematPolicy
from jaxrlhf.models.sizes import abstract_params as abstract_params_of, get_size
from jaxrlhf.parallel.layout import Layout, make_layout


class AlgorithmName(enum.Enum):
    PPO = "ppo"
    GRPO = "grpo"
    REMAX = "remax"
    SAFE_RLHF = "safe_rlhf"
    DPO = "dpo"
    SFT = "sft"
    RW = "rw"

    @property
    def offline(self) -> bool:
        """Trains on a fixed dataset (no generation in the step): see jaxrlhf.offline."""
        return self in (AlgorithmName.DPO, AlgorithmName.SFT, AlgorithmName.RW)


def algorithm_name(config: ConfigDict) -> AlgorithmName:
    return enum_value(AlgorithmName, config.algorithm, "algorithm")


class RewardKind(enum.Enum):
    FUNCTION = "function"
    MODEL = "model"


_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
_HEAD_OF_ROLE = {Role.ACTOR: HeadKind.LM, Role.REF: HeadKind.LM, Role.CRITIC: HeadKind.SCALAR,
                 Role.REWARD: HeadKind.SCALAR, Role.COST: HeadKind.SCALAR,
                 Role.COST_CRITIC: HeadKind.SCALAR}


def enum_value(kind: type[enum.Enum], value: str, field: str):
    try:
        return kind(value)
    except ValueError:
        options = ", ".join(m.value for m in kind)
        raise ValueError(f"{field}={value!r} is not one of: {options}") from None


def dtype_of(name: str, field: str):
    if name not in _DTYPES:
        raise ValueError(f"{field}={name!r} is not one of: {', '.join(_DTYPES)}")
    return _DTYPES[name]


def model_config_of(cfg: ConfigDict, role: Role, field: str) -> ModelConfig:
    """The ModelConfig of one role: from its HF directory, or from the size registry."""
    dtype = dtype_of(cfg.dtype, f"{field}.dtype")
    param_dtype = dtype_of(cfg.param_dtype, f"{field}.param_dtype")
    remat = enum_value(RematPolicy, cfg.remat, f"{field}.remat")
    head = _HEAD_OF_ROLE[role]
    if cfg.path:
        if not (pathlib.Path(cfg.path) / "config.json").is_file():
            raise FileNotFoundError(f"{field}.path={cfg.path!r} has no config.json")
        base = hf_io.load_hf_config(cfg.path, dtype=dtype, param_dtype=param_dtype, head=head)
    else:
        try:
            base = get_size(cfg.size, dtype=dtype, param_dtype=param_dtype, head=head)
        except ValueError as e:
            raise ValueError(f"{field}.size: {e}") from None
    return base.replace(scan_layers=cfg.scan_layers, remat=remat)


def optimizer_config(cfg: ConfigDict, total_steps: int) -> OptimizerConfig:
    return OptimizerConfig(
        lr=cfg.lr, warmup_steps=cfg.warmup_steps, total_steps=max(total_steps, cfg.warmup_steps + 1),
        min_lr_ratio=cfg.min_lr_ratio, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps,
        weight_decay=cfg.weight_decay, max_grad_norm=cfg.max_grad_norm,
        fp32_master=cfg.fp32_master,
    )


def ppo_config(config: ConfigDict) -> ppo.PPOConfig:
    c = config.ppo
    kind = kl_lib.KLControllerKind.ADAPTIVE if c.kl_adaptive else kl_lib.KLControllerKind.FIXED
    return ppo.PPOConfig(
        gamma=c.gamma, lam=c.lam,
        kl=kl_lib.KLControllerConfig(kind=kind, init_kl_coef=c.kl_coef, target=c.kl_target,
                                     horizon=c.kl_horizon),
        kl_in_reward=c.kl_in_reward, whiten_advantages=c.whiten_advantages,
        policy=losses.PPOLossConfig(clip_eps=c.clip_eps, entropy_coef=c.entropy_coef),
        value=losses.ValueLossConfig(clip_eps_value=c.value_clip or None),
        mini_batches=c.mini_batches, epochs=c.epochs, temperature=config.rollout.temperature,
    )


def _policy_loss(config: ConfigDict, aggregation: losses.LossAggregation) -> losses.PPOLossConfig:
    return losses.PPOLossConfig(clip_eps=config.ppo.clip_eps,
                                entropy_coef=config.ppo.entropy_coef, aggregation=aggregation)


def grpo_config(config: ConfigDict) -> grpo.GRPOConfig:
    """GRPO: its own β, estimator and normalisation; clipping and updates from `ppo`."""
    g = config.grpo
    aggregation = enum_value(losses.LossAggregation, g.aggregation, "grpo.aggregation")
    loss = losses.GRPOLossConfig(
        policy=_policy_loss(config, aggregation), kl_coef=g.kl_coef,
        kl_estimator=enum_value(kl_lib.KLEstimator, g.kl_estimator, "grpo.kl_estimator"))
    return grpo.GRPOConfig(
        group_size=config.rollout.group_size, loss=loss, scale_by_std=g.scale_by_std,
        mini_batches=config.ppo.mini_batches, epochs=config.ppo.epochs,
        temperature=config.rollout.temperature)


def remax_config(config: ConfigDict) -> remax.ReMaxConfig:
    """ReMax: the KL controller, clipping and updates of the `ppo` section."""
    p = ppo_config(config)
    return remax.ReMaxConfig(kl=p.kl, policy=p.policy, mini_batches=p.mini_batches,
                             epochs=p.epochs, temperature=p.temperature)


def safe_rlhf_config(config: ConfigDict) -> safe_rlhf.SafeRLHFConfig:
    s = config.safe_rlhf
    lagrange = losses.LagrangeConfig(cost_limit=s.cost_limit, lambda_init=s.lambda_init,
                                     lambda_lr=s.lambda_lr, lambda_max=s.lambda_max or None)
    return safe_rlhf.SafeRLHFConfig(ppo=ppo_config(config), lagrange=lagrange)


def dpo_config(config: ConfigDict) -> dpo.DPOConfig:
    return dpo.DPOConfig(losses.DPOLossConfig(beta=config.dpo.beta,
                                              label_smoothing=config.dpo.label_smoothing))


def make_algorithm(config: ConfigDict) -> Algorithm:
    name = algorithm_name(config)
    reward_model = enum_value(RewardKind, config.reward.kind, "reward.kind") is RewardKind.MODEL
    batch = config.rollout.batch_size * config.rollout.group_size
    match name:
        case AlgorithmName.PPO:
            return ppo.make(ppo_config(config), reward_model=reward_model, batch_size=batch)
        case AlgorithmName.GRPO:
            return grpo.make(grpo_config(config), reward_model=reward_model)
        case AlgorithmName.REMAX:
            return remax.make(remax_config(config), reward_model=reward_model, batch_size=batch)
        case AlgorithmName.SAFE_RLHF:
            cost_model = enum_value(RewardKind, config.cost.kind, "cost.kind") is RewardKind.MODEL
            return safe_rlhf.make(safe_rlhf_config(config), reward_model=reward_model,
                                  cost_model=cost_model, batch_size=batch)
        case AlgorithmName.DPO:
            return dpo.make(dpo_config(config))
        case AlgorithmName.SFT:
            return sft.make()
        case AlgorithmName.RW:
            return rw.make()


def _parse_allocation(text: str) -> dict[str, str]:
    allocation = {}
    for item in filter(None, (s.strip() for s in text.split(","))):
        name, sep, spec = item.partition("=")
        if not sep or not name or not spec:
            raise PlacementError(
                f"placement.allocation entry {item!r} is not MFC=RANGE:STRATEGY (e.g. actor_gen=0-3:d4)"
            )
        allocation[name.strip()] = spec.strip()
    return allocation


@dataclasses.dataclass(frozen=True)
class LayoutPlan:
    """Where every MFC runs. `specs` are the strategy strings, `layouts` the built layouts."""

    specs: dict[str, str]
    layouts: dict[str, Layout]

    def home(self, graph: DataflowGraph, role: Role) -> Layout:
        """A model's home: the layout of its train_step, else of its first call."""
        calls = graph.calls_of(role)
        train = [m for m in calls if m.call is Call.TRAIN_STEP]
        return self.layouts[(train or list(calls))[0].name]


def searched_allocation(config: ConfigDict) -> str:
    """placement.kind=auto: the planner's searched plan for `placement.cluster`.

    Searched once per config (check_config and the run both ask for it).
    """
    key = config.to_json()
    if key not in _SEARCHED:
        _SEARCHED[key] = _search_allocation(config)
    return _SEARCHED[key]


_SEARCHED: dict[str, str] = {}


def _search_allocation(config: ConfigDict) -> str:
    from jaxrlhf.plan.cluster import load_cluster
    from jaxrlhf.plan.experiment import experiment_from_config
    from jaxrlhf.plan.report import allocation
    from jaxrlhf.plan.search import search

    if not config.placement.cluster:
        raise PlacementError("placement.kind=auto needs placement.cluster (e.g. meshes/cpu_8.py)")
    report = search(experiment_from_config(config), load_cluster(config.placement.cluster))
    if report.searched.plan is None:
        raise PlacementError(f"placement.kind=auto: no plan fits: {report.searched.reason}")
    print(f"planner: searched plan, {report.searched.step_seconds:.2f} s/step estimated "
          f"(search took {report.search_seconds:.1f} s)", flush=True)
    return allocation(report.searched)


def plan_layouts(graph: DataflowGraph, config: ConfigDict, models: dict[Role, ModelConfig],
                 devices=None) -> LayoutPlan:
    """Resolves and validates the placement of every model MFC; raises naming MFC and field."""
    devices = list(devices or jax.devices())
    kind = enum_value(Placement, config.placement.kind, "placement.kind")
    allocation = config.placement.allocation
    if kind is Placement.AUTO:
        kind, allocation = Placement.MANUAL, searched_allocation(config)
    specs = resolve_placement(graph, kind, len(devices), config.placement.strategy,
                              _parse_allocation(allocation))
    field = "placement.allocation" if kind is Placement.MANUAL else "placement.strategy"
    batch = config.rollout.batch_size * config.rollout.group_size
    layouts = {}
    for name, spec in specs.items():
        mfc = graph.mfc(name)
        try:
            layout = make_layout(spec, model=models[mfc.role], devices=devices)
        except ValueError as e:
            raise PlacementError(f"{field}: MFC {name!r} ({spec}): {e}") from None
        _check_divides(mfc, layout, batch, config, field, spec)
        layouts[name] = layout
    return LayoutPlan(specs, layouts)


def _check_divides(mfc: MFC, layout: Layout, batch: int, config, field: str, spec: str) -> None:
    per_update = batch // config.ppo.mini_batches if mfc.call is Call.TRAIN_STEP else batch
    if batch % config.ppo.mini_batches:
        raise ValueError(f"ppo.mini_batches={config.ppo.mini_batches} does not divide the "
                         f"rollout batch of {batch}")
    if per_update % layout.dp_size:
        raise PlacementError(
            f"{field}: MFC {mfc.name!r} ({spec}) splits the batch {layout.dp_size} ways, which "
            f"does not divide its batch of {per_update} (rollout.batch_size × group_size / "
            f"mini-batches)")


def role_models(config: ConfigDict, graph: DataflowGraph) -> dict[Role, ModelConfig]:
    models = {}
    for role in graph.roles():
        if all(m.host for m in graph.calls_of(role)):
            continue
        models[role] = model_config_of(config.models[role.value], role, f"models.{role.value}")
    return models


def generate_config(config: ConfigDict, tokenizer, *, greedy: bool = False) -> GenerateConfig:
    r = config.rollout
    return GenerateConfig(
        max_new_tokens=r.max_new_tokens, eos_token_id=tuple(tokenizer.stop_ids),
        pad_token_id=tokenizer.pad_id, temperature=0.0 if greedy else r.temperature,
        top_k=0 if greedy else r.top_k, top_p=1.0 if greedy else r.top_p,
        force_max_length=r.force_max_length,
    )


def engine_call(mfc: MFC, model: ModelConfig, layout: Layout, config: ConfigDict, tokenizer,
                algorithm: Algorithm, opt: OptimizerConfig | None):
    """The compiled-on-first-use engine object of one MFC."""
    r = config.rollout
    seq_len = r.max_prompt_len + r.max_new_tokens
    match mfc.call:
        case Call.GENERATE:
            return make_generate_fn(model, generate_config(config, tokenizer, greedy=mfc.greedy),
                                    layout, prompt_buckets=(r.max_prompt_len,))
        case Call.INFERENCE:
            kind = (InferenceKind.LOGPROBS if model.head is HeadKind.LM
                    else InferenceKind.VALUES if mfc.role in (Role.CRITIC, Role.COST_CRITIC)
                    else InferenceKind.SCORES)
            cfg = InferenceConfig(kind, temperature=algorithm.temperature or 1.0)
            return make_inference_fn(model, cfg, layout, length_buckets=(seq_len,))
        case Call.TRAIN_STEP:
            micro = (MicrobatchConfig.by_token_budget(config.micro_batch_tokens)
                     if config.micro_batch_tokens else MicrobatchConfig.by_count(config.micro_batches))
            return make_train_step(model, layout, algorithm.train[mfc.role].loss_fn, opt, micro)


# --- Checks before anything compiles (the entry point reports a ConfigError in one line) ---


class ConfigError(ValueError):
    """A config that cannot work, reported as one line naming the field (no traceback)."""


# What library validation raises for bad input; anything else is a bug and keeps its traceback.
_EXPECTED = (ValueError, TypeError, KeyError, LookupError, OSError, ImportError)


@contextlib.contextmanager
def _field(name: str):
    """Re-raises an expected error while checking `name` as one ConfigError line naming it."""
    try:
        yield
    except ConfigError:
        raise
    except _EXPECTED as e:
        text = " ".join(str(e.args[0] if isinstance(e, KeyError) and e.args else e).split())
        raise ConfigError(text if _names_a_field(text) else f"{name}: {text}") from None


def _names_a_field(text: str) -> bool:
    """Whether a message starts with a config key ("ppo.epochs=0 ...", "placement.kind ...")."""
    from jaxrlhf.schema import base_config

    head = re.match(r"([a-z_]+(?:\.[a-z_]+)*)(=|:| )", text)
    if not head or (head.group(2) == " " and "." not in head.group(1)):
        return False  # "tokenizer has 272 ids" is prose, "placement.allocation has" is not
    node = base_config()
    for part in head.group(1).split("."):
        if not isinstance(node, ConfigDict) or part not in node:
            return False
        node = node[part]
    return True


def _check_keys(config: ConfigDict, base: ConfigDict, prefix: str = "") -> None:
    """Every key exists in jaxrlhf/schema.py, with a value of the same type."""
    for key, value in config.items():
        field = f"{prefix}{key}"
        if key not in base:
            close = difflib.get_close_matches(key, list(base.keys()), n=1)
            hint = f" (did you mean {prefix}{close[0]}?)" if close else ""
            raise ConfigError(f"{field}: unknown config key{hint}; every key is in jaxrlhf/schema.py")
        want = base[key]
        if isinstance(want, ConfigDict):
            if not isinstance(value, ConfigDict):
                raise ConfigError(f"{field}: must be a section, got {value!r}")
            _check_keys(value, want, f"{field}.")
        elif not isinstance(value, type(want)) or isinstance(value, bool) != isinstance(want, bool):
            if not (isinstance(want, float) and isinstance(value, int) and not isinstance(value, bool)):
                raise ConfigError(f"{field}={value!r}: must be a {type(want).__name__}")


# (field, lowest allowed, whether the lowest itself is allowed)
_RANGES = (
    ("steps", 1, True), ("cpu_devices", 1, True), ("rollout.batch_size", 1, True),
    ("rollout.group_size", 1, True), ("rollout.max_prompt_len", 1, True),
    ("rollout.max_new_tokens", 1, True), ("rollout.temperature", 0.0, True),
    ("rollout.top_k", 0, True), ("rollout.top_p", 0.0, False), ("reward.workers", 1, True),
    ("reward.timeout", 0.0, False), ("ppo.mini_batches", 1, True), ("ppo.epochs", 1, True),
    ("micro_batches", 1, True), ("micro_batch_tokens", 0, True), ("warm_start.sft_steps", 0, True),
    ("warm_start.batch_size", 1, True), ("warm_start.lr", 0.0, False),
    ("optimizer.actor.lr", 0.0, False), ("optimizer.critic.lr", 0.0, False),
)


def _check_ranges(config: ConfigDict) -> None:
    for field, low, inclusive in _RANGES:
        value = functools.reduce(getattr, field.split("."), config)
        if value < low or (value == low and not inclusive):
            bound = f">= {low}" if inclusive else f"> {low}"
            raise ConfigError(f"{field}={value}: must be {bound}")
    if config.rollout.top_p > 1:
        raise ConfigError(f"rollout.top_p={config.rollout.top_p}: must be <= 1")


def _check_workdir(workdir: str) -> None:
    path = pathlib.Path(workdir)
    path.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=path, prefix=".write-check-"):
        pass


def _check_data(config: ConfigDict) -> None:
    """User files parse (a bad row is named by file:line), or the built-in task is valid."""
    from jaxrlhf.data import datasets
    from jaxrlhf.trainer import builtin_task  # lazily: trainer builds on this module

    d = config.data
    if not d.train_path:
        with _field("data.task"):
            builtin_task(d.task)
        return
    kinds = {"data.train_path": datasets.RowKind.PROMPT, "data.eval_path": datasets.RowKind.PROMPT,
             "data.sft_path": datasets.RowKind.SFT,
             "data.preference_path": datasets.RowKind.PREFERENCE,
             "data.preference_eval_path": datasets.RowKind.PREFERENCE}
    rows = {}
    for field, kind in kinds.items():
        path = functools.reduce(getattr, field.split("."), config)
        if path:
            with _field(field):
                rows[field] = datasets.read_rows(path, kind)
    if len(rows["data.train_path"]) < config.rollout.batch_size:
        raise ConfigError(f"rollout.batch_size={config.rollout.batch_size}: more than the "
                          f"{len(rows['data.train_path'])} rows of {d.train_path}")


def _check_reward_specs(config: ConfigDict, graph: DataflowGraph) -> None:
    from jaxrlhf.data.rewards import resolve_reward

    sections = {Role.REWARD: "reward", Role.COST: "cost"}
    for role in dict.fromkeys(m.role for m in graph.mfcs if m.host):
        with _field(f"{sections[role]}.function"):
            resolve_reward(config[sections[role]].function)


def _check_model_files(config: ConfigDict, role: Role) -> None:
    path = config.models[role.value].path
    if role in (Role.REWARD, Role.COST) and not path:
        raise ConfigError(f"models.{role.value}.path: {role.value}.kind=model needs a trained "
                          "Hugging Face model directory")
    if path and not any((pathlib.Path(path) / f).is_file()
                        for f in (hf_io.SINGLE_FILE, hf_io.INDEX_FILE)):
        raise ConfigError(f"models.{role.value}.path={path!r}: no {hf_io.SINGLE_FILE} or "
                          f"{hf_io.INDEX_FILE} (a Hugging Face model directory has its weights)")


def check_config(config: ConfigDict, workdir: str, devices=None) -> LayoutPlan:
    """Every check that needs no compile, roughly in the order a user would fix them.

    Returns:
      The placement (so callers and tests can look at it).

    Raises:
      ConfigError: one line naming the field and the problem.
    """
    from jaxrlhf.schema import base_config
    from jaxrlhf.data.tokenizer import check_vocab, load_tokenizer

    _check_keys(config, base_config())
    with _field("algorithm"):
        algorithm_name(config)
    _check_ranges(config)
    with _field("workdir"):
        _check_workdir(workdir)
    with _field("tokenizer"):
        tokenizer = load_tokenizer(config.tokenizer)
    with _field("algorithm"):
        graph = build_graph(make_algorithm(config).mfcs, roles=set(Role))
    _check_reward_specs(config, graph)
    with _field("models"):
        models = role_models(config, graph)
    for role, model in models.items():
        _check_model_files(config, role)
        with _field(f"models.{role.value}"):
            check_vocab(tokenizer, model.vocab_size)
    with _field("placement"):
        plan = plan_layouts(graph, config, models, devices)
    if Role.ACTOR in models and config.warm_start.sft_steps:
        home = plan.home(graph, Role.ACTOR)
        if config.warm_start.batch_size % home.dp_size:
            raise ConfigError(f"warm_start.batch_size={config.warm_start.batch_size}: does not "
                              f"split {home.dp_size} ways over the actor's layout {home}")
    _check_data(config)
    return plan
