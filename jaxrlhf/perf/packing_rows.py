"""The packing rows of `python -m jaxrlhf.bench --packing=tail`: the actor's train step alone.

Each row trains the config's actor with its algorithm's loss (GRPO on W-cpu) on one batch of
`rollout.batch_size × group_size` generated rows: prompts of `max_prompt_len` tokens, response
lengths forced as in the rollout rows (`N`, or `tail`: lognormal, median 64, clipped to
[4, 1024]; `perf.rollout_rows`), the batch cut to the first response width its longest response
fits (`engine.buckets.response_widths`, as the step does after generation). Two train steps
are timed alternately in one process, so that load from other processes hits both alike:
  * packed: the train step as it runs (`engine.packing.Rows.PACKED`: sequences packed into rows
    of the batch's width);
  * padded: the same step on the rows as they come (`Rows.PADDED`: one sequence per row, every
    row computed at the batch's width; the identity plan through the same code, so the
    difference is the packing alone).
Trained tokens are the prompt and response tokens of every row (no padding); tokens/s is
trained tokens over the step's median seconds.
"""

from __future__ import annotations

import statistics

import jax
import jax.numpy as jnp
import numpy as np

from jaxrlhf.algorithms.spec import Algorithm
from jaxrlhf.engine import buckets, packing
from jaxrlhf.engine.microbatch import MicrobatchConfig
from jaxrlhf.engine.optimizer import OptimizerConfig
from jaxrlhf.engine.train_step import create_train_state, make_train_step
from jaxrlhf.mfc import Role
from jaxrlhf.perf import alternated
from jaxrlhf.perf.alternated import Column
from jaxrlhf.perf.rollout_rows import RolloutRow


def step_buffer(lengths_b: np.ndarray, prompt_len: int, max_new_tokens: int, vocab: int,
                group_size: int, seed: int) -> dict:
    """The step buffer a generate call leaves for `lengths_b` [b] forced responses: random
    tokens, full prompts, responses right-padded to the first response width that fits."""
    rng = np.random.default_rng(seed)
    rows = len(lengths_b)
    width = buckets.bucket_length(int(lengths_b.max()), buckets.response_widths(max_new_tokens))
    mask_bn = (np.arange(width)[None] < lengths_b[:, None]).astype(np.float32)
    seq_mask = np.concatenate([np.ones((rows, prompt_len), np.float32), mask_bn], axis=1)
    tokens = rng.integers(1, vocab, seq_mask.shape).astype(np.int32) * (seq_mask > 0)
    logp = lambda: (-np.abs(rng.normal(size=(rows, width))) - 3.0).astype(np.float32) * mask_bn
    scores = rng.normal(size=rows // group_size * group_size).astype(np.float32)
    return {"seq_tokens_bs": tokens.astype(np.int32), "seq_mask_bs": seq_mask,
            "response_mask_bn": mask_bn, "behav_logp_bn": logp(), "ref_logp_bn": logp(),
            "scores_b": scores, "values_bn": np.zeros((rows, width), np.float32)}


def measure_row(row: RolloutRow, algorithm: Algorithm, model_config, layout, params,
                prompt_len: int, max_new_tokens: int, group_size: int, repeats: int) -> dict:
    """One row's figures: packed and padded step seconds (medians of `repeats` alternated
    steps after one compiling step each), trained tokens/s of both, packed rows."""
    train = algorithm.train[Role.ACTOR]
    buf = step_buffer(row.lengths_b, prompt_len, max_new_tokens, model_config.vocab_size,
                      group_size, seed=0)
    controller = jax.tree.map(jnp.float32, dict(algorithm.controller_init))
    batch, _ = jax.jit(train.prepare)(buf, controller)
    opt = OptimizerConfig(lr=1e-5)
    steps, states = {}, {}
    for rows in (packing.Rows.PACKED, packing.Rows.PADDED):
        steps[rows] = make_train_step(model_config, layout, train.loss_fn, opt,
                                      MicrobatchConfig.by_count(1), train.readout, rows)
        states[rows] = create_train_state(jax.tree.map(jnp.copy, params), model_config,
                                          layout, opt)

    def call(rows):
        states[rows], metrics = steps[rows](states[rows], batch)
        return metrics

    calls = {rows: (lambda rows=rows: call(rows)) for rows in steps}
    for fn in calls.values():  # compiles
        alternated.timed(fn)
    seconds = alternated.seconds(calls, repeats)
    trained = int(np.count_nonzero(buf["seq_mask_bs"]))
    packed_s, padded_s = (statistics.median(seconds[r]) for r in steps)
    _, plan = steps[packing.Rows.PACKED].plan(batch)
    return {
        "row": row.name, "rows": len(row.lengths_b), "longest": int(row.lengths_b.max()),
        "width": int(buf["seq_mask_bs"].shape[1]), "packed_rows": plan.rows,
        "trained_tokens": trained, "padded_slots": int(buf["seq_mask_bs"].size),
        "packed_seconds": packed_s, "padded_seconds": padded_s,
        "packed_seconds_all": seconds[packing.Rows.PACKED],
        "padded_seconds_all": seconds[packing.Rows.PADDED],
        "packed_tokens_per_s": trained / packed_s, "padded_tokens_per_s": trained / padded_s,
        "speedup": padded_s / packed_s,
        "compiles": {r.value: steps[r].compiles for r in steps},
    }


COLUMNS = (
    Column("row", "row", 9), Column("longest", "longest", 7), Column("width", "width", 5),
    Column("rows", "rows", 4), Column("packed", "packed_rows", 6),
    Column("tokens", "trained_tokens", 7), Column("packed s", "packed_seconds", 9, ".3f"),
    Column("padded s", "padded_seconds", 9, ".3f"),
    Column("packed tok/s", "packed_tokens_per_s", 12, ".0f"),
    Column("padded tok/s", "padded_tokens_per_s", 12, ".0f"), Column("x", "speedup", 5, ".2f"),
)


def table(rows: list[dict]) -> str:
    """The rows (`measure_row`'s figures) as a text table."""
    return alternated.table(rows, COLUMNS)
