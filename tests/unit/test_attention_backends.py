"""`models.<role>.attention`: every implementation available on this backend gives the model the
same numbers as XLA (fp32): a packed/padded forward with gradients, and a sampled generation
(prefill + ragged decode against the cache). Pallas runs in interpret mode off accelerators."""

import functools
import importlib.util
import json
import pathlib

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrlhf.configs import ppo_tiny
from jaxrlhf import spec
from jaxrlhf.engine.generate import GenerateConfig, generate
from jaxrlhf.models.attention import AttentionImpl, resolve_impl, unavailable_reason
from jaxrlhf.models.sizes import get_size
from jaxrlhf.models.transformer import Transformer

_TOL = dict(rtol=2e-5, atol=2e-5)
_BACKEND = jax.default_backend()
# Every choice that runs here and is not XLA itself (on CPU, auto *is* XLA: see below).
_AVAILABLE = [i for i in AttentionImpl
              if unavailable_reason(i) is None and resolve_impl(i) is not AttentionImpl.XLA]
# Heads 4 over 2 kv heads: GQA ratio 2 through the whole model.
_CONFIG = get_size("tiny", dtype=jnp.float32, num_layers=2)


def _model(impl: AttentionImpl) -> Transformer:
    return Transformer(_CONFIG.replace(attention=impl))


@functools.cache
def _params():
    tokens = jnp.zeros((1, 4), jnp.int32)
    variables = _model(AttentionImpl.XLA).init(jax.random.key(0), tokens, tokens, tokens + 1)
    return nn.unbox(variables["params"])


def _packed_batch():
    """Row 0: left padding + two packed sequences; row 1: one sequence + right padding."""
    seg_bt = jnp.asarray([[0] * 3 + [1] * 6 + [2] * 5, [1] * 10 + [0] * 4], jnp.int32)
    positions_bt = jnp.asarray([[0] * 3 + list(range(6)) + list(range(5)),
                                list(range(10)) + [0] * 4], jnp.int32)
    tokens_bt = jax.random.randint(jax.random.key(1), seg_bt.shape, 1, _CONFIG.vocab_size)
    return tokens_bt, positions_bt, seg_bt


# Pallas runs in interpret mode on the CPU (about 100 s on 2 busy cores): slow there, while
# the kernels' own numerics stay in the default suite (tests/test_kernels.py).
_SLOW_ON_CPU = {AttentionImpl.PALLAS} if jax.default_backend() == "cpu" else set()


@pytest.mark.parametrize("impl", [pytest.param(i, marks=pytest.mark.slow) if i in _SLOW_ON_CPU
                                  else i for i in _AVAILABLE], ids=lambda i: i.value)
def test_forward_and_grads_match_xla(impl):
    tokens_bt, positions_bt, seg_bt = _packed_batch()
    real_bt = (seg_bt != 0)[..., None]

    @functools.partial(jax.jit, static_argnums=1)
    @functools.partial(jax.value_and_grad, has_aux=True)
    def loss(params, impl):
        logits_btv = _model(impl).apply({"params": params}, tokens_bt, positions_bt, seg_bt)[0]
        # Padding positions differ by design (Pallas returns zeros, XLA an average): mask them.
        return jnp.sum(jnp.where(real_bt, jax.nn.log_softmax(logits_btv), 0.0)), logits_btv

    (_, got_btv), got_grads = loss(_params(), impl)
    (_, want_btv), want_grads = loss(_params(), AttentionImpl.XLA)
    np.testing.assert_allclose(jnp.where(real_bt, got_btv, 0), jnp.where(real_bt, want_btv, 0),
                               **_TOL)
    jax.tree.map(lambda g, w: np.testing.assert_allclose(g, w, **_TOL), got_grads, want_grads)


@pytest.mark.parametrize("impl", [pytest.param(i, marks=pytest.mark.slow) if i in _SLOW_ON_CPU
                                  else i for i in _AVAILABLE], ids=lambda i: i.value)
def test_generation_matches_xla(impl):
    """Sampled tokens identical, log-probs within fp32 tolerance, after ragged left-padded
    prompts (the decode steps run the cache kernel with a traced cache index)."""
    prompt_bp = jax.random.randint(jax.random.key(2), (3, 6), 1, _CONFIG.vocab_size)
    mask_bp = jnp.asarray([[0, 0, 0, 1, 1, 1], [1] * 6, [0, 0, 0, 0, 0, 1]], bool)
    cfg = GenerateConfig(max_new_tokens=5, eos_token_id=-1, pad_token_id=0, temperature=0.8)

    def run(impl):
        fn = jax.jit(lambda p: generate(_model(impl), cfg, p, prompt_bp, mask_bp,
                                        jax.random.key(3)))
        return fn(_params())

    got, want = run(impl), run(AttentionImpl.XLA)
    np.testing.assert_array_equal(got.response_bn, want.response_bn)
    np.testing.assert_allclose(got.logprobs_bn, want.logprobs_bn, **_TOL)


def test_auto_resolves_per_backend():
    assert resolve_impl(AttentionImpl.AUTO, "cpu") is AttentionImpl.XLA
    assert resolve_impl(AttentionImpl.AUTO, "gpu") is AttentionImpl.CUDNN
    assert resolve_impl(AttentionImpl.AUTO, "tpu") is AttentionImpl.PALLAS
    assert resolve_impl(AttentionImpl.PALLAS, "cpu") is AttentionImpl.PALLAS


@pytest.mark.skipif(_BACKEND == "gpu", reason="cudnn is available on a GPU")
def test_cudnn_off_gpu_is_a_config_error():
    config = ppo_tiny.get_config()
    config.models.actor.attention = "cudnn"
    with pytest.raises(spec.ConfigError, match=r"^models\.actor\.attention='cudnn': cudnn needs "
                                               r"an NVIDIA GPU"):
        spec.run_spec(config)


@pytest.mark.gpu
@pytest.mark.skipif(_BACKEND != "gpu", reason="needs a GPU (cuDNN attention)")
def test_cudnn_bf16_matches_xla_on_gpu():
    """In bf16 cuDNN takes the operands (fp32 falls back to XLA); compare at bf16 precision."""
    config = _CONFIG.replace(dtype=jnp.bfloat16, head_dim_override=16)
    tokens_bt, positions_bt, seg_bt = _packed_batch()
    model = lambda impl: Transformer(config.replace(attention=impl))
    params = nn.unbox(model(AttentionImpl.XLA).init(jax.random.key(0), tokens_bt, positions_bt,
                                                    seg_bt)["params"])
    got = model(AttentionImpl.CUDNN).apply({"params": params}, tokens_bt, positions_bt, seg_bt)[0]
    want = model(AttentionImpl.XLA).apply({"params": params}, tokens_bt, positions_bt, seg_bt)[0]
    real = (seg_bt != 0)[..., None]
    np.testing.assert_allclose(jnp.where(real, got, 0), jnp.where(real, want, 0),
                               rtol=2e-2, atol=2e-2)


@pytest.mark.slow  # ~15 s alone: three compiles of a model
def test_gpu_benchmark_script_runs_on_cpu(capsys, tmp_path):
    """benchmarks/gpu_kernels.py end to end at a tiny size (figures meaningless on CPU), its
    lines printed and its rows in --json_out."""
    root = pathlib.Path(__file__).resolve().parents[2]
    path = root / "benchmarks" / "gpu_kernels.py"
    module_spec = importlib.util.spec_from_file_location("gpu_kernels", path)
    bench = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(bench)
    bench.main(["--size=tiny", "--dtype=float32", f"--cluster={root / 'meshes' / 'cpu_8.py'}",
                "--attention=xla", "--batches=2", "--prompt=8", "--new=2", "--train_rows=2",
                "--train_len=8", "--repeats=1", f"--json_out={tmp_path / 'k.json'}"])
    out = capsys.readouterr().out
    for phase in ("train ", "prefill ", "decode ", "mismatch "):
        assert phase in out, out
    report = json.loads((tmp_path / "k.json").read_text())
    assert [r["phase"] for r in report["rows"]] == ["train", "prefill", "decode", "mismatch"]
    assert all(r["attention"] == r["runs_as"] == "xla" for r in report["rows"])
    decode = report["rows"][2]
    assert decode["batch"] == 2 and 0 < decode["fraction_of_roofline"], decode
    assert report["backend"] == "cpu" and report["jax_version"] == jax.__version__
