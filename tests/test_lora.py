"""LoRA (`models.actor.lora`): adapters beside the targeted projections, the only parameters the
train step updates and keeps optimizer state for; merged and PEFT exports that transformers
reads back; the planner's memory model."""

import json
import math
import subprocess
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from safetensors.numpy import load_file

from hf_fixtures import hf_logits, padded_batch, positions_from_mask
from jaxrlhf import export
from jaxrlhf.algorithms import sft
from jaxrlhf.checkpoint import CHECKPOINT_DIR, CheckpointConfig, Checkpointer, abstract_state
from jaxrlhf.engine.microbatch import MicrobatchConfig
from jaxrlhf.engine.optimizer import OptimizerConfig
from jaxrlhf.engine.train_step import create_train_state, make_train_step
from jaxrlhf.mfc import Call, Role
from jaxrlhf.models import lora
from jaxrlhf.models.sizes import abstract_params, get_size
from jaxrlhf.models.transformer import Transformer
from jaxrlhf.parallel.layout import Platform, make_layout
from jaxrlhf.plan import memory
from jaxrlhf.plan.choice import CallChoice
from jaxrlhf.plan.experiment import Workload
from jaxrlhf.plan.profile import profile_of
from jaxrlhf.parallel.strategy import DeviceRange
from jaxrlhf.schema import base_config
from jaxrlhf.spec import ConfigError, run_spec
from test_checkpoint import host_state, random_params

ALL = tuple(lora.LoraTarget)
ADAPTERS = lora.LoraConfig(rank=4, alpha=8.0, targets=ALL)
BASE = get_size("tiny", dtype=jnp.float32)
ACTOR = BASE.replace(lora=ADAPTERS)
ATOL = 1e-4  # as tests/test_export.py: fp32 logits of transformers against ours
LENGTHS, LEFT_PAD, SEQ_LEN = [7, 4, 10, 1], [True, False, True, False], 10


def _logits(config, params, tokens_bt, mask_bt) -> np.ndarray:
    fwd = jax.jit(lambda p, t, pos, seg: Transformer(config).apply({"params": p}, t, pos, seg)[0])
    return np.asarray(fwd(params, tokens_bt, positions_from_mask(mask_bt), mask_bt))


def _flat(tree) -> dict[str, np.ndarray]:
    return {jax.tree_util.keystr(p): np.asarray(x)
            for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


def test_adapted_model_is_its_merged_model_and_numpy_says_so():
    """y = x·W + alpha/r · (x·A)·B through the model equals the model on W + alpha/r · A·B,
    and the merged kernels are numpy's."""
    layout = make_layout("0-0:d1", model=ACTOR)
    params = random_params(ACTOR, layout, 0)  # B != 0: the adapters change the model
    merged = lora.merged(params, ADAPTERS)
    q = params["layers"]["self_attn"]["q_proj"]
    a_lr, b_lrhk = np.asarray(q["lora_a"]), np.asarray(q["lora_b"])
    want = np.asarray(q["kernel"]) + 2.0 * np.einsum("ldr,lrhk->ldhk", a_lr, b_lrhk)
    np.testing.assert_allclose(merged["layers"]["self_attn"]["q_proj"]["kernel"], want,
                               rtol=1e-6, atol=1e-6)
    tokens_bt, mask_bt = padded_batch(BASE.vocab_size, LENGTHS, SEQ_LEN, left_pad=LEFT_PAD)
    adapted = _logits(ACTOR, params, tokens_bt, mask_bt)
    plain = _logits(BASE, lora.partition(params, ADAPTERS)[1], tokens_bt, mask_bt)
    valid = mask_bt.astype(bool)
    assert np.abs(adapted - plain)[valid].max() > 0.1  # the adapters do something
    np.testing.assert_allclose(_logits(BASE, merged, tokens_bt, mask_bt)[valid], adapted[valid],
                               atol=1e-5, rtol=0)


def _sft_batch(rows: int, seq: int, n: int, vocab: int) -> dict:
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, vocab, (rows, seq)).astype(np.int32)
    return {"tokens_bt": tokens, "positions_bt": np.tile(np.arange(seq, dtype=np.int32), (rows, 1)),
            "segment_ids_bt": np.ones((rows, seq), np.int32),
            "mask_bn": np.ones((rows, n), np.float32)}


def test_train_step_updates_and_keeps_state_for_the_adapters_only():
    """On d2: the base weights stay bit for bit, Adam's moments exist for the adapters alone,
    and the adapters learn (a fixed batch's NLL falls)."""
    layout = make_layout("0-1:d2", model=ACTOR)
    opt = OptimizerConfig(lr=1e-2, total_steps=100)
    step = make_train_step(ACTOR, layout, sft.make().train[Role.ACTOR].loss_fn, opt,
                           MicrobatchConfig.by_count(2))
    start = random_params(ACTOR, layout, 1)
    frozen = _flat(lora.partition(start, ADAPTERS)[1])
    state = create_train_state(start, ACTOR, layout, opt)
    adapters = lora.partition(nn.unbox(abstract_params(ACTOR)), ADAPTERS)[0]
    adapter_elements = sum(x.size for x in jax.tree.leaves(adapters))
    moments = sum(x.size for x in jax.tree.leaves(state.opt_state) if x.ndim)
    assert moments == 2 * adapter_elements  # mu and nu of the adapters, nothing else
    batch = _sft_batch(8, 12, 6, ACTOR.vocab_size)
    losses = []
    for _ in range(15):
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    assert losses[-1] < 0.7 * losses[0], losses
    after = _flat(lora.partition(state.params, ADAPTERS)[1])
    assert after.keys() == frozen.keys()
    for key, value in frozen.items():
        np.testing.assert_array_equal(after[key], value, err_msg=key)


def _choice(first, last, d=1, f=1, t=1, k=1):
    return CallChoice(DeviceRange(first, last), d, f, t, k)


def test_planner_prices_gradients_and_moments_of_the_adapters_only():
    full, adapted = profile_of(get_size("small")), profile_of(
        get_size("small").replace(lora=ADAPTERS))
    work = Workload(batch_size=16, prompt_len=32, new_tokens=32)
    c = _choice(0, 3, f=2, t=2)
    full_mem = memory.call_memory(full, Call.TRAIN_STEP, work, c, platform=Platform.CPU)
    lora_mem = memory.call_memory(adapted, Call.TRAIN_STEP, work, c, platform=Platform.CPU)
    trained = adapted.trained_shard_elements(2, 2)
    assert 0 < trained < adapted.shard_elements(2, 2) // 20
    # fp32: Adam's two moments; one backward pass: fp32 gradients and half the update's
    assert lora_mem.optimizer == trained * 8 and lora_mem.grads == trained * 6
    assert lora_mem.params == adapted.shard_bytes(2, 2) > full_mem.params
    assert full_mem.optimizer == full.shard_elements(2, 2) * 8
    assert lora_mem.activations == full_mem.activations  # the backward pass still runs through


@pytest.mark.parametrize("rank,targets,message", [
    (4, "q_proj,w_proj", "models.actor.lora.targets: 'w_proj' is not one of: q_proj"),
    (4, "", "models.actor.lora: targets: LoRA needs at least one projection"),
])
def test_bad_lora_keys_are_one_line(rank, targets, message):
    config = base_config()
    config.models.actor.lora.update({"rank": rank, "targets": targets})
    with pytest.raises(ConfigError, match=message):
        run_spec(config)
    config = base_config()
    config.algorithm = "ppo"
    config.models.critic.lora.rank = 4
    with pytest.raises(ConfigError, match="models.critic.lora.rank=4: LoRA adapts the actor"):
        run_spec(config)


def test_spec_gives_the_actor_adapters_and_the_ref_none():
    config = base_config()
    config.models.actor.lora.update({"rank": 8, "alpha": 32.0, "targets": "q_proj,v_proj"})
    spec = run_spec(config)
    want = lora.LoraConfig(8, 32.0, (lora.LoraTarget.Q_PROJ, lora.LoraTarget.V_PROJ))
    assert spec.models[Role.ACTOR].config.lora == want
    assert spec.models[Role.REF].config.lora is None  # the ref copies the merged actor
    assert spec.models[Role.CRITIC].config.lora is None


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    """A LoRA run's checkpoint 3: its actor (adapters and base) as the run saved it."""
    workdir = tmp_path_factory.mktemp("lora_run")
    config = base_config()
    config.algorithm = "sft"
    config.models.actor.lora.update({"rank": 4, "alpha": 8.0, "targets": ",".join(
        t.value for t in ALL)})
    layout = make_layout("0-7:d8", model=ACTOR)
    opt = OptimizerConfig(lr=1e-2, total_steps=10)
    state = create_train_state(random_params(ACTOR, layout, 3), ACTOR, layout, opt)
    ckpts = Checkpointer(workdir / CHECKPOINT_DIR, CheckpointConfig(1, 2, async_save=False))
    ckpts.save({Role.ACTOR: state}, host_state(3, config, trained=("actor",), frozen=()))
    ckpts.close()
    return workdir, state.params


def test_checkpoint_holds_the_adapters_and_their_optimizer_state(lora_run):
    workdir, params = lora_run
    layout = make_layout("0-3:d4", model=ACTOR)  # another plan than the saving run's
    opt = OptimizerConfig(lr=1e-2, total_steps=10)
    ckpts = Checkpointer(workdir / CHECKPOINT_DIR, None)
    state = ckpts.restore_models(3, {Role.ACTOR: abstract_state(ACTOR, layout, opt)})[Role.ACTOR]
    ckpts.close()
    saved = _flat(params)
    assert _flat(state.params).keys() == saved.keys()
    for key, value in _flat(state.params).items():
        np.testing.assert_array_equal(value, saved[key], err_msg=key)
    moments = [k for k in _flat(state.opt_state) if "lora_" in k]
    assert moments and len(moments) == len([x for x in jax.tree.leaves(state.opt_state)
                                            if x.ndim])


def test_export_writes_merged_weights_transformers_reproduces(lora_run, tmp_path):
    workdir, params = lora_run
    export.export(workdir, tmp_path / "out")
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "out", attn_implementation="eager", dtype=torch.float32).eval()
    tokens_bt, mask_bt = padded_batch(BASE.vocab_size, LENGTHS, SEQ_LEN, left_pad=LEFT_PAD)
    ours = _logits(ACTOR, params, tokens_bt, mask_bt)  # the adapted model, unmerged
    valid = mask_bt.astype(bool)
    np.testing.assert_allclose(hf_logits(hf, tokens_bt, mask_bt)[valid], ours[valid],
                               atol=ATOL, rtol=0)


def test_export_writes_peft_adapters_on_their_base(lora_run, tmp_path):
    """adapter_config.json and adapter_model.safetensors as PEFT reads them: every merged HF
    weight is the base's plus lora_alpha / r · lora_B · lora_A."""
    workdir, _ = lora_run
    export.export(workdir, tmp_path / "out")
    adapter = tmp_path / "out" / export.ADAPTER_DIR
    peft_cfg = json.loads((adapter / export.PEFT_CONFIG).read_text())
    assert peft_cfg["peft_type"] == "LORA" and peft_cfg["r"] == 4
    assert peft_cfg["lora_alpha"] == 8.0 and peft_cfg["base_model_name_or_path"] == str(
        tmp_path / "out" / export.BASE_DIR)
    assert sorted(peft_cfg["target_modules"]) == sorted(t.value for t in ALL)
    tensors = load_file(adapter / export.PEFT_WEIGHTS)
    merged = load_file(tmp_path / "out/model.safetensors")
    base = load_file(tmp_path / "out" / export.BASE_DIR / "model.safetensors")
    prefix, scale = "base_model.model.", peft_cfg["lora_alpha"] / peft_cfg["r"]
    modules = {k[len(prefix):-len(".lora_A.weight")] for k in tensors if "lora_A" in k}
    assert len(modules) == 7 * BASE.num_layers
    for module in modules:
        a_ri = tensors[f"{prefix}{module}.lora_A.weight"]
        b_or = tensors[f"{prefix}{module}.lora_B.weight"]
        assert a_ri.shape[0] == b_or.shape[1] == 4
        want = base[f"{module}.weight"] + scale * (b_or @ a_ri)
        np.testing.assert_allclose(merged[f"{module}.weight"], want, atol=1e-6, rtol=1e-5,
                                   err_msg=module)
    untouched = [k for k in base if not any(k.startswith(m) for m in modules)]
    assert untouched and all(np.array_equal(base[k], merged[k]) for k in untouched)


def test_peft_loads_the_adapters_on_their_base_and_gives_the_merged_logits(lora_run, tmp_path):
    """`PeftModel.from_pretrained(base, export/adapter)` is the adapted model: its logits are
    the merged export's and ours (fp32, within 1e-4)."""
    peft = pytest.importorskip("peft")
    workdir, params = lora_run
    export.export(workdir, tmp_path / "out")
    load = lambda path: transformers.AutoModelForCausalLM.from_pretrained(
        path, attn_implementation="eager", dtype=torch.float32).eval()
    adapted = peft.PeftModel.from_pretrained(load(tmp_path / "out" / export.BASE_DIR),
                                             tmp_path / "out" / export.ADAPTER_DIR).eval()
    tokens_bt, mask_bt = padded_batch(BASE.vocab_size, LENGTHS, SEQ_LEN, left_pad=LEFT_PAD)
    valid = mask_bt.astype(bool)
    peft_btv = hf_logits(adapted, tokens_bt, mask_bt)[valid]
    base_btv = hf_logits(load(tmp_path / "out" / export.BASE_DIR), tokens_bt, mask_bt)[valid]
    assert np.abs(peft_btv - base_btv).max() > 1e-2  # the adapters change the logits
    np.testing.assert_allclose(peft_btv, hf_logits(load(tmp_path / "out"), tokens_bt,
                                                   mask_bt)[valid], atol=ATOL, rtol=0)
    np.testing.assert_allclose(peft_btv, _logits(ACTOR, params, tokens_bt, mask_bt)[valid],
                               atol=ATOL, rtol=0)


@pytest.mark.slow
def test_memory_of_a_lora_train_step_against_full_fine_tuning():
    """Per device, XLA's memory_analysis of the compiled train step (arguments: parameters and
    optimizer state; temporaries: gradients, activations) with LoRA and without, beside the
    planner's estimate: printed (`pytest -m slow -s`), and LoRA's arguments must be the
    planner's to the byte."""
    size = get_size("llama-3.2-1b", param_dtype=jnp.bfloat16, dtype=jnp.bfloat16)
    layout = make_layout("0-7:d2f2t2", model=size)
    work = Workload(batch_size=8, prompt_len=64, new_tokens=64)
    batch = _sft_batch(8, 128, 64, size.vocab_size)
    rows = []
    for name, config in (("full", size), ("lora", size.replace(lora=ADAPTERS))):
        step = make_train_step(config, layout, sft.make().train[Role.ACTOR].loss_fn,
                               OptimizerConfig(), MicrobatchConfig.by_count(1))
        abstract = _abstract_state(step)
        compiled = step._jit_for(abstract, batch).lower(abstract, batch).compile()
        analysis = compiled.memory_analysis()
        estimate = memory.call_memory(profile_of(config), Call.TRAIN_STEP, work,
                                      _choice(0, 7, 2, 2, 2))
        rows.append((name, analysis, estimate))
        mib = lambda n: f"{n / 2**20:.1f} MiB"
        print(f"{name}: XLA per device: arguments {mib(analysis.argument_size_in_bytes)}, "
              f"temporaries {mib(analysis.temp_size_in_bytes)}; planner: params "
              f"{mib(estimate.params)}, optimizer {mib(estimate.optimizer)}, grads "
              f"{mib(estimate.grads)}, activations {mib(estimate.activations)}, total "
              f"{mib(estimate.total)}")
    (_, full_xla, full_est), (_, lora_xla, lora_est) = rows
    batch_bytes = sum(x.nbytes for x in batch.values()) // layout.strategy.dp_size
    for xla, est in ((full_xla, full_est), (lora_xla, lora_est)):
        assert 0 <= xla.argument_size_in_bytes - batch_bytes - est.arguments <= 64  # counts
    assert lora_xla.argument_size_in_bytes < 0.6 * full_xla.argument_size_in_bytes
    assert lora_xla.temp_size_in_bytes < full_xla.temp_size_in_bytes


def _abstract_state(step):
    """The TrainState a TrainStep takes, as ShapeDtypeStructs on its shardings."""
    return abstract_state(step.model_config, step.layout, step.opt_cfg)


def test_lora_leaves_are_named_as_the_module_says():
    shapes = jax.tree.map(lambda x: x.shape, nn.unbox(abstract_params(ACTOR)))
    q = shapes["layers"]["self_attn"]["q_proj"]
    layers, d, h, k = q["kernel"]
    assert q["lora_a"] == (layers, d, 4) and q["lora_b"] == (layers, 4, h, k)
    o = shapes["layers"]["self_attn"]["o_proj"]
    assert o["lora_a"] == (layers, h, k, 4) and o["lora_b"] == (layers, 4, d)
    assert math.prod(shapes["layers"]["mlp"]["down_proj"]["lora_a"]) == layers * (
        BASE.intermediate_size * 4)


@pytest.mark.slow
@pytest.mark.entry
def test_a_tiny_lora_sft_run_learns(tmp_path):
    """`python -m jaxrlhf.train` on sft_tiny with rank-16 adapters on every projection of a
    frozen, freshly initialised model: held-out accuracy 0.0 -> 1.0 measured (2 cores, loaded)."""
    result = subprocess.run(
        [sys.executable, "-m", "jaxrlhf.train", "--config=configs/sft_tiny.py",
         f"--workdir={tmp_path}", "--config.models.actor.lora.rank=16",
         "--config.models.actor.lora.targets=" + ",".join(t.value for t in ALL)],
        capture_output=True, text=True, timeout=1200)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    assert summary["accuracy_after"] >= 0.85 and summary["accuracy_before"] <= 0.1, summary


def test_adapters_start_at_zero_beside_weights_loaded_from_hugging_face(tmp_path):
    """models.actor.path and lora: the HF weights load as the base, the adapters are fresh (B
    = 0), so the adapted actor computes transformers' logits; the ref gets no adapters."""
    from hf_fixtures import make_tiny_hf_model
    from jaxrlhf.run.build import initial_actor_params

    path, hf = make_tiny_hf_model(tmp_path, "llama")
    config = base_config()
    config.models.actor.path = str(path)
    config.models.actor.lora.rank = 4
    spec = run_spec(config)
    actor = spec.base.config
    params = initial_actor_params(spec, make_layout("0-1:d2", model=actor))
    adapters, _ = lora.partition(params, actor.lora)
    assert all(not np.any(b) for k, b in _flat(adapters).items() if "lora_b" in k)
    assert any(np.any(a) for k, a in _flat(adapters).items() if "lora_a" in k)
    tokens_bt, mask_bt = padded_batch(actor.vocab_size, LENGTHS, SEQ_LEN, left_pad=LEFT_PAD)
    valid = mask_bt.astype(bool)
    np.testing.assert_allclose(_logits(actor, params, tokens_bt, mask_bt)[valid],
                               hf_logits(hf, tokens_bt, mask_bt)[valid], atol=ATOL, rtol=0)
