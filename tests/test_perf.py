"""FLOP accounting and MFU of the bench (`jaxrlhf.perf`): known workloads, MFU <= 1."""

import time

import jax
import jax.numpy as jnp
import pytest

from jaxrlhf.engine.inference import InferenceBatch
from jaxrlhf.models.sizes import get_size
from jaxrlhf.models.transformer import Transformer
from jaxrlhf.perf import floor
from jaxrlhf.models.sizes import matmul_params
from jaxrlhf.perf.flops import (Figures, call_flops, forward_flops_per_token,
                                with_peak_no_call_beat)


def test_w_cpu_step_flops():
    """W-cpu (issue 10): 64 rows x 96 tokens, generate + ref inference + train = ~258 GFLOP."""
    cfg = get_size("bench", dtype=jnp.float32)
    assert matmul_params(cfg) == 4 * (256 * 8 * 64 + 256 * 256 + 3 * 256 * 1024) + 256 * 272
    total = sum(call_flops(cfg, call, 64, 96) for call in ("generate", "inference",
                                                             "train_step"))
    assert total == pytest.approx(5 * 64 * 96 * forward_flops_per_token(cfg, 96))
    assert 255e9 < total < 261e9
    assert call_flops(cfg, "train_step", 64, 96, updates=2) == 2 * call_flops(
        cfg, "train_step", 64, 96)


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="XLA:GPU's cost analysis leaves "
                    "out the matmuls it hands to cuBLAS (it counted 12% of them on an H200)")
def test_forward_flops_match_xla_cost_analysis():
    """The model-FLOP formula against XLA's own count of the compiled forward pass.

    XLA also counts elementwise work (norms, softmax, SwiGLU), so it may be a little higher,
    never lower than the matmuls the formula counts. Unrolled layers: XLA's count sees a
    scanned loop's body once.
    """
    cfg = get_size("bench", dtype=jnp.float32, scan_layers=False)
    model = Transformer(cfg)
    rows, length = 4, 96
    batch = InferenceBatch.padded(jnp.ones((rows, length), jnp.int32),
                                  jnp.ones((rows, length), jnp.int32))
    params = jax.eval_shape(lambda: model.init(jax.random.key(0), *batch)["params"])
    compiled = jax.jit(lambda p, b: model.apply({"params": p}, *b)[0]).lower(
        params, batch).compile()
    analysis = compiled.cost_analysis()
    xla_flops = (analysis[0] if isinstance(analysis, list) else analysis)["flops"]
    formula = call_flops(cfg, "inference", rows, length)
    assert formula <= xla_flops <= 1.1 * formula


def test_mfu_of_a_known_matmul_is_at_most_one():
    """A matmul of exactly 2·n³ FLOPs timed here: MFU = rate / probe peak, and <= 1."""
    n = 512
    a = jnp.ones((n, n), jnp.float32)
    matmul = jax.jit(lambda x: x @ x)
    jax.block_until_ready(matmul(a))
    start = time.perf_counter()
    jax.block_until_ready(matmul(a))
    seconds = time.perf_counter() - start
    devices = jax.devices()[:1]
    peak = floor.matmul_peak(devices, jnp.float32, size=512, repeats=2)
    machine = floor.machine_peak(jnp.float32, size=512, repeats=2)
    assert machine >= peak > 0
    fig = Figures("matmul", seconds, 2.0 * n**3, 1, peak, machine)
    assert 0 < fig.mfu <= 1.0
    if not fig.peak_raised:
        assert fig.mfu == pytest.approx(2.0 * n**3 / seconds / peak)
    assert fig.floor_seconds == pytest.approx(2.0 * n**3 / machine)


def test_mfu_never_exceeds_one_when_the_probe_underestimates():
    """A run faster than the probe raises the peak used (flagged) instead of reporting MFU > 1."""
    fig = Figures("gen", seconds=1.0, flops=4e9, devices=1, peak=2e9, machine_peak=2e9)
    assert fig.peak_raised and fig.mfu == 1.0
    slow = Figures("gen", seconds=4.0, flops=4e9, devices=2, peak=2e9, machine_peak=2e9)
    assert not slow.peak_raised and slow.mfu == pytest.approx(0.5)
    assert slow.fraction_of_floor == pytest.approx(0.5) and slow.floor_seconds == 2.0


def test_one_peak_for_a_run_where_a_call_beat_the_probe():
    """A call faster than its probe raises every row's peak by the same ratio: no MFU and no
    fraction of the floor above 1, and the rows keep their order."""
    rows = [Figures("gen", seconds=1.0, flops=2e9, devices=1, peak=1e9, machine_peak=1e9),
            Figures("ref", seconds=1.0, flops=3e9, devices=1, peak=1e9, machine_peak=1e9),
            Figures("step", seconds=8.0, flops=5e9, devices=1, peak=1e9, machine_peak=1e9)]
    assert rows[1].fraction_of_floor == 3.0  # the probe was slowed: a fraction above 1
    scaled, factor = with_peak_no_call_beat(rows)
    assert factor == 3.0
    assert [f.fraction_of_floor for f in scaled] == pytest.approx([2 / 3, 1.0, 5 / 24])
    assert all(f.mfu <= 1.0 and not f.peak_raised for f in scaled)
    unchanged, factor = with_peak_no_call_beat([rows[2]])
    assert factor == 1.0 and unchanged == [rows[2]]
