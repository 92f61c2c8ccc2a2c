"""FLOP accounting and the floor rounds of the bench (`jaxrlhf.perf`): known workloads, fractions\nof the floor taken per round."""

import time

import jax
import jax.numpy as jnp
import pytest

from jaxrlhf.engine.inference import InferenceBatch
from jaxrlhf.models.sizes import get_size
from jaxrlhf.models.transformer import Transformer
from jaxrlhf.models.sizes import matmul_params
from jaxrlhf.perf import floor, rounds
from jaxrlhf.perf.flops import call_flops, forward_flops_per_token


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


def test_machine_probe_is_a_compiled_matmul():
    """The probe a benchmark's rounds time: a compiled matmul of 2·n³ FLOPs whose rate is the
    machine's peak, within the timing noise of the cached probes."""
    call, flops = floor.machine_probe(jnp.float32, size=256)
    assert flops == 2.0 * 256**3
    out = jax.block_until_ready(call())
    assert out.shape == (256, 256) and out.dtype == jnp.float32
    assert floor.machine_peak(jnp.float32, size=256, repeats=2) > 0


def test_fractions_are_taken_per_round_against_that_rounds_probe():
    """A round slowed by load slows the probe and the call alike: its fraction stays, where a
    fraction against another round's probe would not. Median, lowest and highest round; the
    best call against the best probe."""
    S = rounds.Seconds
    row = rounds.Row("ref_inf", flops=10.0, seconds_r=(S(2.0, 4.0), S(8.0, 4.0), S(2.5, 5.0)))
    measured = rounds.Rounds(probe_flops=20.0, probe_r=(S(1.0, 2.0), S(4.0, 2.0), S(1.0, 2.0)),
                             rows=(row,))
    wall = measured.fraction(row, rounds.Clock.WALL)
    assert (wall.median, wall.low, wall.high) == pytest.approx((0.25, 0.2, 0.25))
    cpu = measured.fraction(row, rounds.Clock.CPU)
    assert (cpu.median, cpu.low, cpu.high) == pytest.approx((0.25, 0.2, 0.25))
    assert measured.best_fraction(row, rounds.Clock.WALL) == pytest.approx(0.25)
    assert measured.peak(rounds.Clock.WALL).low == pytest.approx(5.0)
    assert wall.percent() == "25.0% (20.0-25.0)"


def test_rounds_interleave_the_probe_and_the_calls_on_both_clocks():
    """Each round runs the probe (best of its calls), then every call once, in order; the CPU
    clock counts this process's CPU seconds, not time spent waiting."""
    order = []
    probe = lambda: order.append("probe")
    spin = lambda: order.append("spin") or sum(range(200_000))
    sleep = lambda: order.append("sleep") or time.sleep(0.05)
    measured = rounds.measure(probe, 1.0, {"spin": (spin, 1.0), "sleep": (sleep, 1.0)},
                              rounds=2, probe_calls=2)
    assert order == ["probe"] + 2 * ["probe", "probe", "spin", "sleep"]
    spin_row, sleep_row = measured.rows
    assert [r.name for r in measured.rows] == ["spin", "sleep"] and len(measured.probe_r) == 2
    assert all(s.wall >= 0.05 and s.cpu < 0.5 * s.wall for s in sleep_row.seconds_r)
    assert all(s.cpu > 0 for s in spin_row.seconds_r)


@pytest.mark.slow  # a W-cpu smoke job, compiles and one round: ~30 s
def test_bench_prints_each_calls_fraction_per_round():
    """`python -m jaxrlhf.bench` end to end: the JSON line has every device MFC and the step,
    each with one timing per round on both clocks and its fractions' median within their
    range."""
    import json
    import os
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-m", "jaxrlhf.bench", "--config=configs/grpo_bench_cpu.py:smoke,d1",
         "--steps=2"], capture_output=True, text=True, timeout=600,
        cwd=os.path.dirname(os.path.dirname(__file__)))
    assert out.returncode == 0, out.stderr[-2000:]
    figures = json.loads(out.stdout.strip().splitlines()[-1])
    assert set(figures["calls"]) == {"step", "actor_gen", "ref_inf", "actor_train"}
    assert figures["rounds"] == 2 and figures["peak_gflops_per_s"] > 0
    for name, call in figures["calls"].items():
        for clock in ("wall", "cpu"):
            assert len(call[clock]["seconds"]) == 2, name
            f = call[clock]["fraction_of_floor"]
            assert 0 < f["low"] <= f["median"] <= f["high"], (name, clock)
