"""The rollout rows of `python -m jaxrlhf.bench --rollout=64,512,2048,tail`: generation alone.

Each row decodes the config's actor on its generation layout, random weights, GRPO groups
(`rollout.batch_size` prompts of `max_prompt_len` random tokens, each repeated `group_size`
times), every row's response length forced: `N` gives every row N tokens; `tail` draws each
row's length from a seeded lognormal with median 64 (sigma 1), clipped to [4, 1024]
(`tail:MAX` clips at MAX), the long-tailed lengths of reasoning RL.

Two decoders are timed alternately in one process, so that load from other processes hits
both alike:
  * engine: the `generate` call kind (`engine.generate.Generator` on the rollout engine);
  * static: the static-batch `generate` (every row decodes until the longest one ends, as the
    synchronous call did before the engine; its cost does not depend on how many rows are
    still live).
Useful tokens are the forced lengths' sum (tokens that are kept). The floor counts only live
tokens: each row's prompt and response FLOPs (`perf.flops`) over the measured matmul peak.
Occupancy is the share of the engine's decoded slot-steps that held a live row.
"""

from __future__ import annotations

import dataclasses
import functools
import statistics

import jax
import numpy as np

from jaxrlhf.engine.generate import GenerateConfig, decode_model, generate, make_generate_fn
from jaxrlhf.models.sizes import abstract_params
from jaxrlhf.perf import alternated
from jaxrlhf.perf.alternated import Column
from jaxrlhf.perf.flops import call_flops

TAIL_MEDIAN, TAIL_SIGMA, TAIL_LOW, TAIL_HIGH = 64, 1.0, 4, 1024


@dataclasses.dataclass(frozen=True)
class RolloutRow:
    """One row of the table: its name and every sequence's forced response length [b]."""

    name: str
    lengths_b: np.ndarray


def tail_lengths(rows: int, seed: int, high: int = TAIL_HIGH) -> np.ndarray:
    """int32 [rows] lognormal response lengths, median 64, clipped to [4, high]."""
    draw = np.random.default_rng(seed).lognormal(np.log(TAIL_MEDIAN), TAIL_SIGMA, rows)
    return np.clip(np.round(draw), TAIL_LOW, high).astype(np.int32)


def parse_rows(spec: str, rows: int, seed: int = 0) -> list[RolloutRow]:
    """`64,512,tail,tail:16` -> rows of forced lengths, for `rows` sequences."""
    out = []
    for part in filter(None, spec.split(",")):
        name, _, arg = part.partition(":")
        if name == "tail":
            high = int(arg) if arg else TAIL_HIGH
            out.append(RolloutRow(part, tail_lengths(rows, seed, high)))
        elif name.isdigit() and int(name) > 0 and not arg:
            out.append(RolloutRow(part, np.full(rows, int(name), np.int32)))
        else:
            raise ValueError(f"--rollout: {part!r} is neither a token count nor tail[:MAX]")
    return out


def grouped_prompts(batch: int, group: int, prompt_len: int, vocab: int, specials, seed: int):
    """(tokens [batch * group, P], mask): `batch` random prompts of ordinary tokens, each
    repeated `group` times in a row (a GRPO group)."""
    ordinary = np.array([t for t in range(min(vocab, 256)) if t not in set(specials)])
    tokens = np.random.default_rng(seed).choice(ordinary, size=(batch, prompt_len))
    tokens = np.repeat(tokens.astype(np.int32), group, axis=0)
    return tokens, np.ones_like(tokens, bool)


def measure_row(row: RolloutRow, model_config, layout, params, tokens_bp, mask_bp,
                gen_config: GenerateConfig, repeats: int, peak: float) -> dict:
    """One row's figures: engine and static seconds (medians of `repeats` alternated calls
    after one compiling call each), useful tokens/s, occupancy, compiles, floor on live
    tokens."""
    lengths_b = row.lengths_b
    cfg = dataclasses.replace(gen_config, max_new_tokens=int(lengths_b.max()),
                              force_max_length=True)
    prompt_len = tokens_bp.shape[1]
    engine = make_generate_fn(model_config, cfg, layout, prompt_buckets=(prompt_len,))
    rows = layout.batch_sharding(2)
    static = jax.jit(functools.partial(generate, decode_model(model_config, layout), cfg),
                     in_shardings=(layout.param_shardings(abstract_params(model_config)), rows,
                                   rows, layout.replicated()))
    rng = jax.random.key(0)
    placed = jax.device_put((tokens_bp, mask_bp), rows)
    calls = {"engine": lambda: engine(params, tokens_bp, mask_bp, rng, lengths_b),
             "static": lambda: static(params, *placed, rng)}
    warm = {name: alternated.timed(call) for name, call in calls.items()}  # compiles
    compiles, occupancy = engine.compiles, engine.occupancy
    seconds = alternated.seconds(calls, repeats)
    slot_steps, live = (after - before for after, before in zip(engine.occupancy, occupancy))
    useful = int(lengths_b.sum())
    engine_s, static_s = (statistics.median(seconds[name]) for name in ("engine", "static"))
    live_flops = sum(call_flops(model_config, "generate", 1, prompt_len + int(n))
                     for n in lengths_b)
    return {
        "row": row.name, "rows": len(lengths_b), "longest": int(lengths_b.max()),
        "useful_tokens": useful, "engine_seconds": engine_s, "static_seconds": static_s,
        "engine_seconds_all": seconds["engine"], "static_seconds_all": seconds["static"],
        "useful_tokens_per_s": useful / engine_s, "static_useful_tokens_per_s": useful / static_s,
        "speedup_vs_static": static_s / engine_s,
        "occupancy": live / max(slot_steps, 1),
        "compiles": compiles, "recompiles_after_warmup": engine.compiles - compiles,
        "warmup_seconds": warm["engine"],
        "floor_seconds_live": live_flops / peak,
        "fraction_of_floor_live": live_flops / peak / engine_s,
    }


COLUMNS = (
    Column("row", "row", 9), Column("longest", "longest", 7),
    Column("useful", "useful_tokens", 7), Column("engine s", "engine_seconds", 9, ".3f"),
    Column("static s", "static_seconds", 9, ".3f"),
    Column("tok/s", "useful_tokens_per_s", 8, ".0f"),
    Column("x static", "speedup_vs_static", 8, ".2f"), Column("occup.", "occupancy", 6, ".2f"),
    Column("floor%", "fraction_of_floor_live", 6, ".1f", scale=100),
    Column("compiles", "compiles", 8), Column("recomp.", "recompiles_after_warmup", 7),
)


def table(rows: list[dict]) -> str:
    """The rows (`measure_row`'s figures) as a text table."""
    return alternated.table(rows, COLUMNS)
