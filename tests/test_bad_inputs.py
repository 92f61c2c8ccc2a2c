"""Bad inputs: each gives one line naming the field, before anything compiles.

Most cases call the library's check (`run.check.check_config`, `distributed.from_flags`)
directly; a few go through the real `python -m jaxrlhf.train` to see the one-line report and
the exit code 2 (no traceback).
"""

import json
import pathlib
import subprocess
import sys

import jax
import pytest
from ml_collections import ConfigDict

from jaxrlhf.schema import base_config
from jaxrlhf import distributed
from jaxrlhf.run.check import check_config
from jaxrlhf.spec import ConfigError

REPO = pathlib.Path(__file__).resolve().parent.parent
FIXTURES = REPO / "tests/fixtures"
ALL_MFCS = ("actor_gen=0-3:d4,ref_inf=0-3:d4,critic_inf=4-7:d4,actor_train=4-7:d4,"
            "critic_train=4-7:d4")


def _llama_dir(path: pathlib.Path, vocab_size: int) -> pathlib.Path:
    """A Hugging Face directory: config.json, and a weights file the checks only look for."""
    path.mkdir()
    (path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": vocab_size,
        "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0, "max_position_embeddings": 64, "hidden_act": "silu",
        "tie_word_embeddings": False}))
    (path / "model.safetensors").write_bytes(b"")
    return path


def _rows_file(path: pathlib.Path, lines: list[str]) -> str:
    path.write_text("".join(f"{line}\n" for line in lines))
    return str(path)


# (id, overrides as {dotted key: value} or a function of tmp_path, expected message part)
CASES = [
    ("unknown_key", {"rollout.batchsize": 4},
     "rollout.batchsize: unknown config key (did you mean rollout.batch_size?)"),
    ("wrong_type", {"steps": "ten"}, "steps='ten': must be a int"),
    ("unknown_algorithm", {"algorithm": "ppo2"}, "algorithm='ppo2' is not one of"),
    ("negative_steps", {"steps": -1}, "steps=-1: must be >= 1"),
    ("top_p_above_one", {"rollout.top_p": 1.5}, "rollout.top_p=1.5: must be <= 1"),
    ("bad_strategy_letter", {"placement.strategy": "d2x4"},
     "placement.strategy: MFC 'actor_gen' (0-7:d2x4): unknown axis letter 'x'"),
    ("strategy_devices_do_not_match", {"placement.strategy": "d3"},
     "strategy '0-7:d3' uses 3 devices but range 0-7 has 8"),
    ("tensor_does_not_divide_heads", {"placement.strategy": "t8"},
     "tensor=8 does not divide the model's num_heads=4"),
    ("batch_does_not_split", {"rollout.batch_size": 12},
     "splits the batch 8 ways, which does not divide its batch of 12"),
    ("mini_batches_do_not_divide", {"ppo.mini_batches": 3},
     "ppo.mini_batches=3 does not divide the rollout batch of 32"),
    ("expected_new_tokens_above_max", {"rollout.expected_new_tokens": 9},
     "rollout.expected_new_tokens=9: must be <= rollout.max_new_tokens=8"),
    ("expected_new_tokens_negative", {"rollout.expected_new_tokens": -1.0},
     "rollout.expected_new_tokens=-1.0: must be >= 0"),
    ("expected_new_tokens_but_forced",
     {"rollout.expected_new_tokens": 4.5, "rollout.force_max_length": True},
     "rollout.expected_new_tokens=4.5: every response runs to rollout.max_new_tokens=8"),
    ("warm_start_batch_does_not_split", {"warm_start.sft_steps": 5, "warm_start.batch_size": 12},
     "warm_start.batch_size=12: does not split 8 ways"),
    ("micro_batches_separate_pairs",
     {"algorithm": "dpo", "rollout.batch_size": 6, "micro_batches": 4, "placement.kind": "manual",
      "placement.allocation": "ref_inf=0-1:d1t2,actor_train=0-1:d1t2"},
     "micro_batches: MFC 'actor_train': the number of micro-batches=4 must divide the 6 "
     "preference pairs"),
    ("micro_batches_do_not_split", {"micro_batches": 3},
     "micro_batches: MFC 'actor_train': 3 micro-batches do not split 32 rows into equal parts"),
    ("warm_start_micro_batches_do_not_split",
     {"warm_start.sft_steps": 5, "warm_start.batch_size": 16, "micro_batches": 4},
     "micro_batches: warm start (warm_start.batch_size=16): 4 micro-batches do not split 16 "
     "rows"),
    ("unknown_resume_mode", {"checkpoint.resume": "maybe"},
     "checkpoint.resume='maybe': must be one of ['auto', 'never', 'force']"),
    ("unknown_placement_kind", {"placement.kind": "spread"},
     "placement.kind='spread' is not one of: colocate"),
    ("unknown_on_new_version",
     {"async_rl.max_staleness": 1, "async_rl.on_new_version": "pause"},
     "async_rl.on_new_version='pause' is not one of: continue, restart, finish"),
    ("allocation_missing_an_mfc",
     {"placement.kind": "manual", "placement.allocation": ALL_MFCS.rsplit(",", 1)[0]},
     "placement.allocation has no layout for MFC(s) ['critic_train']"),
    ("allocation_unknown_mfc",
     {"placement.kind": "manual", "placement.allocation": ALL_MFCS + ",critic_gen=0-3:d4"},
     "placement.allocation names unknown MFCs: ['critic_gen']"),
    ("allocation_entry_malformed",
     {"placement.kind": "manual", "placement.allocation": "actor_gen0-3:d4"},
     "placement.allocation entry 'actor_gen0-3:d4' is not MFC=RANGE:STRATEGY"),
    ("allocation_out_of_bounds",
     {"placement.kind": "manual", "placement.allocation": ALL_MFCS.replace("0-3:d4", "8-11:d4", 1)},
     "MFC 'actor_gen' (8-11:d4): device range 8-11 is out of bounds for 8 devices"),
    ("allocation_unaligned",
     {"placement.kind": "manual", "placement.allocation": ALL_MFCS.replace("0-3:d4", "1-2:d2", 1)},
     "device range 1-2 is not aligned"),
    ("auto_without_cluster", {"placement.kind": "auto"},
     "placement.kind=auto needs placement.cluster"),
    ("unknown_model_size", {"models.actor.size": "huge"},
     "models.actor.size: unknown model size 'huge'"),
    ("unknown_dtype", {"models.critic.dtype": "float8"}, "models.critic.dtype='float8' is not one"),
    ("missing_model_path", {"models.actor.path": "/no/such/model"},
     "models.actor.path='/no/such/model' has no config.json"),
    ("model_path_without_weights",
     lambda tmp: {"models.actor.path": _no_weights(tmp)},
     "no model.safetensors or model.safetensors.index.json"),
    ("tokenizer_model_vocab_mismatch",
     lambda tmp: {"models.actor.path": str(_llama_dir(tmp / "m", 128))},
     "models.actor: tokenizer has 272 ids but the model's embedding has only 128 rows"),
    ("missing_tokenizer", {"tokenizer": "/no/such/tokenizer"},
     "tokenizer: no tokenizer.json in /no/such/tokenizer"),
    ("reward_model_without_path", {"reward.kind": "model"},
     "models.reward.path: reward.kind=model needs a trained Hugging Face model directory"),
    ("unknown_builtin_reward", {"reward.function": "exact"},
     "reward.function: unknown reward 'exact'"),
    ("reward_module_missing", {"reward.function": "no_such_module:score"},
     "reward.function: No module named 'no_such_module'"),
    ("reward_function_missing", {"reward.function": f"{FIXTURES / 'reward_fns.py'}:nope"},
     "has no function 'nope'"),
    ("prompt_longer_than_max_prompt_len",
     lambda tmp: {"data.train_path": _rows_file(tmp / "long.jsonl", [
         '{"prompt": "12>", "answer": "21"}', '{"prompt": "' + "9" * 40 + '>", "answer": "1"}'])},
     "data.train_path: row 1: prompt of 42 tokens exceeds rollout.max_prompt_len=16 (set "
     "data.long_prompts=drop or truncate_left)"),
    ("unknown_long_prompts_policy", {"data.long_prompts": "cut"},
     "data.long_prompts='cut': use one of error | drop | truncate_left"),
    ("unknown_task_kind", {"data.task.kind": "sort"}, "data.task.kind='sort' is not one of"),
    ("bad_task_setting", {"data.task.num_digits": 1}, "data.task: num_digits=1 must be >= 2"),
    ("data_row_not_json",
     lambda tmp: {"data.train_path": _rows_file(tmp / "t.jsonl", ['{"prompt": "12>"}', "{oops"])},
     "data.train_path: {tmp}/t.jsonl:line 2: is not valid JSON"),
    ("data_row_field_wrong_type",
     lambda tmp: {"data.train_path": _rows_file(tmp / "t.jsonl", ['{"prompt": 12}'])},
     "data.train_path: {tmp}/t.jsonl:line 1: field 'prompt' is a int, not a string"),
    ("too_few_rows_for_a_batch",
     lambda tmp: {"data.train_path": _rows_file(tmp / "t.jsonl", ['{"prompt": "12>"}'] * 4)},
     "rollout.batch_size=32: more than the 4 rows of"),
    ("warm_start_without_sft_rows",
     lambda tmp: {"data.train_path": _rows_file(tmp / "t.jsonl", ['{"prompt": "12>"}'] * 40),
                  "warm_start.sft_steps": 5},
     "warm_start.sft_steps=5: there are no SFT rows (set data.sft_path"),
    ("warm_start_without_task_demonstrations",
     {"warm_start.sft_steps": 5, "data.task.num_sft": 0},
     "warm_start.sft_steps=5: there are no SFT rows (set data.task.num_sft > 0, or "
     "warm_start.sft_steps=0)"),
    # placement.compile_check resolves the next-best plans too, but compiles only after every
    # check (calibration/compile_check.py): the data's error is still one line, and nothing
    # compiled.
    ("compile_check_after_the_checks",
     {"warm_start.sft_steps": 5, "data.task.num_sft": 0, "placement.kind": "auto",
      "placement.cluster": "meshes/cpu_8.py", "placement.compile_check": True},
     "warm_start.sft_steps=5: there are no SFT rows (set data.task.num_sft > 0, or "
     "warm_start.sft_steps=0)"),
    ("too_few_sft_rows_for_a_warm_start_batch",
     {"warm_start.sft_steps": 5, "data.task.num_sft": 4},
     "warm_start.batch_size=32: more than the 4 SFT rows of the built-in task"),
    ("too_few_task_rows_for_a_batch", {"data.task.num_train": 8, "data.task.num_sft": 8},
     "rollout.batch_size=32: more than the 8 rows of the built-in task"),
    ("unwritable_workdir", lambda tmp: {"workdir": str(_file(tmp) / "sub")}, "workdir: "),
    ("cache_dir_a_file", lambda tmp: {"compile.cache_dir": str(_file(tmp))},
     "compile.cache_dir='{tmp}/a_file': not a directory"),
]


def _no_weights(tmp: pathlib.Path) -> str:
    path = _llama_dir(tmp / "m", 512)
    (path / "model.safetensors").unlink()
    return str(path)


def _file(tmp: pathlib.Path) -> pathlib.Path:
    path = tmp / "a_file"
    path.write_text("")
    return path


def _config(overrides: dict) -> tuple[ConfigDict, str]:
    values = base_config().to_dict()
    workdir = overrides.pop("workdir", None)
    for key, value in overrides.items():
        *parents, last = key.split(".")
        node = values
        for part in parents:
            node = node[part]
        node[last] = value  # plain dicts: a config file can hold any key and type
    return ConfigDict(values), workdir


@pytest.fixture(scope="module")
def compiles():
    """Counts XLA compilations (the checks must not compile anything), those answered by the
    suite's persistent compilation cache (tests/conftest.py) included."""
    count = [0]

    def listener(event, *_args, **_kwargs):
        if event in ("/jax/core/compile/backend_compile_duration",
                     "/jax/compilation_cache/cache_retrieval_time_sec"):
            count[0] += 1

    jax.monitoring.register_event_duration_secs_listener(listener)
    yield count
    jax.monitoring.unregister_event_duration_listener(listener)


@pytest.mark.parametrize("overrides,expected", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_config_is_one_line_naming_the_field(overrides, expected, tmp_path, compiles):
    overrides = overrides(tmp_path) if callable(overrides) else dict(overrides)
    config, workdir = _config(overrides)
    before = compiles[0]
    with pytest.raises(ConfigError) as info:
        check_config(config, workdir or str(tmp_path / "work"))
    message = str(info.value)
    assert expected.format(tmp=tmp_path) in message
    assert "\n" not in message
    assert compiles[0] == before, "a check compiled something"


def test_reward_modelling_warm_start_is_checked_on_its_layout(tmp_path):
    """Reward modelling warm-starts the actor on the reward model's layout (there is no actor
    call): a warm-start batch that layout cannot split is one line, before anything runs."""
    from jaxrlhf.configs import rw_tiny

    config = rw_tiny.get_config()
    config.warm_start.batch_size = 12
    config.placement.strategy = "d8"
    with pytest.raises(ConfigError, match="warm_start.batch_size=12: does not split 8 ways over "
                       "the trained model's layout"):
        check_config(config, str(tmp_path))


def test_the_tiny_configs_pass(tmp_path):
    for name in ("ppo_tiny", "grpo_tiny"):
        module = __import__(f"jaxrlhf.configs.{name}", fromlist=["get_config"])
        job = check_config(module.get_config(), str(tmp_path))
        assert "actor_gen" in job.plan.specs


def test_a_task_without_demonstrations_runs_without_a_warm_start(tmp_path):
    """`data.task.num_sft=0` asks for no SFT rows: with `warm_start.sft_steps=0` nothing needs
    them (it was refused: the empty demonstrations file "holds no rows")."""
    config, _ = _config({"data.task.num_sft": 0, "warm_start.sft_steps": 0})
    job = check_config(config, str(tmp_path / "work"))
    assert job.data.sft == [] and job.warm_start is None


DISTRIBUTED = [
    (dict(coordinator_address="host-without-port", num_processes=2, process_id=0),
     "--coordinator_address='host-without-port' is not HOST:PORT"),
    (dict(coordinator_address="10.0.0.1:1234", num_processes=2, process_id=2),
     "--process_id=2 is not in 0..1 (--num_processes=2)"),
    (dict(coordinator_address="10.0.0.1:1234", num_processes=None, process_id=0),
     "--coordinator_address=10.0.0.1:1234 needs --num_processes and --process_id"),
    (dict(coordinator_address=None, num_processes=2, process_id=1),
     "--num_processes=2 --process_id=1 need --coordinator_address=HOST:PORT"),
    (dict(coordinator_address="auto", num_processes=2, process_id=None),
     "--coordinator_address=auto detects --num_processes"),
]


@pytest.mark.parametrize("flags,expected", DISTRIBUTED)
def test_bad_multi_process_flags(flags, expected, monkeypatch):
    for env in (distributed.ENV_COORDINATOR, distributed.ENV_NUM_PROCESSES,
                distributed.ENV_PROCESS_ID):
        monkeypatch.delenv(env, raising=False)
    with pytest.raises(distributed.DistributedError, match=expected.replace("(", r"\(")
                       .replace(")", r"\)").replace(".", r"\.")):
        distributed.from_flags(**flags)


def test_cpu_devices_must_split_over_processes():
    cfg = distributed.from_flags("127.0.0.1:1234", 3, 0)
    with pytest.raises(distributed.DistributedError, match="cpu_devices=8 does not split evenly "
                                                           "over 3 processes"):
        distributed.cpu_devices_per_process(8, cfg)
    assert distributed.cpu_devices_per_process(8, distributed.from_flags("h:1", 2, 1)) == 4


def _train(*args, tmp_path) -> subprocess.CompletedProcess:
    env = {"PATH": "/usr/bin:/bin", "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-m", "jaxrlhf.train", "--config=configs/ppo_tiny.py",
                           f"--workdir={tmp_path}", *args],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=120)


@pytest.mark.entry
@pytest.mark.parametrize("args,expected", [
    (["--config.placement.strategy=d2x4"],
     "error: placement.strategy: MFC 'actor_gen' (0-7:d2x4): unknown axis letter 'x' in "
     "strategy '0-7:d2x4'; known: d, e, f, t, p"),
    (["--config.rollout.batchsize=4"],
     "error: --config.rollout.batchsize: unknown config key (did you mean rollout.batch_size?); "
     "every key is in jaxrlhf/schema.py"),
    (["--num_processes=2", "--process_id=1"],
     "error: --num_processes=2 --process_id=1 need --coordinator_address=HOST:PORT (or "
     "$JAXRLHF_COORDINATOR_ADDRESS)"),
    (["--config=configs/no_such_config.py:smoke"],
     "error: --config=configs/no_such_config.py: no such config file"),
], ids=["bad_strategy", "unknown_key", "process_flags_without_coordinator", "missing_config"])
def test_cli_prints_one_line_and_exits_2(args, expected, tmp_path):
    result = _train(*args, tmp_path=tmp_path)
    assert result.returncode == 2, result.stderr[-2000:]
    assert result.stderr.strip() == expected
    assert result.stdout == ""
