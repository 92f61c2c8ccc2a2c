"""Every key set but not read by the run is refused (issue 46 item 3), tried by an oracle that
knows nothing of the rule (`jaxrlhf/run/unread.py`).

For every registered algorithm and every key of the schema, the key is set alone to a valid
non-default value (made from its default's type and the schema's ranges). The run must then
either refuse it in one line naming the key, before anything compiles (`run_spec`, then the
check `run/check.py` runs next), or build a typed `RunSpec` that differs from the one of the
unset config. The spec is compared by value, down into the closures of its loss functions,
leaving out `config_json` (the config's own text, which differs whenever a key does).

A refusal by the unread-key check of a key whose value did reach the spec would refuse a key
the run reads, unless the spec only copies it (`COPIED`, each with where it is read).

A value the oracle makes must be valid: every key must change the spec under at least one
algorithm (with its feature switched on where the key belongs to a feature, `FEATURES`), or
be named with the reason: in `READ_NOWHERE` (tried, and refused in every run) or `SKIPPED`
(not tried here).
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import importlib
import json
import pathlib
import types

import numpy as np
import pytest
from ml_collections import ConfigDict

from jaxrlhf.algorithms import registry
from jaxrlhf.run import unread
from jaxrlhf.schema import ConfigError, base_config
from jaxrlhf.spec import run_spec

# Keys the oracle does not try, and why.
SKIPPED = {
    "algorithm": "the variable of the loop: each value is its own run",
    "workdir": "read by the entry point (train.py), not by the spec: the directory it writes to",
    "cpu_devices": "read by the entry point (train.py) before JAX starts: the virtual devices",
}
# Values the type of the default cannot give: strings that must name something.
CHOICES = {
    "placement.kind": "standalone", "placement.cluster": "meshes/cpu_8.py",
    "placement.strategy": "d4t2", "placement.allocation": "actor_gen=0-7:d8",
    "nan_policy": "skip", "checkpoint.resume": "never", "reward.kind": "model",
    "reward.function": "length", "data.long_prompts": "drop", "data.chat_template": "none",
    "data.task.kind": "arithmetic", "data.task.ops": "+-", "env.name": "tools",
    "logging.wandb.mode": "offline", "async_rl.on_new_version": "restart",
    "async_rl.weight_sync": "delta",
    "compile.cache_dir": "/tmp/jaxrlhf-unread-cache",
    "tokenizer": "/tmp/jaxrlhf-unread-tokenizer", "cost.kind": "model",
    "grpo.aggregation": "token_mean", "grpo.kl_estimator": "k1",
}
MODEL_CHOICES = {"size": "small", "dtype": "bfloat16", "param_dtype": "bfloat16",
                 "remat": "full", "attention": "xla", "targets": "q_proj",
                 "replay_routing": "off"}
# Switches that turn a feature on, so its keys have a run that reads them (validity check):
# the first whose text is part of the key applies.
FEATURES = {
    "env.": {"env.name": "tools"},
    "async_rl.": {"async_rl.max_staleness": 1},
    "warm_start.": {"warm_start.sft_steps": 2},
    "models.actor.lora.": {"models.actor.lora.rank": 4},
    "models.actor.moe.": {"models.actor.size": "tiny-moe", "models.ref.size": "tiny-moe"},
    "logging.wandb.": {"logging.wandb.project": "p"},
    "data.task.num_operands": {"data.task.kind": "arithmetic"},
    "data.task.ops": {"data.task.kind": "arithmetic"},
    "models.cost.": {"cost.kind": "model"},
    "placement.allocation": {"placement.kind": "manual"},
    "placement.cluster": {"placement.kind": "auto"},
    "placement.compile_check": {"placement.kind": "auto", "placement.cluster": "meshes/cpu_8.py"},
    "placement.gen_replicas": {"placement.kind": "disaggregate", "async_rl.max_staleness": 1},
}
# Keys the spec copies whatever the run reads (the unread-key check refuses them where unread,
# so a refusal with a changed spec is right for these only).
COPIED = {
    "async_rl.chunk_tokens": "AsyncRLSpec: read by the rollout workers of an asynchronous run",
    "async_rl.on_new_version": "AsyncRLSpec: read by the rollout workers of an asynchronous run",
    "async_rl.weight_sync": "AsyncRLSpec: read by the publishes of an asynchronous run",
    "eval.every": "EvalSpec: offline algorithms evaluate before and after training only",
    "eval.samples": "EvalSpec: offline algorithms evaluate greedily",
    "optimizer.actor.max_grad_norm": "WarmStartSpec's optimizer: read with a warm start only",
    "placement.allocation": "PlacementSpec: read with placement.kind=manual only",
    "placement.cluster": "PlacementSpec: read with placement.kind=auto only",
    "placement.compile_check": "PlacementSpec: read with placement.kind=auto only",
    "placement.strategy": "PlacementSpec: read with placement.kind=colocate only",
    "warm_start.batch_size": "WarmStartSpec: read with a warm start only",
    "warm_start.lr": "WarmStartSpec: read with a warm start only",
}
# Keys that no run reads at the value tried: refused wherever set (the oracle still tries them).
READ_NOWHERE = {
    "models.ref.size": "the reference is a copy of the actor, or models.ref.path's model: a "
                       "size other than models.actor.size is never read",
    **{f"models.{role}.lora.{k}": "LoRA adapts the actor only: a rank is refused for other "
                                  "roles, and their other lora keys at rank 0"
       for role in ("critic", "ref", "reward", "cost", "cost_critic")
       for k in ("rank", "alpha", "targets")},
    **{f"models.{role}.moe.replay_routing": "the rollout's experts are replayed as the actor's "
                                            "key says (the reference's calls included): any "
                                            "other role's value is refused"
       for role in ("critic", "ref", "reward", "cost", "cost_critic")},
}


def _leaves(node: ConfigDict, prefix: str = "") -> dict[str, object]:
    out = {}
    for key, value in node.items():
        if isinstance(value, ConfigDict):
            out |= _leaves(value, f"{prefix}{key}.")
        else:
            out[f"{prefix}{key}"] = value
    return out


def _bound_ok(key: str, value) -> bool:
    from jaxrlhf.schema import _RELATIONS, _bounds
    return all(_RELATIONS[rel](value, bound) for rel, bound, keys in _bounds() if key in keys)


def _candidates(key: str, default, model_dir: str) -> list:
    """Values other than `default`, from its type and the schema's ranges, the likeliest valid
    first (`_valid` picks one that some run accepts)."""
    last = key.rsplit(".", 1)[-1]
    if key in CHOICES:
        return [CHOICES[key]]
    if key.startswith("models.") and last == "path":
        return [model_dir]
    if key.startswith("models.") and last in MODEL_CHOICES:
        return [MODEL_CHOICES[last]]
    if isinstance(default, bool):
        return [not default]
    if isinstance(default, int):
        candidates = [default + 1, default * 2, default - 1]
    elif isinstance(default, float):
        candidates = [default / 2, default + 0.5, 0.25, 2.0] if default else [0.25, 2.0]
    elif isinstance(default, str):
        return [default + "x" if default else "x"]
    else:
        raise AssertionError(f"{key}: no value for a {type(default).__name__}")
    return [v for v in candidates if v != default and _bound_ok(key, v)]


def _valid(key: str, candidates: list) -> object:
    """The first candidate that changes the spec of some algorithm's run (with the key's
    feature on); the first candidate if none does (the test then names the key)."""
    for value in candidates:
        for algorithm in registry.names():
            if _outcome(algorithm, _feature(key), key, value)[0] == "changed":
                return value
    return candidates[0]


def _digest(obj, stack=()) -> object:
    """A comparable value of a spec: dataclasses field by field (config_json left out),
    functions by their code and what their closures hold."""
    if id(obj) in stack:
        return "<cycle>"
    stack = (*stack, id(obj))
    d = functools.partial(_digest, stack=stack)
    if isinstance(obj, str | int | float | bool | type(None) | enum.Enum | pathlib.Path):
        return repr(obj)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return (type(obj).__qualname__, tuple((f.name, d(getattr(obj, f.name)))
                                              for f in dataclasses.fields(obj)
                                              if f.name != "config_json"))
    if isinstance(obj, dict | types.MappingProxyType) or hasattr(obj, "items"):
        return tuple(sorted((repr(k), d(v)) for k, v in obj.items()))
    if isinstance(obj, list | tuple | set | frozenset):
        items = [d(v) for v in obj]
        return tuple(sorted(items, key=repr) if isinstance(obj, set | frozenset) else items)
    if isinstance(obj, functools.partial):
        return ("partial", d(obj.func), d(obj.args), d(obj.keywords))
    if isinstance(obj, types.FunctionType):
        cells = tuple(d(c.cell_contents) for c in obj.__closure__ or ())
        return (obj.__qualname__, cells, d(obj.__defaults__), d(obj.__kwdefaults__))
    if isinstance(obj, types.ModuleType | type | types.BuiltinFunctionType):
        return getattr(obj, "__qualname__", getattr(obj, "__name__", repr(obj)))
    if hasattr(obj, "dtype") and hasattr(obj, "shape"):
        return ("array", repr(np.asarray(obj).tolist()), str(obj.dtype))
    if hasattr(obj, "__dict__"):
        return (type(obj).__qualname__, d(vars(obj)))
    return repr(obj)


def _config(algorithm: str, sets: dict) -> ConfigDict:
    config = base_config()
    config.algorithm = algorithm
    for key, value in sets.items():
        *path, last = key.split(".")
        functools.reduce(lambda node, part: node[part], path, config)[last] = value
    return config


@functools.cache
def _base(algorithm: str) -> tuple[tuple[str, object], ...]:
    """What the algorithm's run sets beside the defaults to be valid at all (the group
    algorithms need several responses per prompt)."""
    for sets in ({}, {"rollout.group_size": 4}):
        try:
            run_spec(_config(algorithm, sets))
            return tuple(sets.items())
        except ConfigError:
            continue
    raise AssertionError(f"{algorithm}: no valid base config")


@functools.cache
def _unset(algorithm: str, context: tuple[tuple[str, object], ...]) -> object:
    """The digest of the run without the key tried; None when the context is refused (a
    feature this algorithm does not have)."""
    config = _config(algorithm, {**dict(_base(algorithm)), **dict(context)})
    try:
        spec = run_spec(config)
        unread.check(config, spec)
    except ConfigError:
        assert context, f"{algorithm}: its base config is refused"
        return None
    return _digest(spec)


def _outcome(algorithm: str, context: dict, key: str, value) -> tuple[str, str]:
    """("refused", the line), ("changed" | "same", "") of `key` set to `value` in the run of
    `algorithm` with `context` set, or ("context", "") when that run is refused already;
    ("refused, spec differs", the line) when the unread-key check refuses a key whose value
    reached the spec."""
    context = {k: v for k, v in context.items() if k != key}
    unset = _unset(algorithm, tuple(context.items()))
    if unset is None:
        return "context", ""
    config = _config(algorithm, {**dict(_base(algorithm)), **context, key: value})
    try:
        spec = run_spec(config)
    except ConfigError as e:
        return "refused", str(e)
    differs = _digest(spec) != unset
    try:
        unread.check(config, spec)
    except ConfigError as e:  # a spec that differs: a key read, or one the spec only copies
        return ("refused, spec differs" if differs else "refused"), str(e)
    return ("changed" if differs else "same"), ""


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    """A Hugging Face directory other than the default size (all run_spec reads is its
    config.json)."""
    path = tmp_path_factory.mktemp("hf")
    (path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 300,
        "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0, "max_position_embeddings": 64, "hidden_act": "silu",
        "tie_word_embeddings": False}))
    return str(path)


def _names(line: str, key: str) -> bool:
    """Whether a refusal names `key` or the section it is in (`reward: ...` for reward.clip)."""
    parts = key.split(".")
    return key in line or any(line.startswith(".".join(parts[:i]) + ":")
                              for i in range(1, len(parts)))


def _feature(key: str) -> dict:
    for part, switch in FEATURES.items():
        if part in key and key not in switch:
            return switch
    return {}


def test_every_key_under_every_algorithm_is_read_or_refused(model_dir):
    leaves = _leaves(base_config())
    tried = {k: _valid(k, _candidates(k, v, model_dir)) for k, v in leaves.items()
             if k not in SKIPPED}
    counts = {"refused": 0, "refused, spec differs": 0, "changed": 0, "same": 0, "context": 0}
    silent, unnamed, read_somewhere, copied = [], [], set(), set()
    for algorithm in registry.names():
        for key, value in tried.items():
            contexts = [{}]
            if feature := _feature(key):
                contexts.append(feature)
            for context in contexts:
                outcome, line = _outcome(algorithm, context, key, value)
                counts[outcome] += 1
                if outcome == "same":
                    silent.append(f"{algorithm} {context or ''} {key}={value!r}")
                elif outcome.startswith("refused"):
                    if outcome != "refused":
                        copied.add(key)
                    if "\n" in line or not _names(line, key):
                        unnamed.append(f"{algorithm} {key}: {line}")
                elif outcome == "changed":
                    read_somewhere.add(key)
    print(f"\n{len(tried)} keys x {len(registry.names())} algorithms ({len(SKIPPED)} keys "
          f"skipped): {counts}")
    assert not unnamed, "refusals not one line naming the key:\n" + "\n".join(unnamed)
    assert not silent, f"{len(silent)} set but unread, and accepted:\n" + "\n".join(silent)
    never = sorted(set(tried) - read_somewhere - set(READ_NOWHERE))
    # a refused key that reached the spec is read there, unless the spec only copies it
    assert copied <= set(COPIED), f"refused, though the run reads them: {sorted(copied - set(COPIED))}"
    assert not never, f"keys no run reads (or whose tried value is invalid): {never}"


CONFIGS = sorted(p.stem for p in (pathlib.Path(__file__).parents[1] / "configs").glob("*.py")
                 if p.stem != "__init__")


@pytest.mark.parametrize("arg", [None, "smoke"])
@pytest.mark.parametrize("name", CONFIGS)
def test_shipped_configs_set_only_keys_they_read(name, arg):
    config = importlib.import_module(f"jaxrlhf.configs.{name}").get_config(arg)
    unread.check(config, run_spec(config))


@pytest.mark.parametrize("overrides,expected", [
    ({"data.task.kind": "lookup", "data.task.num_digits": 3},
     "data.task.num_digits=3: data.task.kind=lookup does not read it (LookupTask reads"),
    ({"async_rl.on_new_version": "restart"},
     "async_rl.on_new_version='restart': async_rl.max_staleness=0 (the synchronous loop"),
    ({"async_rl.max_staleness": 1, "async_rl.decoupled": False,
      "async_rl.behav_imp_weight_cap": 5.0},
     "async_rl.behav_imp_weight_cap=5.0: async_rl.decoupled=False"),
    ({"algorithm": "grpo", "rollout.group_size": 4, "ppo.gamma": 0.5},
     "ppo.gamma=0.5: algorithm=grpo does not read it (read by ppo, safe_rlhf)"),
    ({"algorithm": "sft", "ppo.clip_eps": 0.1},
     "ppo.clip_eps=0.1: algorithm=sft does not read ppo.* (read by"),
    ({"optimizer.critic.lr": 0.1, "algorithm": "remax"},
     "optimizer.critic.lr=0.1: this run trains no critic model (algorithm=remax)"),
    ({"reward.kind": "model", "reward.function": "length"},
     "reward.function='length': reward.kind=model (models.reward scores)"),
    ({"algorithm": "dpo", "reward.workers": 4},
     "reward.workers=4: this run scores no reward (algorithm=dpo)"),
    ({"warm_start.lr": 0.1}, "warm_start.lr=0.1: warm_start.sft_steps=0 (no warm start)"),
    ({"logging.wandb.mode": "offline"},
     "logging.wandb.mode='offline': logging.wandb.project is empty"),
])
def test_unread_keys_are_named_in_one_line_before_compiling(overrides, expected, tmp_path):
    """The examples of issue 46 and the rule's other parts, through `check_config`."""
    from jaxrlhf.run.check import check_config
    config = _config(overrides.pop("algorithm", "ppo"), overrides)
    with pytest.raises(ConfigError) as e:
        check_config(config, str(tmp_path))
    assert str(e.value).startswith(expected), str(e.value)
