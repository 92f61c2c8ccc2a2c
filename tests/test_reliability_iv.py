"""Accepted and then trained nothing, or the wrong thing (issue 46, Reliability IV): each of
these is now one line `FIELD: problem` from the checks (`run.check.check_config`), before
anything compiles."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest

from jaxrlhf.mfc import Role
from jaxrlhf.models.sizes import abstract_params

from jaxrlhf.run.check import check_config
from jaxrlhf.schema import ConfigError, base_config
from tests.test_reliability_inputs import configured

COMPILE_EVENTS = ("/jax/core/compile/backend_compile_duration",
                  "/jax/compilation_cache/cache_retrieval_time_sec")




def refusal(config, workdir) -> str:
    """The ConfigError line check_config raises for `config`, asserting nothing compiled."""
    compiles = []
    listener = lambda event, *_, **__: compiles.append(event)
    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        with pytest.raises(ConfigError) as info:
            check_config(config, str(workdir))
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    assert not [e for e in compiles if e in COMPILE_EVENTS], "a check compiled something"
    message = str(info.value)
    assert "\n" not in message, message
    return message


GRPO = {"algorithm": "grpo", "rollout.group_size": 2}

# (id, overrides, the start of the expected line)
CASES = [
    ("lora_rank_past_the_width", {"models.actor.lora.rank": 1000},
     "models.actor.lora.rank=1000: more than 32, the most an adapter of k_proj [64, 32] can "
     "have"),
    ("lora_alpha_zero", {"models.actor.lora.rank": 4, "models.actor.lora.alpha": 0.0},
     "models.actor.lora.alpha=0.0: must be > 0"),
    ("lora_targets_at_rank_zero", {"models.actor.lora.targets": "q_proj"},
     "models.actor.lora.targets='q_proj': models.actor.lora.rank=0 adapts nothing"),
    ("overlong_buffer_past_the_response", {"algorithm": "dapo", "rollout.group_size": 2,
                                           "dapo.overlong_buffer": 100},
     "dapo.overlong_buffer=100: must be < rollout.max_new_tokens=8"),
    ("tis_cap_below_one", {"ppo.tis_cap": 1e-9}, "ppo.tis_cap=1e-09: must be 0 (off) or >= 1"),
    ("gamma_above_one", {"ppo.gamma": 1.5}, "ppo.gamma=1.5: must be <= 1"),
    ("lam_negative", {"ppo.lam": -1.0}, "ppo.lam=-1.0: must be >= 0"),
    ("grpo_kl_coef_negative", {**GRPO, "grpo.kl_coef": -0.5}, "grpo.kl_coef=-0.5: must be >= 0"),
    ("dapo_keys_under_ppo", {"dapo.overlong_buffer": 4},
     "dapo.overlong_buffer=4: algorithm=ppo does not read dapo.*"),
    ("gspo_keys_under_grpo", {**GRPO, "gspo.clip_eps": 1e-3},
     "gspo.clip_eps=0.001: algorithm=grpo does not read gspo.*"),
    ("grpo_keys_under_ppo", {"grpo.kl_coef": 0.1},
     "grpo.kl_coef=0.1: algorithm=ppo does not read grpo.*"),
    ("env_keys_without_env_name", {"env.max_turns": 2},
     "env.max_turns=2: env.name is empty"),
    ("async_key_in_a_synchronous_run", {"async_rl.behav_imp_weight_cap": 5.0},
     "async_rl.behav_imp_weight_cap=5.0: async_rl.max_staleness=0"),
    ("dpo_keys_under_sft", {"algorithm": "sft", "dpo.beta": 0.5},
     "dpo.beta=0.5: algorithm=sft does not read dpo.*"),
    ("cost_keys_outside_safe_rlhf", {"cost.workers": 3},
     "cost.workers=3: algorithm=ppo does not read cost.*"),
    ("generation_replicas_in_one_process",  # refused by the async loop after the warm start
     {"placement.kind": "disaggregate", "placement.gen_replicas": 3,
      "async_rl.max_staleness": 1},
     "placement.gen_replicas=3: an asynchronous run with generation replicas runs 1 + 3 "
     "processes"),
    ("dapo_trains_too_few_rows_for_its_layout",  # died in the first train step
     {"algorithm": "dapo", "rollout.batch_size": 16, "rollout.group_size": 4,
      "dapo.oversample": 16},
     "placement.strategy: MFC 'actor_train' (0-7:d8) splits the batch 8 ways, which does not "
     "divide its batch of 4 (rollout.batch_size × group_size / dapo.oversample / mini-batches)"),
    ("critic_size_under_grpo", {**GRPO, "models.critic.size": "small"},
     "models.critic.size='small': this run has no critic model (algorithm=grpo)"),
    ("reward_model_size_with_a_reward_function", {"models.reward.size": "small"},
     "models.reward.size='small': this run has no reward model (reward.kind=function)"),
]


@pytest.mark.parametrize("overrides,expected", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_values_that_train_nothing_are_refused_before_compiling(overrides, expected, tmp_path):
    message = refusal(configured(overrides), tmp_path / "work")
    assert message.startswith(expected), message


def _sft_checkpoint(workdir, rank: int) -> None:
    """Checkpoint 3 of an SFT run of the tiny actor with LoRA rank `rank` (0: full weights):
    its parameters, zeros of the right shapes (what a forced resume reads is their metadata)."""
    from jaxrlhf.checkpoint import CHECKPOINT_DIR, CheckpointConfig, Checkpointer
    from jaxrlhf.spec import run_spec
    from test_checkpoint import host_state

    config = configured({"algorithm": "sft", "models.actor.lora.rank": rank})
    actor = run_spec(config).models[Role.ACTOR].config
    params = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), nn.unbox(abstract_params(actor)))
    ckpts = Checkpointer(workdir / CHECKPOINT_DIR, CheckpointConfig(1, 2, async_save=False))
    ckpts.save({Role.ACTOR: params}, host_state(3, config, trained=(), frozen=("actor",)))
    ckpts.close()


@pytest.mark.parametrize("saved,now", [(4, 8), (0, 4)], ids=["rank_changed", "lora_over_full"])
def test_a_forced_resume_of_other_shapes_is_refused_and_leaves_the_checkpoints(saved, now,
                                                                               tmp_path, capfd):
    """checkpoint.resume=force after a LoRA change: one line, before compiling; before, the
    restore failed as on damage and the other run's intact checkpoint was renamed 3.damaged-1."""
    workdir = tmp_path / "work"
    _sft_checkpoint(workdir, saved)
    config = configured({"algorithm": "sft", "models.actor.lora.rank": now,
                         "checkpoint.resume": "force"})
    capfd.readouterr()
    message = refusal(config, workdir)
    assert capfd.readouterr().err == ""  # nor "resuming regardless", nor orbax's read-only notes
    assert message.startswith("checkpoint.resume=force: the checkpoints in ") and (
        "do not fit this run's models (actor: layers." in message), message
    assert sorted(p.name for p in (workdir / "checkpoints").iterdir()) == ["3"]
    config.models.actor.lora.rank = saved  # the same shapes: a forced resume goes ahead
    check_config(config, str(workdir))


def test_the_byte_tokenizer_does_not_drive_a_model_with_its_own(tmp_path):
    """An HF directory with a tokenizer.json and the default tokenizer='byte': refused in one
    line naming both (before, byte ids 0-271 trained a 128k-vocabulary model silently)."""
    from test_reliability_inputs import _byte_level_tokenizer, _hf_dir

    model = _hf_dir(tmp_path / "llama")
    _byte_level_tokenizer(model)
    config = configured({"algorithm": "sft", "models.actor.path": str(model)})
    assert refusal(config, tmp_path / "work") == (
        f"tokenizer='byte': models.actor.path='{model}' has a tokenizer of its own "
        f"(tokenizer.json); set tokenizer='{model}' to train with it (the byte tokenizer's ids "
        "would mean other tokens to this model)")
    (model / "tokenizer.json").unlink()  # weights alone: the byte tokenizer is the only one
    config.checkpoint.resume = "never"
    check_config(config, str(tmp_path / "work2"))


@pytest.mark.parametrize("feature", [{"async_rl.max_staleness": 1}, {"env.name": "tools"}],
                         ids=["async", "multi_turn"])
def test_a_pipelined_generation_layout_of_the_rollout_engine_is_refused_before_compiling(
        feature, tmp_path):
    """Before, the rollout engine refused it with a ValueError at run time, after the warm
    start had compiled and trained (issue 46)."""
    config = configured({**GRPO, **feature, "placement.kind": "manual", "placement.allocation":
                         "actor_gen=0-7:p2d4,ref_inf=0-7:d8,actor_train=0-7:d8"})
    message = refusal(config, tmp_path / "work")
    assert message.startswith("placement: actor_gen runs on 0-7:d4p2@2, a pipelined") and (
        "generates on the rollout engine" in message), message


@pytest.mark.parametrize("mode", ["auto", "off"])
def test_routing_replay_over_a_pipelined_generation_layout_is_refused_before_compiling(
        mode, tmp_path):
    """A pipelined generate call records no expert routes, which replay (auto: on) and its
    mismatch measure (off) read: refused by the checks, where the generate executor raised
    after the warm start and advised replay_routing=off, which did not help."""
    config = configured({**GRPO, "models.actor.size": "tiny-moe", "models.ref.size": "tiny-moe",
                         "models.actor.moe.replay_routing": mode, "placement.kind": "manual",
                         "placement.allocation":
                             "actor_gen=0-7:p2d4,ref_inf=0-7:d8,actor_train=0-7:d8"})
    message = refusal(config, tmp_path / "work")
    assert message == (
        "placement: actor_gen runs on 0-7:d4p2@2, a pipelined layout, which records no expert "
        f"routes, but routing {'replay' if mode == 'auto' else 'record'} "
        "(models.actor.moe.replay_routing) reads them: give actor_gen a layout without "
        "pipeline stages"), message


def test_a_workdir_that_is_a_file_is_named_as_one(tmp_path):
    (tmp_path / "run").write_text("x")
    assert refusal(base_config(), tmp_path / "run") == (
        f"workdir: {tmp_path / 'run'} is a file, not a directory")  # was "[Errno 17] File exists"


def test_a_data_file_with_a_bad_byte_names_its_line(tmp_path):
    data = tmp_path / "train.jsonl"
    data.write_bytes(b'{"prompt": "12>", "answer": "21"}\n{"prompt": "1\xff3>", "answer": "31"}\n')
    config = configured({"data.train_path": str(data)})
    assert refusal(config, tmp_path / "work") == (  # was "codec can't decode ... position 47"
        f"data.train_path: {data}:line 2: is not UTF-8 (byte 0xff at column 14)")


@pytest.mark.entry
@pytest.mark.parametrize("args,expected", [
    (["--config.models.critic.size=small", "--workdir={tmp}"],
     "models.critic.size='small': this run has no critic model (algorithm=grpo)"),
    (["--workdir={tmp}/file"], "workdir: {tmp}/file is a file, not a directory"),
], ids=["critic_size_under_grpo", "workdir_is_a_file"])
def test_the_train_command_says_it_in_one_line_and_exits_2(args, expected, tmp_path):
    import os
    import pathlib
    import subprocess
    import sys

    (tmp_path / "file").write_text("x")
    proc = subprocess.run(
        [sys.executable, "-m", "jaxrlhf.train", "--config=configs/grpo_tiny.py",
         *(a.format(tmp=tmp_path) for a in args)],
        cwd=pathlib.Path(__file__).resolve().parents[1], capture_output=True, text=True,
        timeout=300, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert proc.returncode == 2 and proc.stderr == (
        f"error: {expected.format(tmp=tmp_path)}\n"), proc.stderr[-3000:]


def test_a_checkpoint_from_before_the_env_rename_keeps_its_fingerprint():
    """env.class became env.name (a Python keyword cannot be set on the command line): a
    multi-turn run's checkpoints from before still resume as the same run."""
    from jaxrlhf.fingerprint import differences

    assert differences({"env.class": "tools", "seed": "0"}, {"env.name": "tools", "seed": "0"}
                       ) == []
    assert differences({"env.class": "tools"}, {"env.name": "lookup"}) == [
        "env.name: tools -> lookup"]


def test_a_forced_resume_over_damaged_metadata_is_left_to_the_damage_fallback(tmp_path):
    """Unreadable parameter metadata is damage, not another shape: the check lets the restore
    set it aside and take the previous checkpoint, as for any damaged checkpoint."""
    from jaxrlhf.checkpoint import shape_mismatches
    from jaxrlhf.spec import run_spec

    workdir = tmp_path / "work"
    _sft_checkpoint(workdir, 4)
    config = configured({"algorithm": "sft", "models.actor.lora.rank": 8})
    models = run_spec(config).model_configs()
    assert shape_mismatches(workdir / "checkpoints", models)  # readable: the ranks differ
    (workdir / "checkpoints/3/actor_params/_METADATA").write_text("{")
    assert shape_mismatches(workdir / "checkpoints", models) == []


def test_asynchronous_multi_turn_generation_in_micro_batches_is_refused_before_compiling(
        tmp_path):
    """run/rollout_worker.py refused it when the worker was built, after the warm start."""
    config = configured({**GRPO, "env.name": "tools", "async_rl.max_staleness": 1,
                         "placement.kind": "manual", "placement.allocation":
                         "actor_gen=0-7:d8@2,ref_inf=0-7:d8,actor_train=0-7:d8"})
    assert refusal(config, tmp_path / "work").startswith(
        "placement: actor_gen runs on 0-7:d8@2, 2 micro-batches, but asynchronous multi-turn "
        "rollouts take one micro-batch of generation")


def test_multi_turn_async_across_processes_is_refused_by_the_checks(monkeypatch):
    """Two processes (trainer + one generation replica) with an environment: the async loop
    refused it after the warm start; the checks now do, before compiling."""
    from jaxrlhf.run import check
    from jaxrlhf.run.layouts import place
    from jaxrlhf.spec import run_spec

    spec = run_spec(configured({**GRPO, "env.name": "tools", "async_rl.max_staleness": 1,
                                "placement.kind": "disaggregate"}))
    plan = place(spec)
    check._check_processes(spec, plan)  # one process: multi-turn async runs here
    monkeypatch.setattr(check.jax, "process_count", lambda: 2)
    with pytest.raises(ConfigError, match=r"^env.name='tools': multi-turn asynchronous RL runs "
                                          "in one process"):
        check._check_processes(spec, plan)


def test_export_still_rebuilds_models_an_older_run_accepted():
    """The LoRA checks hold a run's config, not `model_config_of`, which export uses on a
    checkpoint's stored config: a checkpoint of a run that set lora.targets at rank 0, or a
    rank past a projection's width, still exports."""
    from jaxrlhf.spec import model_config_of, run_spec

    for lora_keys in ({"rank": 0, "targets": "q_proj"}, {"rank": 100}):
        config = base_config()
        config.models.actor.lora.update(lora_keys)
        with pytest.raises(ConfigError):
            run_spec(config)
        model = model_config_of(config.models.actor, Role.ACTOR, "models.actor")
        assert (model.lora.rank if model.lora else 0) == lora_keys["rank"]
