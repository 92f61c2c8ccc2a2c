"""`python -m jaxrlhf.bench --config=configs/grpo_bench_cpu.py [--steps=3] [--profile=DIR]`

Measures an RL algorithm's step the way the papers do (ReaL, HybridFlow): synthetic prompts at
the maximum prompt length, generation forced to the maximum length, randomly initialised models
of the configured sizes, and a reward that scores nothing. The first step (which compiles) is
not counted; figures are medians over the measured steps.

Everything is set against the machine's FLOP floor measured in the same process
(`jaxrlhf.perf`): a jitted matmul probe at the workload's dtype gives the peak FLOP/s, and each
MFC and the step get model FLOPs, floor seconds (FLOPs / peak), the fraction of the floor
reached, MFU over only that MFC's devices (never above 1), and XLA's peak memory per device.
The probe runs before and after the steps and the better counts (load only slows it); if a call
still runs faster than the probe allows, every row's peak is raised by that ratio (printed), so no
fraction of the floor or MFU exceeds 1. It prints that table, then one JSON line with every figure
and the host's RSS.
`--profile=DIR` writes a JAX profiler trace of one more step (not counted).

`--rollout=64,512,2048,tail` measures generation alone instead, one row per entry
(`jaxrlhf.perf.rollout_rows`: the rollout engine against the static batch, useful tokens/s,
slot occupancy, compiles, the floor counted on live tokens), with `--steps` timed calls per
row; `--json_out=PATH` also writes the rows as JSON.

`--packing=tail` measures the actor's train step alone on those lengths (`jaxrlhf.perf.
packing_rows`: sequences packed into rows against one padded sequence per row, alternated,
trained tokens/s of both), with `--steps` timed steps of each per row.
"""

from __future__ import annotations

import contextlib
import json
import statistics
import time

import numpy as np
from absl import flags
from ml_collections import config_flags

from jaxrlhf import cli
from jaxrlhf.backend import use_cpu_devices

_CONFIG = config_flags.DEFINE_config_file("config", None, "experiment config", lock_config=True)
_STEPS = flags.DEFINE_integer("steps", 3, "measured steps (after one compile step)")
_PROFILE = flags.DEFINE_string("profile", "", "write a JAX profiler trace of one step here")
_ROLLOUT = flags.DEFINE_string("rollout", "", "generation alone, one row per entry: new-token "
                               "counts and tail[:MAX] (e.g. 64,512,2048,tail)")
_PACKING = flags.DEFINE_string("packing", "", "the actor's train step alone, packed against "
                               "padded, one row per entry: new-token counts and tail[:MAX]")
_JSON_OUT = flags.DEFINE_string("json_out", "", "also write the figures as JSON here")


def synthetic_prompts(config, tokenizer, seed: int) -> dict:
    """Random ordinary-token prompts, every one at the maximum prompt length."""
    r = config.rollout
    rows = r.batch_size * r.group_size
    specials = {tokenizer.pad_id, tokenizer.eos_id, tokenizer.bos_id, *tokenizer.stop_ids}
    ordinary = np.array([t for t in range(min(tokenizer.vocab_size, 256)) if t not in specials])
    rng = np.random.default_rng(seed)
    tokens = rng.choice(ordinary, size=(rows, r.max_prompt_len)).astype(np.int32)
    return {"prompt_tokens_bp": tokens, "prompt_mask_bp": np.ones_like(tokens, bool),
            "prompt_text": [""] * rows, "answer": [""] * rows}


@contextlib.contextmanager
def built_run(config, tokenizer):
    """(setup, runner) of the RL job, actor randomly initialised: the only building code here."""
    import tempfile
    import types

    from jaxrlhf.run import build
    from jaxrlhf.run.check import check_config

    job = check_config(config, tempfile.mkdtemp(prefix="jaxrlhf-bench-"))
    # What the figures below read of the run: its graph, plan, model configs and algorithm.
    setup = types.SimpleNamespace(graph=job.spec.graph, plan=job.plan,
                                  models=job.spec.model_configs(), algorithm=job.spec.algorithm)
    with build.host_pools(job.spec) as pools:
        runner = build.fresh_runner(job, pools)
        try:
            yield setup, runner
        finally:
            runner.close()


def mfc_figures(setup, runner, config, timings, machine_peak: float):
    """Figures per device MFC, then the step's, with peak memory per MFC (bytes)."""
    from jaxrlhf.perf import floor, report
    from jaxrlhf.perf.flops import Figures, call_flops, with_peak_no_call_beat

    r = config.rollout
    rows, context = r.batch_size * r.group_size, r.max_prompt_len + r.max_new_tokens
    figures, memory = [], {}
    for mfc in setup.graph.mfcs:
        if mfc.host:
            continue
        devices = setup.plan.layouts[mfc.name].devices
        flops = call_flops(setup.models[mfc.role], mfc.call.value, rows, context,
                           updates=config.ppo.epochs)
        seconds = report.median_seconds(timings, mfc.name)
        figures.append(Figures(mfc.name, seconds, flops, len(devices),
                               floor.devices_peak(devices, machine_peak, config.models.actor.dtype), machine_peak))
        memory[mfc.name] = report.compiled_peak_bytes(
            runner.engines[mfc.name].compile_cache.executables())
    total = sum(f.flops for f in figures)
    n_dev = len({d for m in setup.graph.mfcs if not m.host
                 for d in setup.plan.layouts[m.name].devices})
    figures.append(Figures("step", report.median_seconds(timings), total, n_dev, machine_peak,
                           machine_peak))
    figures, raised_by = with_peak_no_call_beat(figures)
    return figures, memory, raised_by


def rollout_main(config, spec: str) -> dict:
    """The rollout rows (module docstring): prints their table, returns their figures."""
    import tempfile

    import jax

    from jaxrlhf.parallel.layout import init_params
    from jaxrlhf.perf import floor, rollout_rows
    from jaxrlhf.run.check import check_config

    try:
        rows = rollout_rows.parse_rows(spec, config.rollout.batch_size * config.rollout.group_size)
    except ValueError as e:
        cli.bad_input(str(e))
    job = check_config(config, tempfile.mkdtemp(prefix="jaxrlhf-bench-"))
    r, tokenizer = job.spec.rollout, job.tokenizer
    gen_mfc = next(m for m in job.spec.graph.mfcs if m.call.value == "generate")
    layout = job.plan.layouts[gen_mfc.name]
    model = job.spec.model_configs()[gen_mfc.role]
    # Positions past the model's maximum: RoPE computes them like any other (shape benchmark).
    longest = max(int(row.lengths_b.max()) for row in rows)
    model = model.replace(max_position_embeddings=max(model.max_position_embeddings,
                                                      r.max_prompt_len + longest))
    params = init_params(model, layout, jax.random.key(0))
    tokens_bp, mask_bp = rollout_rows.grouped_prompts(
        r.batch_size, r.group_size, r.max_prompt_len, tokenizer.vocab_size,
        (tokenizer.pad_id, tokenizer.eos_id, tokenizer.bos_id, *tokenizer.stop_ids), seed=0)
    peak = floor.machine_peak(model.dtype)
    figures = []
    for row in rows:
        figures.append(rollout_rows.measure_row(row, model, layout, params, tokens_bp, mask_bp,
                                                r.generate(tokenizer), _STEPS.value, peak))
        print(f"row {row.name}: engine {figures[-1]['engine_seconds']:.3f} s", flush=True)
    first, peak = peak, max(peak, floor.machine_peak(model.dtype, again=True))
    for f in figures:  # the better probe (load only slows it) sets every row's floor
        f["floor_seconds_live"] *= first / peak
        f["fraction_of_floor_live"] = f["floor_seconds_live"] / f["engine_seconds"]
    print(rollout_rows.table(figures))
    return {"mode": "rollout", "layout": str(layout), "devices": len(jax.devices()),
            "device_kind": jax.devices()[0].device_kind, "peak_gflops_per_s": peak / 1e9,
            "dtype": jax.numpy.dtype(model.dtype).name, "rows": figures}


def packing_main(config, spec: str) -> dict:
    """The packing rows (module docstring): prints their table, returns their figures."""
    import tempfile

    import jax

    from jaxrlhf.parallel.layout import init_params
    from jaxrlhf.perf import packing_rows, rollout_rows
    from jaxrlhf.run.check import check_config

    try:
        rows = rollout_rows.parse_rows(spec, config.rollout.batch_size * config.rollout.group_size)
    except ValueError as e:
        cli.bad_input(str(e))
    longest = max(int(row.lengths_b.max()) for row in rows)
    config.unlock()
    config.rollout.max_new_tokens = max(config.rollout.max_new_tokens, longest)
    job = check_config(config, tempfile.mkdtemp(prefix="jaxrlhf-bench-"))
    r = job.spec.rollout
    train_mfc = next(m for m in job.spec.graph.mfcs
                     if m.call.value == "train_step" and m.role.value == "actor")
    layout = job.plan.layouts[train_mfc.name]
    model = job.spec.model_configs()[train_mfc.role]
    model = model.replace(max_position_embeddings=max(model.max_position_embeddings,
                                                      r.max_prompt_len + r.max_new_tokens))
    params = init_params(model, layout, jax.random.key(0))
    figures = []
    for row in rows:
        figures.append(packing_rows.measure_row(
            row, job.spec.algorithm, model, layout, params, r.max_prompt_len, r.max_new_tokens,
            r.group_size, _STEPS.value))
        print(f"row {row.name}: packed {figures[-1]['packed_seconds']:.3f} s, padded "
              f"{figures[-1]['padded_seconds']:.3f} s", flush=True)
    print(packing_rows.table(figures))
    return {"mode": "packing", "layout": str(layout), "devices": len(jax.devices()),
            "device_kind": jax.devices()[0].device_kind, "rows": figures}


def main():
    config = _CONFIG.value
    use_cpu_devices(config.cpu_devices)
    import jax

    if _ROLLOUT.value or _PACKING.value:
        figures = (rollout_main(config, _ROLLOUT.value) if _ROLLOUT.value
                   else packing_main(config, _PACKING.value))
        print(json.dumps(figures))
        if _JSON_OUT.value:
            with open(_JSON_OUT.value, "w") as f:
                json.dump(figures, f, indent=1)
        return

    from jaxrlhf.data.tokenizer import load_tokenizer
    from jaxrlhf.dataflow.timeline import time_table
    from jaxrlhf.perf import floor, report

    config.unlock()
    config.rollout.force_max_length = True
    config.reward.function = "zero"
    tokenizer = load_tokenizer(config.tokenizer)
    machine_peak = floor.machine_peak(config.models.actor.dtype)
    timings, cpu_seconds = [], []
    with built_run(config, tokenizer) as (setup, runner):
        for step in range(_STEPS.value + 1):
            start = time.process_time()
            timings.append(runner.step(synthetic_prompts(config, tokenizer, step)).timing)
            cpu_seconds.append(time.process_time() - start)
        if _PROFILE.value:
            with jax.profiler.trace(_PROFILE.value):
                runner.step(synthetic_prompts(config, tokenizer, _STEPS.value + 1))
        measured = timings[1:]
        probe = max(machine_peak, floor.machine_peak(config.models.actor.dtype, again=True))
        figures, memory, raised_by = mfc_figures(setup, runner, config, measured, probe)
        print(time_table(measured, setup.plan.specs))
    print(f"peak: probe {probe / 1e9:.1f} GFLOP/s (best of before and after the steps)"
          + (f", raised x{raised_by:.2f} to the rate a call reached" if raised_by > 1 else ""))
    print(report.table(figures, memory))
    step = figures[-1]
    r = config.rollout
    tokens = r.batch_size * r.group_size * (r.max_prompt_len + r.max_new_tokens)
    rss, rss_peak = report.host_rss_bytes()
    print(json.dumps({
        "algorithm": setup.algorithm.name, "step_seconds": step.seconds,
        "tokens_per_second": tokens / step.seconds, "mfu": step.mfu,
        "fraction_of_floor": step.fraction_of_floor, "floor_seconds": step.floor_seconds,
        "peak_gflops_per_s": step.machine_peak / 1e9, "probe_gflops_per_s": probe / 1e9,
        "probe_raised_by": raised_by, "dtype": config.models.actor.dtype,
        "devices": len(jax.devices()), "placement": dict(setup.plan.specs),
        "mfcs": {f.name: {**f.as_dict(), **({"peak_bytes": memory[f.name]}
                                             if f.name in memory else {})} for f in figures},
        "host_rss_bytes": rss, "host_rss_peak_bytes": rss_peak,
        "step_seconds_all": [t.seconds for t in measured],
        # CPU seconds of this process per step (all threads): less sensitive than wall time to
        # other processes on shared cores, so A/B comparisons use it too.
        "step_cpu_seconds": statistics.median(cpu_seconds[1:]),
    }))


if __name__ == "__main__":
    flags.mark_flag_as_required("config")
    cli.run(main)
