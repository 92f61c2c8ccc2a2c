"""Every key an experiment config has, with its default, type and range; and the error that
names a key. Experiment configs start from here. The sections an algorithm owns are declared
in its module and added here from the registry (`jaxrlhf/algorithms/registry.py`).

Library code reads keys directly (no `config.get(key, default)`): a key missing here is a bug,
and an unknown key on the command line is rejected because configs are locked. `check_keys`
and `check_ranges` hold a config to this schema (jaxrlhf/spec.py runs them, then builds the
typed specs); a problem is a `ConfigError`: one line naming the field (`field: problem`).
"""

import contextlib
import difflib
import enum
import functools
import math
import operator
import re
from collections.abc import Mapping

from ml_collections import ConfigDict

from jaxrlhf.algorithms import registry


class ConfigError(ValueError):
    """A config that cannot work, reported as one line naming the field (no traceback)."""


# What library validation raises for bad input; anything else is a bug and keeps its traceback.
_EXPECTED = (ValueError, TypeError, KeyError, LookupError, OSError, ImportError)


@contextlib.contextmanager
def field(name: str):
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
    head = re.match(r"([a-z_]+(?:\.[a-z_]+)*)(=|:| )", text)
    # "tokenizer has 272 ids" is prose, "placement.allocation has" is not
    return bool(head) and (head.group(2) != " " or "." in head.group(1)) and (
        unknown_key(head.group(1)) is None)


def enum_value(kind: type[enum.Enum] | Mapping, value: str, field: str):
    """The member of enum `kind` (or the entry of mapping `kind`) named `value`; else a
    ConfigError naming the field and the options."""
    options = kind if isinstance(kind, Mapping) else {m.value: m for m in kind}
    if value not in options:
        raise ConfigError(f"{field}={value!r} is not one of: {', '.join(options)}")
    return options[value]


RENAMED_KEYS = {"env.class": "env.name"}  # old key -> its name now
REWARD_KINDS = {"function": False, "model": True}  # reward.kind, cost.kind: scored by a model?


def unknown_key(path: str) -> str | None:
    """The error line of a dotted key that is not in the schema, with the closest existing key
    as a hint ("rollout.batchsize: unknown config key (did you mean rollout.batch_size?); ..."),
    or None when the key exists."""
    if path in RENAMED_KEYS:
        return f"{path}: renamed to {RENAMED_KEYS[path]}"
    node, done = base_config(), []
    for part in path.split("."):
        if not isinstance(node, ConfigDict) or part not in node:
            keys = list(node.keys()) if isinstance(node, ConfigDict) else []
            close = difflib.get_close_matches(part, keys, n=1)
            hint = f" (did you mean {'.'.join(done + close)}?)" if close else ""
            return f"{path}: unknown config key{hint}; every key is in jaxrlhf/schema.py"
        node = node[part]
        done.append(part)
    return None


def model(size: str = "tiny") -> ConfigDict:
    return ConfigDict({
        "size": size,  # a name in jaxrlhf.models.sizes.SIZES, used when `path` is empty
        "path": "",  # a local Hugging Face model directory
        "dtype": "float32",  # compute dtype
        "param_dtype": "float32",
        "scan_layers": True,
        "remat": "none",  # none | dots | full
        # auto | xla | cudnn | pallas (jaxrlhf/models/attention.py); auto: XLA on CPU, cuDNN
        # on GPU (XLA where cuDNN cannot take the shapes/dtype), Pallas kernels on TPU
        "attention": "auto",
        # LoRA (actor only; jaxrlhf/models/lora.py): rank > 0 freezes the model and trains
        # rank-r adapters on the `targets` projections of every layer, scaled by alpha / rank
        "lora": {"rank": 0, "alpha": 16.0, "targets": "q_proj,k_proj,v_proj,o_proj"},
        # A model with experts (actor only; jaxrlhf/algorithms/routing.py): auto | on | off.
        # on: the log-prob calls and the train step use the experts the rollout chose for
        # each token (routing replay); off: they route afresh; either way the rollout's
        # choice travels with the rows and actor/routing_mismatch is logged. auto: on for
        # synchronous RL runs, off where the rows reach the trainer another way (async RL,
        # multi-turn, offline batches)
        "moe": {"replay_routing": "auto"},
    })


def optimizer(lr: float) -> ConfigDict:
    return ConfigDict({
        "lr": lr, "warmup_steps": 0, "min_lr_ratio": 1.0, "b1": 0.9, "b2": 0.95, "eps": 1e-8,
        "weight_decay": 0.0, "max_grad_norm": 1.0, "fp32_master": False,
    })


def base_config() -> ConfigDict:
    """Every key with its default: the shared sections, then those the algorithms own."""
    config = _shared()
    for section in registry.sections():
        config[section.name] = ConfigDict(dict(section.defaults))
    return config


def _shared() -> ConfigDict:
    return ConfigDict({
        "algorithm": registry.DEFAULT,  # a name of jaxrlhf/algorithms/registry.py's `names()`
        "seed": 0,
        "steps": 40,  # RL (or offline) training steps
        "cpu_devices": 8,  # virtual devices when running on the CPU backend
        "workdir": "",  # empty: a fresh temporary directory
        "checkpoint": {  # orbax checkpoints in workdir/checkpoints; a rerun resumes the latest
            "every": 20,  # steps between saves, also of offline runs and of the warm start (which
            # has its own, in checkpoints/warm_start); 0 = only at the end and on Ctrl-C/SIGTERM
            "keep": 3,  # newest checkpoints kept
            "async_save": True,  # write files in the background while training goes on
            # auto: resume only checkpoints this same run wrote (fingerprint), else refuse;
            # never: start afresh (old checkpoints moved aside); force: resume regardless
            "resume": "auto",
        },
        "nan_policy": "stop",  # NaN/inf loss or grad norm: stop (last checkpoint kept) | skip
        "compile": {
            # JAX's persistent compilation cache: every executable a run compiles is kept here
            # and loaded by the next run that compiles the same program (a rerun, a restart
            # after preemption); "" = off. JAX_COMPILATION_CACHE_DIR in the environment wins.
            "cache_dir": "~/.cache/jaxrlhf/xla",
        },
        "models": {
            "actor": model(),
            "critic": model(),
            "ref": model(),
            "reward": model(),
            "cost": model(),
            "cost_critic": model(),  # Safe-RLHF's value model of the cost
        },
        "reward": {
            "kind": "function",  # function | model
            "function": "exact_match",  # a built-in name or "module.path:function"
            "timeout": 5.0,  # seconds per call; a call past it scores 0 and is counted
            "workers": 2,
            # a step whose calls fail (raise, hang, bad value) more often than this stops the
            # run with the function's error, rather than training on zeros
            "max_error_rate": 0.5,
            # RL: scores standardised by their running mean/std over the run (reward model
            # or function), then clipped to ±clip (0 = no clipping); jaxrlhf/algorithms/reward_norm.py
            "normalize": False,
            "clip": 0.0,
        },
        # Multi-turn rollouts (the algorithms of Capability.MULTITURN): the policy and this
        # environment take turns
        # (jaxrlhf/data/environments.py); its rewards replace `reward`. Empty = single turns.
        "env": {
            # the environment's class: a built-in name ("tools": Qwen3's tool calls,
            # "tools_llama3") or "module.path:Class" / "/path/file.py:Class" (not "class", a
            # Python keyword, which --config.env.class= could not parse)
            "name": "",
            "max_turns": 4,  # policy turns per trajectory; rollout.max_new_tokens: its tokens
            "timeout": 10.0,  # seconds per reset/step call; past it the trajectory scores 0
            "workers": 2,
            "max_error_rate": 0.5,  # share of a step's trajectories the environment may fail
        },
        "tokenizer": "byte",  # "byte" or a directory with tokenizer.json
        # Every model role starts from its own Hugging Face directory (models.<role>.path);
        # a role without one is an error before compiling (the big configs set this).
        "require_model_paths": False,
        "data": {
            "train_path": "",  # JSONL/parquet prompt rows; empty = the built-in task
            "eval_path": "",
            "sft_path": "",
            "preference_path": "",  # DPO / reward modelling pairs; empty = the built-in task's
            "preference_eval_path": "",  # held-out pairs; empty = the last preference_holdout
            "preference_holdout": 200,  # pairs of preference_path (never trained on)
            # prompts longer than rollout.max_prompt_len, found when the data loads (before
            # compiling): error | drop | truncate_left (keep the last max_prompt_len tokens)
            "long_prompts": "error",
            # auto: prompts (and `messages` rows) are rendered with the tokenizer's chat
            # template, with the generation prompt, when it has one | none: never
            "chat_template": "auto",
            "task": {  # the built-in task, used when train_path is empty
                "kind": "reverse",  # reverse (digit reversal) | arithmetic | tool_arithmetic | lookup
                "num_digits": 4, "num_operands": 2, "ops": "+",  # ops/operands: arithmetic only
                "num_train": 2000, "num_eval": 200, "num_sft": 1000, "sft_noise": 0.6, "seed": 0,
            },
        },
        "rollout": {
            "batch_size": 32,  # prompts per step (offline: pairs or SFT rows per step)
            "group_size": 1,  # responses per prompt (GRPO: >= 2)
            "max_prompt_len": 16,
            "max_new_tokens": 8,
            "temperature": 1.0,
            "top_k": 0,
            "top_p": 1.0,
            "force_max_length": False,  # ignore EOS and always generate max_new_tokens (bench)
            # The responses' expected mean length: train steps and inference pack sequences
            # (engine/packing.py), so the planner prices their tokens, not max_new_tokens'
            # padded rows. 0: max_new_tokens (every response runs to the limit).
            "expected_new_tokens": 0.0,
        },
        # Policy-gradient settings shared by the RL algorithms (clipping, updates per step; β
        # and its controller where the KL penalty is in the reward; GAE for those with a
        # critic); each algorithm's `Registration.reads` says whether it reads them.
        "ppo": {
            "gamma": 1.0, "lam": 0.95, "kl_coef": 0.05, "kl_adaptive": False, "kl_target": 6.0,
            "kl_horizon": 10000.0, "kl_in_reward": True, "whiten_advantages": True,
            "clip_eps": 0.2, "value_clip": 0.2, "entropy_coef": 0.0, "mini_batches": 1,
            "epochs": 1,
            # Mismatch correction (Capability.MISMATCH_CORRECTION): > 0 recomputes the
            # response log-probs with the training engine before the update (actor_prox),
            # weighs each token's loss by min(π_train / π_generation, tis_cap) (truncated
            # importance sampling) and logs actor/mismatch_mean and actor/mismatch_max
            # (|Δ log p| between generation and training) every step. 0 = off.
            "tis_cap": 0.0,
        },
        "optimizer": {"actor": optimizer(1e-3), "critic": optimizer(1e-3),
                      "cost_critic": optimizer(1e-3), "reward": optimizer(1e-3)},
        "micro_batches": 1,  # per optimizer update; or use a token budget
        "micro_batch_tokens": 0,  # >0: token budget of a micro-batch (its packed rows' slots)
        # Held-out evaluation (data.eval_path or the task's eval rows), jaxrlhf/run/evaluate.py:
        # greedy reward (and accuracy when rows have answers) before and after RL, and every
        # `every` steps (0 = never) in metrics.jsonl / TensorBoard as eval/*; with samples = n,
        # also pass@1, pass@n and mean@n of n sampled responses per prompt.
        "eval": {"every": 0, "samples": 0, "max_prompts": 0},
        "warm_start": {  # supervised warm start of the actor before RL (0 steps = none)
            "sft_steps": 0, "batch_size": 32, "lr": 3e-3,
        },
        "placement": {
            # colocate | standalone | split | interleave | disaggregate | manual | auto
            "kind": "colocate",
            "cluster": "",  # auto: the cluster file the planner searches for, e.g. meshes/cpu_8.py
            "strategy": "",  # colocate's parallel degrees, e.g. d2f2t2; empty = d<devices>
            "allocation": "",  # manual: "actor_gen=0-3:d4,ref_inf=4-7:d2t2,..."
            # Frozen models (ref, reward) wait in host memory between their calls when they
            # share devices with other models.
            "offload_frozen": True,
            # Trained models (actor, critic) move their parameters and optimizer state to host
            # memory while other models' calls run on their devices, and back for their own.
            "offload_trainable": False,
            # disaggregate: generation replicas (FlexRLHF's shadow actors), each on a device
            # block of its own with its own weights copy; > 1 runs one process per replica
            # plus the trainer's (launch/local.sh 1+R ...) with async_rl.max_staleness > 0.
            "gen_replicas": 1,
            # auto: after the input checks, compile the best few searched plans for this
            # job's devices and run the best one whose every call fits by XLA's account
            # (calibration/compile_check.py); off: the searched plan runs as priced.
            "compile_check": False,
        },
        "logging": {  # metrics.jsonl and TensorBoard always; jaxrlhf/metrics.py
            # Weights & Biases beside them when `project` is set (pip install 'jaxrlhf[wandb]');
            # name: the run's display name (empty: W&B picks one); mode: online | offline
            # (written under workdir/wandb without network; `wandb sync` uploads it later)
            "wandb": {"project": "", "name": "", "mode": "online"},
        },
        "async_rl": {  # asynchronous RL (AReaL): generation runs ahead of training
            # η: a batch is trained only if its oldest token was sampled at most η policy
            # versions ago, and generation waits when it runs further ahead. 0 = the
            # synchronous loop (generate, then train, every step). Capability.ASYNC only.
            "max_staleness": 0,
            "decoupled": True,  # η > 0: AReaL's decoupled PPO objective (clip vs π_prox)
            "behav_imp_weight_cap": 0.0,  # decoupled: drop tokens with π_prox/π_behav above (0 = off)
            "chunk_tokens": 8,  # tokens decoded between checks for new weights (interruptions)
            # A row still decoding when new weights come: continue (its KV cache recomputed
            # under them, its earlier tokens keep their versions) | restart (aborted, decoded
            # anew) | finish (under its old weights; new rows wait for it)
            "on_new_version": "continue",
            # What each new version sends to generation: full (every tensor) | delta (only the
            # tensors that changed since the generator's version, compared bit for bit on the
            # trainer, which keeps a copy of the version it last sent; with LoRA only the
            # adapters travel; jaxrlhf/parallel/delta.py)
            "weight_sync": "full",
        },
    })


def check_keys(config: ConfigDict, base: ConfigDict | None = None, prefix: str = "") -> None:
    """Every key exists in the schema (`base_config()`), with a value of the same type."""
    base = base_config() if base is None else base
    for key, value in config.items():
        name = f"{prefix}{key}"
        if key not in base:
            raise ConfigError(unknown_key(name))
        want = base[key]
        if isinstance(want, ConfigDict):
            if not isinstance(value, ConfigDict):
                raise ConfigError(f"{name}: must be a section, got {value!r}")
            check_keys(value, want, f"{name}.")
        elif not isinstance(value, type(want)) or isinstance(value, bool) != isinstance(want, bool):
            if not (isinstance(want, float) and isinstance(value, int) and not isinstance(value, bool)):
                raise ConfigError(f"{name}={value!r}: must be a {type(want).__name__}")


# (relation every key must satisfy, its bound, the keys)
_BOUNDS = (
    (">=", 1, ("steps", "cpu_devices", "rollout.batch_size", "rollout.group_size",
               "rollout.max_prompt_len", "rollout.max_new_tokens", "reward.workers",
               "ppo.mini_batches", "ppo.epochs", "micro_batches", "warm_start.batch_size",
               "async_rl.chunk_tokens", "placement.gen_replicas", "env.max_turns",
               "env.workers")),
    (">=", 0, ("rollout.temperature", "rollout.top_k", "reward.max_error_rate",
               "micro_batch_tokens", "warm_start.sft_steps", "reward.clip",
               "async_rl.max_staleness", "async_rl.behav_imp_weight_cap", "eval.every",
               "eval.samples", "eval.max_prompts", "ppo.tis_cap",
               "rollout.expected_new_tokens")),
    (">", 0, ("rollout.top_p", "reward.timeout", "env.timeout", "warm_start.lr",
              "optimizer.actor.lr", "optimizer.critic.lr")),
    ("<=", 1, ("rollout.top_p", "reward.max_error_rate", "env.max_error_rate")),
    (">=", 0, ("seed",)),
    ("<", 2**32, ("seed",)),  # PRNG seeds are unsigned 32-bit
    # a discount or GAE λ outside [0, 1] weighs the future more than the present (or flips
    # its sign)
    (">=", 0, ("ppo.gamma", "ppo.lam")),
    ("<=", 1, ("ppo.gamma", "ppo.lam")),
)


def _bounds():
    """(relation, bound, dotted keys) of the shared sections, then of the algorithms'."""
    yield from _BOUNDS
    for section in registry.sections():
        for relation, bound, keys in section.bounds:
            yield relation, bound, tuple(f"{section.name}.{k}" for k in keys)


_RELATIONS = {">=": operator.ge, ">": operator.gt, "<=": operator.le, "<": operator.lt}


def _check_finite(config: ConfigDict, prefix: str = "") -> None:
    """Every float of the config is a finite number (`inf` passes every `>=` bound)."""
    for key, value in config.items():
        if isinstance(value, ConfigDict):
            _check_finite(value, f"{prefix}{key}.")
        elif isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"{prefix}{key}={value}: must be a finite number")


def check_ranges(config: ConfigDict) -> None:
    """Every float is finite, every number in its range (`_bounds`); the mini-batches divide
    the rollout batch."""
    _check_finite(config)
    for relation, bound, names in _bounds():
        for name in names:
            value = functools.reduce(getattr, name.split("."), config)
            if not _RELATIONS[relation](value, bound):
                raise ConfigError(f"{name}={value}: must be {relation} {bound}")
    if 0 < config.ppo.tis_cap < 1:  # min(ratio, cap) would scale every on-policy token down
        raise ConfigError(f"ppo.tis_cap={config.ppo.tis_cap}: must be 0 (off) or >= 1 (a cap "
                          "below 1 weighs every on-policy token's loss down to it)")
    batch = config.rollout.batch_size * config.rollout.group_size
    if batch % config.ppo.mini_batches:
        raise ConfigError(f"ppo.mini_batches={config.ppo.mini_batches} does not divide the "
                          f"rollout batch of {batch}")
    _check_expected_new_tokens(config.rollout)


def _check_expected_new_tokens(r: ConfigDict) -> None:
    """rollout.expected_new_tokens is a mean of lengths that run to at most max_new_tokens,
    and exactly to it when generation is forced to."""
    expected = r.expected_new_tokens
    if expected > r.max_new_tokens:
        raise ConfigError(f"rollout.expected_new_tokens={expected}: must be <= "
                          f"rollout.max_new_tokens={r.max_new_tokens}")
    if r.force_max_length and expected not in (0, r.max_new_tokens):
        raise ConfigError(f"rollout.expected_new_tokens={expected}: every response runs to "
                          f"rollout.max_new_tokens={r.max_new_tokens} "
                          "(rollout.force_max_length)")
