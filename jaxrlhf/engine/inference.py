"""The `inference` call kind: one forward pass per batch, one jit per (kind, layout).

Three kinds:
  * LOGPROBS (actor, ref): log p(token_t | tokens_<t) of every token, optionally the entropy of
    that predictive distribution, at a given temperature so it matches generation;
  * VALUES (critic, scalar head): the value at every token;
  * SCORES (reward / cost, scalar head): the value at the last token of each sequence.

Batches are either PADDED (one sequence per row: left-padded prompt + right-padded response,
segment id 1 on real tokens, 0 on padding) or PACKED (several sequences per row with segment ids
1..k and positions restarting at 0 for each). `InferenceBatch.padded` / `.packed` build them;
the model itself only ever sees (tokens, positions, segment ids), so both go through the same
executable. Outputs are aligned with the input tokens: entry t belongs to token t, and is 0 where
it has no meaning (padding; the first token of a sequence for log-probs).
"""

from __future__ import annotations

import dataclasses
import enum
import functools
from collections.abc import Sequence
from typing import NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from jaxrlhf.engine import buckets, packing, replay, sampling
from jaxrlhf.engine.call import BucketedCall, abstract
from jaxrlhf.models import moe
from jaxrlhf.models.config import HeadKind, ModelConfig
from jaxrlhf.models.sizes import abstract_params
from jaxrlhf.models.transformer import Transformer, final_norm, head_kernel, head_out
from jaxrlhf.parallel.layout import Layout, Platform, check_batch_divisible
from jaxrlhf.parallel.pipeline import Pipeline, layer_stack, merge_rows, split_rows
from jaxrlhf.parallel.reshard import fetch, transfer


class InferenceKind(enum.Enum):
    LOGPROBS = "logprobs"  # LM head: per-token log-probs (+ entropy)
    VALUES = "values"  # scalar head: per-token values
    SCORES = "scores"  # scalar head: one value per sequence, at its last token


@dataclasses.dataclass(frozen=True)
class InferenceConfig:
    """Static settings of one inference call kind.

    Attributes:
      kind: what to compute.
      temperature: LOGPROBS only: log-probs of softmax(logits / T); use the generation
        temperature (0, greedy, counts as 1).
      with_entropy: LOGPROBS only: also return the entropy per token.
      max_segments: SCORES only: sequences per row (1 for padded batches).
      with_router: a model with experts also returns its router's losses
        (`InferenceOutput.router`; a train step's readout, for the auxiliary losses).
      replay_routing: given the experts the rollout recorded (`engine.replay`), the forward
        uses them (routing replay); else it only compares its own choice with them
        (`InferenceOutput.routes_changed` either way).
    """

    kind: InferenceKind
    temperature: float = 1.0
    with_entropy: bool = False
    max_segments: int = 1
    with_router: bool = False
    replay_routing: bool = False

    @property
    def head(self) -> HeadKind:
        match self.kind:
            case InferenceKind.LOGPROBS:
                return HeadKind.LM
            case InferenceKind.VALUES | InferenceKind.SCORES:
                return HeadKind.SCALAR


class InferenceBatch(NamedTuple):
    """Model inputs; every array is int32 [b, t].

    Attributes:
      tokens_bt: token ids.
      positions_bt: RoPE positions, restarting at 0 for every sequence.
      segment_ids_bt: 0 on padding, k >= 1 on the tokens of the row's k-th sequence.
    """

    tokens_bt: jax.Array
    positions_bt: jax.Array
    segment_ids_bt: jax.Array

    @staticmethod
    def padded(tokens_bt, mask_bt) -> "InferenceBatch":
        """One sequence per row; `mask_bt` marks its (contiguous) real tokens.

        Positions are cumsum(mask) - 1, exactly as `generate` numbers them.
        """
        xp = np if isinstance(tokens_bt, np.ndarray) else jnp
        mask_bt = xp.asarray(mask_bt).astype(xp.int32)
        positions_bt = xp.maximum(xp.cumsum(mask_bt, axis=1) - 1, 0).astype(xp.int32)
        return InferenceBatch(xp.asarray(tokens_bt).astype(xp.int32), positions_bt, mask_bt)

    @staticmethod
    def packed(tokens_bt, segment_ids_bt) -> "InferenceBatch":
        """Several sequences per row, told apart by segment ids; positions restart per sequence."""
        segment_ids_bt = jnp.asarray(segment_ids_bt, jnp.int32)
        return InferenceBatch(
            jnp.asarray(tokens_bt, jnp.int32), positions_from_segments(segment_ids_bt),
            segment_ids_bt,
        )


class InferenceOutput(NamedTuple):
    """Results, aligned with the input tokens; fields the kind does not produce are None.

    Attributes:
      logprobs_bt: float32 [b, t], log p(token_t | same-sequence tokens before t).
      entropy_bt: float32 [b, t], entropy of the distribution that predicted token t.
      values_bt: float32 [b, t], the scalar head at token t.
      scores_bk: float32 [b, max_segments], the scalar head at the last token of segment k+1
        (0 where the row has no such segment).
      router: `moe.RouterLosses` of the forward (scalars, not per token; `with_router`).
      routes_changed: float32 [2] (tokens whose fresh experts differ from the recorded ones
        in some layer, tokens with recorded ones), given recorded routes (`engine.replay`).
    """

    logprobs_bt: jax.Array | None = None
    entropy_bt: jax.Array | None = None
    values_bt: jax.Array | None = None
    scores_bk: jax.Array | None = None
    router: moe.RouterLosses | None = None
    routes_changed: jax.Array | None = None

    def per_token(self, fn) -> "InferenceOutput":
        """`fn` applied to each per-token field present (the router's scalars kept)."""
        return InferenceOutput(*(None if x is None else fn(x) for x in self[:4]), self.router,
                               self.routes_changed)


def positions_from_segments(segment_ids_bt: jax.Array) -> jax.Array:
    """int32 [b, t]: distance of each token from the start of its run of equal segment ids."""
    length = segment_ids_bt.shape[1]
    slot_bt = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), segment_ids_bt.shape)
    starts_bt = jnp.concatenate(
        [jnp.ones_like(segment_ids_bt[:, :1], bool),
         segment_ids_bt[:, 1:] != segment_ids_bt[:, :-1]], axis=1,
    )
    start_slot_bt = jax.lax.cummax(jnp.where(starts_bt, slot_bt, 0), axis=1)
    return slot_bt - start_slot_bt


def _predicted_bt(segment_ids_bt: jax.Array) -> jax.Array:
    """bool [b, t]: token t has a predecessor in its own sequence (so a log-prob)."""
    same_bt = (segment_ids_bt[:, 1:] == segment_ids_bt[:, :-1]) & (segment_ids_bt[:, 1:] != 0)
    return jnp.concatenate([jnp.zeros_like(same_bt[:, :1]), same_bt], axis=1)


def logprobs_and_entropy(logits_btv: jax.Array, batch: InferenceBatch, temperature: float,
                         with_entropy: bool) -> tuple[jax.Array, jax.Array | None]:
    """Per-token log-probs (and entropies) from an LM head's logits (traceable, differentiable).

    The [b, t, vocab] logits are the largest array of the forward, so they are read as few
    times as possible and no [b, t, vocab] log-softmax is ever materialised: with y = z - max(z)
    (z the tempered logits) and s = Σ exp(y), the log-prob of the next token is y[token] - log s
    (the arithmetic of `sampling.token_logprobs`'s log-softmax, so generation's log-probs agree)
    and the entropy log s - Σ exp(y)·y / s. Every position of the row is computed and the
    [b, t] results are shifted by one afterwards: slicing the logits to the t - 1 predicting
    positions first copied the whole [b, t, vocab] array (forward and backward).

    Returns:
      (logprobs_bt, entropy_bt or None), float32 [b, t]; entry t belongs to token t (predicted
      by the logits at t - 1); 0 where token t has no predecessor in its sequence.
    """
    z_btv = sampling.temper(logits_btv, temperature)
    # The max only shifts for stability; its gradient contributions cancel exactly.
    y_btv = z_btv - jax.lax.stop_gradient(jnp.max(z_btv, axis=-1, keepdims=True))
    exp_btv = jnp.exp(y_btv)
    sum_bt = jnp.sum(exp_btv, axis=-1)
    log_sum_bt = jnp.log(sum_bt)
    # Row t predicts token t + 1; the last row predicts nothing (its token is a stand-in).
    next_bt = jnp.pad(batch.tokens_bt[:, 1:], ((0, 0), (0, 1))).astype(jnp.int32)
    picked_bt = jnp.take_along_axis(y_btv, next_bt[..., None], axis=-1)[..., 0]
    valid_bt = _predicted_bt(batch.segment_ids_bt)

    def align(x_bt):  # entry t of the result from row t - 1 of the logits
        return jnp.where(valid_bt, jnp.pad(x_bt[:, :-1], ((0, 0), (1, 0))), 0.0)

    logprobs_bt = align(picked_bt - log_sum_bt)
    entropy_bt = None
    if with_entropy:
        entropy_bt = align(log_sum_bt - jnp.sum(exp_btv * y_btv, axis=-1) / sum_bt)
    return logprobs_bt, entropy_bt


def last_token_scores(values_bt: jax.Array, segment_ids_bt: jax.Array, max_segments: int):
    """float32 [b, max_segments]: values_bt at the last token of segments 1..max_segments."""
    length = segment_ids_bt.shape[1]
    segment_k = jnp.arange(1, max_segments + 1, dtype=segment_ids_bt.dtype)
    in_seg_bkt = segment_ids_bt[:, None, :] == segment_k[None, :, None]
    last_bk = jnp.max(jnp.where(in_seg_bkt, jnp.arange(length), -1), axis=-1)
    scores_bk = jnp.take_along_axis(values_bt, jnp.maximum(last_bk, 0), axis=1)
    return jnp.where(last_bk >= 0, scores_bk, 0.0)


def readout(cfg: InferenceConfig, model_out: jax.Array, batch: InferenceBatch) -> InferenceOutput:
    """The call kind's outputs from the model's (logits_btv f32, or values_bt f32 of a scalar
    head) on `batch` (traceable, differentiable): what `infer` returns and what a train
    step's loss reads."""
    match cfg.kind:
        case InferenceKind.LOGPROBS:
            logprobs_bt, entropy_bt = logprobs_and_entropy(
                model_out, batch, cfg.temperature, cfg.with_entropy)
            return InferenceOutput(logprobs_bt=logprobs_bt, entropy_bt=entropy_bt)
        case InferenceKind.VALUES:
            return InferenceOutput(values_bt=jnp.where(batch.segment_ids_bt != 0, model_out, 0.0))
        case InferenceKind.SCORES:
            values_bt = jnp.where(batch.segment_ids_bt != 0, model_out, 0.0)
            return InferenceOutput(
                scores_bk=last_token_scores(values_bt, batch.segment_ids_bt, cfg.max_segments))


def infer(model: Transformer, cfg: InferenceConfig, params, batch: InferenceBatch,
          chunks: int = 1, head_rows: int = 1, routes_btlk: jax.Array | None = None):
    """The body of every inference call kind on rows as given (traceable). Returns an
    InferenceOutput.

    `chunks` > 1 runs the whole forward and readout on row chunks one after another (rows c,
    c+C, c+2C, ...: on data-parallel devices each device's own rows, as they lie), so each
    chunk's activations stay in the caches (`row_chunks` says why and how many). A
    pipeline's output instead is read out in the pipeline's row chunks
    (`readout_in_chunks`): the pipeline streams its micro-batches through the layers and
    hands back the whole batch's hidden states, whose [b, t, vocab] logits at once would be
    the largest array of the call (and of a train step's backward pass). `head_rows` > 1
    reads the layers' output out in that many row chunks likewise (`head_row_chunks`: an
    accelerator's log-probs of long rows). `routes_btlk`: the experts the rollout recorded
    for each token [b, t, L, k] (`engine.replay`), replayed where `cfg.replay_routing` says,
    and compared with the router's own choice (`InferenceOutput.routes_changed`)."""
    if chunks > 1:
        return _in_row_chunks(
            lambda part, routes: infer(model, cfg, params, part, routes_btlk=routes), batch,
            chunks, routes_btlk)
    head = max(head_chunks(model, batch.tokens_bt.shape[0]), head_rows)
    router = cfg.with_router and model.config.moe is not None
    routed = routes_btlk is not None
    recorded_lbtk = replay.model_routes(routes_btlk) if routed else None
    replayed = {"routes_lbtk": recorded_lbtk} if routed and cfg.replay_routing else {}
    sows = router or routed
    apply = functools.partial(model.apply, {"params": params}, *batch,
                              mutable=["intermediates"] if sows else False, **replayed)
    if head == 1:
        (model_out, _), sown = _with_sown(apply(), sows)
        out = readout(cfg, model_out, batch)
    else:
        (x_btd, _), sown = _with_sown(apply(with_head=False), sows)
        out = readout_in_chunks(model.config, cfg, params["norm"]["scale"],
                                head_kernel(model.config, params), x_btd, batch, head)
    if routed:
        out = out._replace(routes_changed=replay.changed_counts(
            sown, recorded_lbtk, batch.segment_ids_bt != 0, bool(replayed)))
    return out._replace(router=moe.sown_router_losses(sown)) if router else out


def _with_sown(applied, mutable: bool):
    """(model output, sown intermediates or None) of `model.apply` with or without them."""
    return applied if mutable else (applied, None)


def _in_row_chunks(fn, batch: InferenceBatch, chunks: int,
                   routes_btlk: jax.Array | None = None) -> InferenceOutput:
    """`fn(rows, their routes) -> InferenceOutput` on `chunks` strided row chunks of `batch`
    [b, t] (and of `routes_btlk` [b, t, L, k] or None), one after another (a loop: one
    chunk's activations live at a time), outputs merged back."""
    batch_c = InferenceBatch(*(nn.with_logical_constraint(split_rows(a, chunks),
                                                          (None, "batch", "length"))
                               for a in batch))
    routes_c = None if routes_btlk is None else split_rows(routes_btlk, chunks)
    _, out_c = jax.lax.scan(lambda _, part: (None, fn(InferenceBatch(*part[0]), part[1])),
                            None, (batch_c, routes_c))
    router = None if out_c.router is None else moe.RouterLosses(
        jnp.mean(out_c.router.balance_loss), jnp.mean(out_c.router.z_loss),
        jnp.min(out_c.router.min_load))
    changed = None if out_c.routes_changed is None else jnp.sum(out_c.routes_changed, axis=0)
    return out_c.per_token(merge_rows)._replace(router=router, routes_changed=changed)


# Tokens of one row chunk of an inference call on each device, on XLA:CPU (`row_chunks`).
CPU_CHUNK_TOKENS = 2048


def chunk_tokens(layout: Layout) -> int | None:
    """The token budget of an inference call's row chunks on `layout` (`row_chunks`):
    `CPU_CHUNK_TOKENS` on XLA:CPU without a pipeline, else none (one chunk; a pipeline cuts
    its rows into its own micro-batches)."""
    cpu = layout.platform is Platform.CPU
    return CPU_CHUNK_TOKENS if cpu and layer_stack(layout) is None else None


def row_chunks(rows: int, length: int, tokens: int | None) -> int:
    """How many equal chunks of whole rows an inference call runs its forward in (`infer`):
    the fewest (a divisor of `rows`) whose chunk holds at most `tokens` tokens, one row a
    chunk where a row alone holds more; 1 without a budget.

    Why: at W-cpu's 64 rows of 96 tokens on one device every [6144, 1024] activation of the
    SwiGLU MLP is 24 MiB, and the gate, up and product arrays stream through memory between
    the matmuls; in chunks of 1,536 tokens (6 MiB each) they stay in the caches, and the
    layers run at the matmuls' own rate. `benchmarks/inference_chunks.py` (ref_inf alone,
    budgets alternated in rounds against the matmul probe, 2 cores under other processes'
    load), CPU fraction of the floor by chunks: 64 rows of 96 tokens, 1: 84.1%, 2: 88.7%,
    4: 93.6%, 8: 94.5% (another run: 85.9, 91.8, 95.0, 93.1%, 16 chunks 89.3%: smaller ones
    run smaller matmuls and more loop steps); 64 rows of 544 tokens, 1: 77.6%, 16: 83.1%,
    32: 86.2%. Packed rows per device come from `packing.row_buckets`' ladder (rungs above 8
    hold a large power of two), so a chunk near the budget divides them.

    Args:
      rows: rows on each device (the call's rows over its data-parallel size).
      length: tokens per row.
      tokens: the budget (`chunk_tokens`), or None.
    """
    if not tokens:
        return 1
    return next((c for c in range(1, rows + 1) if rows % c == 0 and rows // c * length <= tokens),
                rows)


# fp32 logits of one row chunk of an inference call's head on each device (`head_row_chunks`).
HEAD_CHUNK_BYTES = 1 << 30


def head_row_chunks(rows: int, length: int, vocab: int) -> int:
    """Row chunks an inference call reads its log-probs out in on an accelerator (`infer`'s
    `head_rows`): the fewest (a divisor of `rows`) whose fp32 logits [rows/C, length, vocab]
    hold at most `HEAD_CHUNK_BYTES`, one row a chunk where a row alone holds more.

    Why: the logits of a whole call are its largest array by far: a v5p chip's 16 rows of
    2,048 tokens over Llama-3's 128,256-id vocabulary are 16 GiB of fp32, and XLA:TPU holds
    three of them while it reads them out (an fsdp-sharded head runs as a windowed einsum,
    whose loop carries its output and a partial sum; then the log-softmax's exponentials),
    48 GiB where the layers need 5. In chunks of 1 GiB a chunk still holds 2,048 tokens of
    that vocabulary on one device, a matmul as wide as the layers' own.

    Args:
      rows: rows on each device (the call's rows over its data-parallel size).
      length: tokens per row.
      vocab: the head's outputs on each device (the vocabulary over the tensor degree).
    """
    per_row = length * vocab * 4
    return next((c for c in range(1, rows + 1)
                 if rows % c == 0 and rows // c * per_row <= HEAD_CHUNK_BYTES), max(rows, 1))


def head_vocab(model_config: ModelConfig, layout: Layout) -> int:
    """The LM head's outputs on each device of `layout`: the vocabulary over the tensor degree
    (whole where that does not divide it, as the layout shards it)."""
    vocab, tensor = model_config.vocab_size, layout.strategy.tensor
    return vocab // tensor if vocab % tensor == 0 else vocab


def head_chunks(model: Transformer, rows: int) -> int:
    """Row chunks `infer` runs the head of `rows` rows in: a pipeline's micro-batches
    (`Pipeline.num_micro`), else 1 (a micro-batch loop around the call bounds the head)."""
    stack = model.layer_stack
    return stack.num_micro(rows) if isinstance(stack, Pipeline) else 1


def readout_in_chunks(model_config: ModelConfig, cfg: InferenceConfig, scale_d: jax.Array,
                      kernel_dv: jax.Array, x_btd: jax.Array, batch: InferenceBatch,
                      chunks: int) -> InferenceOutput:
    """`readout` of the final norm and the head on the last layer's outputs x_btd [b, t, d],
    in `chunks` row chunks one after another (rows c, c+C, c+2C, ...: a pipeline's
    micro-batches, spread over the data-parallel devices as they are), each under
    `jax.checkpoint`.

    At most one chunk's [b/C, t, vocab] logits (and their gradient) are live, forward or
    backward: the backward pass keeps only x_btd and recomputes one chunk's logits at a time.
    The norm runs per chunk too, so no normed copy of the whole batch exists, nor its
    gradient: a train step's backward pass holds x_btd until the head's backward loop ends
    and then only x_btd's gradient (XLA:GPU had kept a whole-batch normed copy and its
    gradient alive through the pipeline's backward loop for the norm scale's gradient).
    The readout is row by row, so each entry equals the whole batch's up to the head's
    summation order. The head weight's and the norm scale's gradients are summed over the
    chunks in fp32, as a loop of micro-batches sums: the scan adds a closed-over operand's
    gradients in its dtype, so the weights enter it as fp32 copies (a bf16 sum would round
    at every chunk: twice the error against the whole batch's gradient, measured with bf16
    weights over 16 chunks).

    Args:
      scale_d: the final norm's scale [d] (`params["norm"]["scale"]`, `transformer.final_norm`).
      kernel_dv: the head's weight (`transformer.head_kernel`).
      x_btd: [b, t, d] the last layer's output (`Transformer(..., with_head=False)`).
      batch: [b, t] the rows x_btd was computed on (b divisible by `chunks`).

    Returns:
      The InferenceOutput `readout` gives on the whole batch, fields [b, t] (or [b, k]).
    """

    def one_chunk(scale_d, kernel_dv, x_btd, batch):
        normed_btd = final_norm(model_config, scale_d, x_btd)
        return readout(cfg, head_out(model_config, kernel_dv, normed_btd), batch)

    one_chunk = jax.checkpoint(one_chunk, prevent_cse=False)  # a scan body: nothing to CSE
    # Cast back to the compute dtype in `final_norm` and `head_out`: the values are the same.
    scale_d, kernel_dv = scale_d.astype(jnp.float32), kernel_dv.astype(jnp.float32)
    x_cbtd = nn.with_logical_constraint(split_rows(x_btd, chunks),
                                        (None, "batch", "length", "act_embed"))
    batch_c = InferenceBatch(*(split_rows(a, chunks) for a in batch))
    _, out_c = jax.lax.scan(lambda _, xs: (None, one_chunk(scale_d, kernel_dv, *xs)), None,
                            (x_cbtd, batch_c))
    return InferenceOutput(*(None if x is None else merge_rows(x) for x in out_c))


def infer_packed(model: Transformer, cfg: InferenceConfig, shards: int, params,
                 batch: InferenceBatch, plan: packing.PackPlan, chunks: int = 1,
                 head_rows: int = 1, routes_btlk: jax.Array | None = None) -> InferenceOutput:
    """`infer` of a padded batch computed on its packed rows (traceable, differentiable).

    Args:
      batch: [b, t] padded rows, one sequence each.
      shards: the data-parallel size the plan was made for (`packing.plan`).
      plan: one micro-batch's plan (gather_mrt [1, R, t], ..., scatter_mbt [1, b, t]).
      chunks: row chunks of the packed rows the forward runs in (`infer`, `row_chunks`).
      head_rows: row chunks of the packed rows the head reads out in (`head_row_chunks`).
      routes_btlk: the rows' recorded experts [b, t, L, k] (`infer`), or None.

    Returns:
      The InferenceOutput `infer(batch)` gives (per-token fields [b, t] on the padded rows),
      up to the summation order of the computation.
    """
    gather_rt, segment_ids_rt, scatter_bt = (x[0] for x in plan)
    packed = InferenceBatch(packing.pack(batch.tokens_bt, gather_rt, shards),
                            packing.pack(batch.positions_bt, gather_rt, shards), segment_ids_rt)
    per_token = cfg if cfg.kind is not InferenceKind.SCORES else dataclasses.replace(
        cfg, kind=InferenceKind.VALUES)
    routes_rtlk = None if routes_btlk is None else packing.pack(routes_btlk, gather_rt, shards)
    out = infer(model, per_token, params, packed, chunks, head_rows, routes_rtlk)
    real_bt = batch.segment_ids_bt != 0
    out = out.per_token(lambda x: packing.unpack(x, scatter_bt, real_bt, shards))
    if cfg.kind is InferenceKind.SCORES:
        return InferenceOutput(
            scores_bk=last_token_scores(out.values_bt, batch.segment_ids_bt, cfg.max_segments))
    return out


class InferenceFn(BucketedCall):
    """One inference call kind of one model on one layout (use `make_inference_fn`).

    Calling it right-pads the batch (segment 0) to the next length bucket, packs its sequences
    into rows of that width (`engine.packing`; a sync point on the batch's segment ids: each
    data-parallel shard's own rows, or the sequences dealt over the shards where that needs
    fewer rows), runs the executable compiled for (bucket, batch, packed rows, spread) on this
    layout, and returns the outputs on the padded rows, per-token ones cut back to length t.
    On XLA:CPU the executable runs the packed rows in chunks (`chunk_tokens`, `row_chunks`).
    """

    def __init__(self, model_config: ModelConfig, cfg: InferenceConfig, layout: Layout,
                 length_buckets: Sequence[int], rows: packing.Rows = packing.Rows.PACKED):
        if model_config.head is not cfg.head:
            raise ValueError(f"{cfg.kind} needs a {cfg.head} head, got {model_config.head}")
        super().__init__(f"inference/{cfg.kind.value}", layout)
        self.cfg = cfg
        self.length_buckets = tuple(sorted(length_buckets))
        stack = layer_stack(layout)
        # A pipeline cuts its rows into its own micro-batches: it keeps the padded rows.
        self.rows = packing.Rows.PADDED if stack is not None else rows
        rows_sharding = layout.batch_sharding(2)
        self._rows = rows_sharding
        micro = NamedSharding(layout.mesh, PartitionSpec(None, *rows_sharding.spec))
        self._plan_shardings = packing.PackPlan(micro, micro, micro)
        with_entropy = cfg.kind is InferenceKind.LOGPROBS and cfg.with_entropy
        out_shardings = InferenceOutput(
            logprobs_bt=rows_sharding if cfg.kind is InferenceKind.LOGPROBS else None,
            entropy_bt=rows_sharding if with_entropy else None,
            values_bt=rows_sharding if cfg.kind is InferenceKind.VALUES else None,
            scores_bk=rows_sharding if cfg.kind is InferenceKind.SCORES else None,
        )
        self._stack = stack
        self._routes = layout.batch_sharding(4)
        routed_shardings = out_shardings._replace(routes_changed=layout.replicated())
        self._chunk_tokens = chunk_tokens(layout)
        # Log-probs on an accelerator read the head out in row chunks (`head_row_chunks`);
        # XLA:CPU chunks the whole forward instead, a pipeline in its micro-batches.
        self._head_vocab = head_vocab(model_config, layout) if (
            cfg.kind is InferenceKind.LOGPROBS and layout.platform is not Platform.CPU
            and stack is None) else 0
        # Per plan kind: each shard's own rows (pack within each shard's block), or spread
        # (`packing.fewest_rows`: indices across the whole batch, shards=1).
        # Per (spread, routed): with the rows' recorded experts as a last argument
        # (`engine.replay`) or without.
        in_shardings = (layout.param_shardings(abstract_params(model_config)),
                        InferenceBatch(rows_sharding, rows_sharding, rows_sharding),
                        self._plan_shardings)
        self._jitted = {(spread, routed): jax.jit(
            functools.partial(infer_packed, Transformer(model_config, stack), cfg,
                              1 if spread else layout.dp_size),
            in_shardings=in_shardings + ((self._routes,) if routed else ()),
            out_shardings=routed_shardings if routed else out_shardings,
            static_argnums=(3, 4),  # chunks, head_rows
        ) for spread in (False, True) for routed in (False, True)}

    def _jit_for(self, params, batch, plan, spread: bool = False, routes=None
                 ) -> jax.stages.Wrapped:
        return self._jitted[spread, routes is not None]

    def _lower(self, params, batch: InferenceBatch, plan=None, spread: bool = False,
               routes=None) -> jax.stages.Lowered:
        """The lowered call on a batch of a bucket's length (its plan made if not given)."""
        if plan is None:
            plan, spread = self._plan(batch.segment_ids_bt)
        rows, length = plan.rows // self.layout.dp_size, batch.tokens_bt.shape[1]
        chunks = row_chunks(rows, length, self._chunk_tokens)
        head_rows = 1
        if self._head_vocab and chunks == 1:
            head_rows = head_row_chunks(rows, length, self._head_vocab)
        routed = () if routes is None else (routes,)
        with self.layout.activation_context():
            return self._jit_for(params, batch, plan, spread, routes).lower(
                params, batch, plan, chunks, head_rows, *routed)

    def _host_plan(self, segment_ids_bt) -> tuple[packing.PackPlan, bool]:
        """(the batch's packed rows on the host; whether they are spread over the shards): a
        sync on its segment ids. The shards' own rows, or the spread plan where it needs
        fewer."""
        segment_ids_bt = np.asarray(fetch(segment_ids_bt))
        shards = self.layout.dp_size
        return packing.fewest_rows(
            segment_ids_bt, packing.plan(segment_ids_bt, 1, shards, self.rows), shards,
            self.rows)

    def _plan(self, segment_ids_bt) -> tuple[packing.PackPlan, bool]:
        """`_host_plan`, its rows placed."""
        plan, spread = self._host_plan(segment_ids_bt)
        return transfer(plan, self._plan_shardings), spread

    def _padded(self, batch: InferenceBatch) -> tuple[int, InferenceBatch]:
        """(the length bucket, the batch right-padded to it as int32)."""
        bucket = buckets.bucket_length(np.shape(batch.tokens_bt)[1], self.length_buckets)
        return bucket, InferenceBatch(
            *(buckets.pad_axis(x, bucket, axis=1).astype(jnp.int32) for x in batch))

    def lower_for(self, params, batch: InferenceBatch) -> jax.stages.Lowered:
        """The call this kind would compile for host `batch`, lowered with nothing placed
        (`params` abstract; module `engine.call`)."""
        _, padded = self._padded(batch)
        plan, spread = self._host_plan(padded.segment_ids_bt)
        rows = InferenceBatch(self._rows, self._rows, self._rows)
        return self._lower(params, abstract(padded, rows),
                           abstract(plan, self._plan_shardings), spread)

    def __call__(self, params, batch: InferenceBatch,
                 routes_btlk: jax.Array | None = None) -> InferenceOutput:
        """Runs the call kind.

        Args:
          params: unboxed parameters, sharded as `layout.param_shardings` says.
          batch: int [b, t] arrays (numpy or jax), one sequence per row; b must split over
            the data-parallel size.
          routes_btlk: the experts the rollout recorded for each token [b, t, L, k]
            (`engine.replay`; replayed where the config says), or None.

        Returns:
          InferenceOutput with per-token fields of length t.
        """
        batch_size, length = np.shape(batch.tokens_bt)
        check_batch_divisible(self.layout, batch_size, "inference batch")
        if routes_btlk is not None and self._stack is not None:
            raise ValueError(f"{self.cfg.kind.value}: recorded expert routes (routing replay) need a "
                             f"layout without a LayerStack (pipeline), got {self.layout}")
        bucket, padded = self._padded(batch)
        plan, spread = self._plan(buckets.pad_axis(np.asarray(fetch(batch.segment_ids_bt)),
                                                   bucket, axis=1))
        padded = jax.device_put(padded, self._rows)
        routed = () if routes_btlk is None else (jax.device_put(buckets.pad_axis(
            routes_btlk, bucket, axis=1, value=replay.NO_ROUTE), self._routes),)
        compiled = self.compile_cache.get(
            (bucket, batch_size, plan.rows, spread, bool(routed)),
            lambda: self._lower(params, padded, plan, spread, *routed))
        out = compiled(params, padded, plan, *routed)
        per_token = {
            name: x[:, :length] for name, x in out._asdict().items()
            if x is not None and name.endswith("_bt")
        }
        return out if bucket == length else out._replace(**per_token)


def make_inference_fn(
    model_config: ModelConfig,
    cfg: InferenceConfig,
    layout: Layout,
    *,
    length_buckets: Sequence[int] | None = None,
    rows: packing.Rows = packing.Rows.PACKED,
) -> InferenceFn:
    """The inference call kind `(params, InferenceBatch) -> InferenceOutput` on `layout`.

    Args:
      model_config: the model; its head must suit `cfg.kind`.
      cfg: what to compute.
      layout: devices, mesh and sharding rules to compile for.
      length_buckets: allowed sequence lengths; default powers of two from 16, capped at
        `model_config.max_position_embeddings`.
      rows: PACKED (several sequences per row) or PADDED (one per row, as given).
    """
    if length_buckets is None:
        length_buckets = buckets.power_of_two_buckets(model_config.max_position_embeddings)
    return InferenceFn(model_config, cfg, layout, length_buckets, rows)
