"""`python -m jaxrlhf.bench --config=configs/grpo_bench_cpu.py [--steps=3] [--profile=DIR]`

Measures an RL algorithm's step the way the papers do (ReaL, HybridFlow): synthetic prompts at
the maximum prompt length, generation forced to the maximum length, randomly initialised models
of the configured sizes, and a reward that scores nothing. The first step (which compiles) is
not counted.

Everything is set against the machine's FLOP floor measured in the same process, in rounds
(`jaxrlhf.perf.rounds`): each of `--steps` rounds times the matmul probe at the workload's
dtype (the machine's FLOP/s), a whole step, then each device MFC alone on the step's buffer
(its executor, as the step calls it), on the wall clock and in CPU seconds of the process.
Each call's fraction of the floor (model FLOPs at the probe's rate, over its seconds) is taken
per round against that round's probe, and printed as the median with the lowest and highest
round, on both clocks: on shared cores the wall clock follows other processes' load, CPU
seconds much less. Per call also its MFU (over only its own devices) and XLA's peak memory
per device; the scheduler's time table of the rounds' steps comes first, and one JSON line
with every figure and the host's RSS last.
`--profile=DIR` writes a JAX profiler trace of one more step (not counted).

`--rollout=64,512,2048,tail` measures generation alone instead, one row per entry
(`jaxrlhf.perf.rollout_rows`: the rollout engine against the static batch, useful tokens/s,
slot occupancy, compiles, the floor counted on live tokens), with `--steps` timed calls per
row; `--json_out=PATH` also writes the rows as JSON.

The JSON also says how many executables came from the persistent compilation cache
(`compile.cache_dir`): with a warm cache the first step's (a row's warm-up's) compiles are
loads, as in a restart.

`--packing=tail` measures the actor's train step alone on those lengths (`jaxrlhf.perf.
packing_rows`: sequences packed into rows against one padded sequence per row, alternated,
trained tokens/s of both), with `--steps` timed steps of each per row.
"""

from __future__ import annotations

import collections
import contextlib
import json

import numpy as np
from absl import flags
from ml_collections import config_flags

from jaxrlhf import cli
from jaxrlhf import backend
from jaxrlhf.backend import use_cpu_devices

_CONFIG = config_flags.DEFINE_config_file("config", None, "experiment config", lock_config=True)
_STEPS = flags.DEFINE_integer("steps", 3, "measured rounds (after one compile step): "
                              "the probe, a step, each MFC alone", lower_bound=1)
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


def floor_calls(setup, runner, config, step_call):
    """name -> (call, model FLOPs) of what the floor rounds time: the whole step (`step_call`),
    then each device MFC alone on the latest step's buffer (its executor, as the step runs it:
    inputs moved to its layout, parameters fetched, its engine call; a train step trains)."""
    from jaxrlhf.perf.flops import call_flops

    r = config.rollout
    rows, context = r.batch_size * r.group_size, r.max_prompt_len + r.max_new_tokens
    executors = runner.scheduler.executors
    mfcs = {m.name: call_flops(setup.models[m.role], m.call.value, rows, context,
                               updates=config.ppo.epochs)
            for m in setup.graph.mfcs if not m.host}
    calls = {"step": (step_call, sum(mfcs.values()))}
    for name, flops in mfcs.items():
        calls[name] = (lambda name=name: executors[name](step_call.buffer), flops)
    return calls


class _Steps:
    """Calls of the runner's step on fresh synthetic prompts, keeping each step's timing and
    buffer (what the MFCs timed alone read)."""

    def __init__(self, runner, config, tokenizer):
        self.runner, self.config, self.tokenizer = runner, config, tokenizer
        self.timings, self.buffer = [], None

    def __call__(self) -> None:
        result = self.runner.step(synthetic_prompts(self.config, self.tokenizer,
                                                    self.runner.step_index))
        self.timings.append(result.timing)
        self.buffer = result.buffer


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
        _write_json({"mode": "rollout", "partial": True, "rows": figures})  # a cut run keeps it
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


def _write_json(figures: dict) -> None:
    """`--json_out`'s file, rewritten whole (after each rollout row, then at the end)."""
    if _JSON_OUT.value:
        with open(_JSON_OUT.value, "w") as f:
            json.dump(figures, f, indent=1)


def _cache_events() -> collections.Counter:
    """JAX's events of this process from now on, counted by name (its compilation cache's)."""
    import jax

    events = collections.Counter()
    jax.monitoring.register_event_listener(lambda event, **_: events.update([event]))
    return events


def _cache_figures(events: collections.Counter) -> dict:
    """The persistent compilation cache: its directory (None: none), the compiles that went
    through it, how many of them it answered."""
    import jax

    return {"dir": jax.config.jax_compilation_cache_dir,
            "compiles": events[backend.CACHE_REQUEST_EVENT],
            "loaded": events[backend.CACHE_HIT_EVENT]}


def main():
    config = _CONFIG.value
    use_cpu_devices(config.cpu_devices)
    import jax

    events = _cache_events()
    if _ROLLOUT.value or _PACKING.value:
        figures = (rollout_main(config, _ROLLOUT.value) if _ROLLOUT.value
                   else packing_main(config, _PACKING.value))
        figures["compile_cache"] = _cache_figures(events)
        print(json.dumps(figures))
        _write_json(figures)
        return

    from jaxrlhf.data.tokenizer import load_tokenizer
    from jaxrlhf.dataflow.timeline import time_table
    from jaxrlhf.perf import floor, report, rounds

    config.unlock()
    config.rollout.force_max_length = True
    config.reward.function = "zero"
    tokenizer = load_tokenizer(config.tokenizer)
    probe, probe_flops = floor.machine_probe(config.models.actor.dtype)
    with built_run(config, tokenizer) as (setup, runner):
        steps = _Steps(runner, config, tokenizer)
        steps()  # compiles every MFC
        steps.timings.clear()
        calls = floor_calls(setup, runner, config, steps)
        measured = rounds.measure(probe, probe_flops, calls, _STEPS.value)
        if _PROFILE.value:
            with jax.profiler.trace(_PROFILE.value):
                steps()
        memory = {name: report.compiled_peak_bytes(
            runner.engines[name].compile_cache.executables()) for name in calls if name != "step"}
        devices = {name: len(setup.plan.layouts[name].devices) for name in memory}
        print(time_table(steps.timings[:_STEPS.value], setup.plan.specs))
    devices["step"] = len(jax.devices())
    print(report.floor_table(measured, devices, memory))
    r = config.rollout
    tokens = r.batch_size * r.group_size * (r.max_prompt_len + r.max_new_tokens)
    rss, rss_peak = report.host_rss_bytes()
    step = measured.rows[0]
    print(json.dumps({
        "algorithm": setup.algorithm.name, "step_seconds": step.seconds(rounds.Clock.WALL).median,
        "tokens_per_second": tokens / step.seconds(rounds.Clock.WALL).median,
        **report.floor_figures(measured, devices, memory), "dtype": config.models.actor.dtype,
        "devices": len(jax.devices()), "placement": dict(setup.plan.specs),
        "host_rss_bytes": rss, "host_rss_peak_bytes": rss_peak,
        "compile_cache": _cache_figures(events),
    }))

if __name__ == "__main__":
    flags.mark_flag_as_required("config")
    cli.run(main)
