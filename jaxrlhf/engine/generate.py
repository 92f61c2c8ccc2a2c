"""The `generate` call kind: sampling after a batch of prompts, one jit per layout and bucket.

`Generator` hands the rows to the rollout engine (`engine.rollout`): every row is queued, a
slot whose row finished takes the next one, and when the queue is empty and the live rows fit
the next smaller state of the ladder they are compacted into it; the cache holds only what the live
rows can reach (capacity buckets), and a GRPO group's n rows share one prefill. Pipelined
layouts decode the static batch of `generate` (below) instead: their stages decode every row
at one slot.

Prompts arrive LEFT-padded to a bucketed length P (so every row's last prompt token sits in the
same slot and one prefill yields every row's first next-token logits); response token i of a
row goes to cache slot P + i. Each row's RoPE positions count only its real tokens, so a
left-padded row is computed exactly like the same prompt without padding. Row r of a call with
key `rng` samples token i with fold_in(fold_in(rng, i), r), wherever and whenever it decodes.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxrlhf.engine import buckets, decode_layers, pipelined_decode
from jaxrlhf.engine.call import BucketedCall, abstract
from jaxrlhf.engine.decode_layers import LayerByLayer
from jaxrlhf.engine.decoding import (  # noqa: F401  (GenerateConfig, decode_model: public here)
    GenerateConfig, constrain_cache, decode_model, draw, prefill,
)
from jaxrlhf.engine.rollout import Rollout, SlotState
from jaxrlhf.engine.rollout.scheduler import (
    CHUNK_TOKENS, Occupancy, Request, Scheduler, smaller_sizes,
)
from jaxrlhf.models.config import HeadKind, ModelConfig
from jaxrlhf.models.sizes import abstract_params
from jaxrlhf.models.transformer import KVCache, Transformer
from jaxrlhf.parallel.layout import Layout, check_batch_divisible
from jaxrlhf.parallel.pipeline import Pipeline, layer_stack
from jaxrlhf.parallel.reshard import fetch, transfer

def runs_at_once(micro_batches: int, new_tokens: int, chunk_tokens: int = CHUNK_TOKENS) -> bool:
    """Whether a generate call on the engine runs as one executable (`Rollout.decode_at_once`:
    fill, token loop and output on the device): its rows all have slots (one micro-batch) and
    end within one chunk of `chunk_tokens` steps after the prefill's token."""
    return micro_batches == 1 and new_tokens <= chunk_tokens + 1


class GenerateOutput(NamedTuple):
    """What one generate call returns (a pytree; every array's dim 0 is the batch).

    Attributes:
      sequences_bs: int32 [b, P + N]: left-padded prompt, then the response right-padded with
        pad_token_id.
      prompt_mask_bp: bool [b, P], True on real prompt tokens.
      response_bn: int32 [b, N] sampled tokens (pad_token_id after EOS).
      response_mask_bn: bool [b, N], True up to and including EOS.
      logprobs_bn: float32 [b, N], log-prob of each sampled token under softmax(logits / T)
        (T = 1 for greedy), untruncated; 0 where the mask is False.
      response_lengths_b: int32 [b], number of True entries of response_mask_bn.
      routes_bslk: [b, P + N, L, k] the experts each token used in each layer when it was
        generated (`engine.replay`: NO_ROUTE where none was recorded), on the rollout engine
        of a model with experts; else None.
    """

    sequences_bs: jax.Array
    prompt_mask_bp: jax.Array
    response_bn: jax.Array
    response_mask_bn: jax.Array
    logprobs_bn: jax.Array
    response_lengths_b: jax.Array
    routes_bslk: jax.Array | None = None

    @property
    def sequence_mask_bs(self) -> jax.Array:
        """bool [b, P + N]: real tokens of prompt + response (segment ids for inference)."""
        return jnp.concatenate([self.prompt_mask_bp, self.response_mask_bn], axis=1)


class _DecodeState(NamedTuple):
    step: jax.Array  # scalar int32: index of the next response token to choose
    logits_bv: jax.Array  # float32 [b, vocab]: the model's prediction of token `step`
    last_token_b: jax.Array  # int32 [b]: response token step-1
    done_b: jax.Array  # bool [b]
    cache: KVCache | tuple
    response_bn: jax.Array
    logprobs_bn: jax.Array
    mask_bn: jax.Array


def _unfinished(state: _DecodeState, n_new: int) -> jax.Array:
    return (state.step < n_new) & ~jnp.all(state.done_b)


def _choose(state: _DecodeState, rng, cfg: GenerateConfig) -> _DecodeState:
    """Samples response token `state.step` for every unfinished row and records it."""
    batch = state.logits_bv.shape[0]
    step_key = jax.random.fold_in(rng, state.step)
    keys_b = jax.vmap(functools.partial(jax.random.fold_in, step_key))(jnp.arange(batch))
    active_b = ~state.done_b
    token_b, logp_b, stopped_b = draw(state.logits_bv, keys_b, active_b, cfg)
    done_b = state.done_b | stopped_b
    write = functools.partial(jax.lax.dynamic_update_index_in_dim, index=state.step, axis=1)
    return state._replace(
        step=state.step + 1,
        last_token_b=token_b,
        done_b=done_b,
        response_bn=write(state.response_bn, token_b),
        logprobs_bn=write(state.logprobs_bn, jnp.where(active_b, logp_b, 0.0)),
        mask_bn=write(state.mask_bn, active_b),
    )


def generate(
    model: Transformer,
    cfg: GenerateConfig,
    params,
    prompt_tokens_bp: jax.Array,
    prompt_mask_bp: jax.Array,
    rng: jax.Array,
) -> GenerateOutput:
    """Samples up to `cfg.max_new_tokens` tokens after each left-padded prompt (traceable), as
    one static batch: every row decodes until the last one stops. Pipelined layouts decode
    this way (ReaL's schedule across tokens); elsewhere `Generator` runs the rollout engine,
    for which this function is the reference (same tokens and log-probs).

    Args:
      model: the LM-head decoder.
      cfg: generation settings.
      params: the model's (unboxed) parameters.
      prompt_tokens_bp: int [b, P] left-padded prompts; each row needs >= 1 real token.
      prompt_mask_bp: bool [b, P], True on real tokens (a suffix of each row).
      rng: PRNG key; row r's token i uses fold_in(fold_in(rng, i), r).

    Returns:
      A GenerateOutput.
    """
    batch, prompt_len = prompt_tokens_bp.shape
    n_new = cfg.max_new_tokens
    layer_by_layer = isinstance(model.layer_stack, LayerByLayer)
    if layer_by_layer:  # each layer's weights sliced out once, not once per token
        params = decode_layers.split_params(params)
    apply = functools.partial(model.apply, {"params": params})
    prompt_mask_bp = prompt_mask_bp.astype(bool)
    prompt_lengths_b = jnp.sum(prompt_mask_bp, axis=1, dtype=jnp.int32)
    # Response slots are marked real up front; causality hides the not-yet-written ones.
    kv_segment_ids_bs = jnp.concatenate(
        [prompt_mask_bp.astype(jnp.int32), jnp.ones((batch, n_new), jnp.int32)], axis=1
    )
    # Layer by layer, the caches grow segment by segment (`decode_layers.segment_ends`).
    ends = decode_layers.segment_ends(n_new) if layer_by_layer else (n_new,)
    logits_bv, cache, _ = prefill(apply, model, prompt_tokens_bp, prompt_mask_bp,
                               kv_segment_ids_bs[:, :prompt_len + ends[0]])
    state = _DecodeState(
        step=jnp.zeros((), jnp.int32), logits_bv=logits_bv,
        last_token_b=jnp.zeros((batch,), jnp.int32), done_b=jnp.zeros((batch,), bool),
        cache=cache, response_bn=jnp.full((batch, n_new), cfg.pad_token_id, jnp.int32),
        logprobs_bn=jnp.zeros((batch, n_new), jnp.float32), mask_bn=jnp.zeros((batch, n_new), bool))

    def decode_one(s: _DecodeState, kv_segment_ids_bs) -> _DecodeState:
        fed = s.step - 1  # index of the response token being fed
        logits_b1v, cache = apply(
            s.last_token_b[:, None], (prompt_lengths_b + fed)[:, None],
            jnp.ones((batch, 1), jnp.int32), s.cache, prompt_len + fed, kv_segment_ids_bs,
        )
        s = s._replace(logits_bv=logits_b1v[:, 0], cache=constrain_cache(cache))
        return _choose(s, rng, cfg)

    # Token 0 comes from the prefill's logits; each iteration feeds the last token and samples
    # the next, so the loop body has no `lax.cond` (whose branches would copy the KV cache).
    state = _choose(state, rng, cfg)
    if layer_by_layer:
        state = state._replace(cache=constrain_cache(decode_layers.split_cache(state.cache)))
    if pipelined_decode.runs_across_tokens(model):  # ReaL's schedule on a pipelined layout
        state = pipelined_decode.decode_across_tokens(
            model, cfg, params, state, rng, prompt_lengths_b, prompt_len, kv_segment_ids_bs)
    else:
        for end in ends:
            length = prompt_len + end
            cache = decode_layers.grow_cache(state.cache, length) if layer_by_layer else state.cache
            state = jax.lax.while_loop(
                functools.partial(_unfinished, n_new=end),
                functools.partial(decode_one, kv_segment_ids_bs=kv_segment_ids_bs[:, :length]),
                state._replace(cache=constrain_cache(cache)))
    prompt_bp = jnp.where(prompt_mask_bp, prompt_tokens_bp, cfg.pad_token_id).astype(jnp.int32)
    return GenerateOutput(
        sequences_bs=jnp.concatenate([prompt_bp, state.response_bn], axis=1),
        prompt_mask_bp=prompt_mask_bp,
        response_bn=state.response_bn,
        response_mask_bn=state.mask_bn,
        logprobs_bn=state.logprobs_bn,
        response_lengths_b=jnp.sum(state.mask_bn, axis=1, dtype=jnp.int32),
    )


def decode_rows(engine: Rollout, params, prompt_tokens_bp: np.ndarray,
                prompt_mask_bp: np.ndarray, keys: list, rows_b: np.ndarray, slots: int,
                chunk_tokens: int = CHUNK_TOKENS, limits_b: np.ndarray | None = None,
                ) -> tuple[dict[str, np.ndarray], Occupancy]:
    """Every row generated on the engine by its scheduler (`engine.rollout.scheduler`):
    queued, decoded in `slots` slots refilled as rows finish, compacted into the next smaller
    state when the queue is empty and the live rows fit it.

    Args:
      engine: the rollout engine (its prompt length P).
      params: the weights (version 0).
      prompt_tokens_bp, prompt_mask_bp: [b, P] left-padded prompts (host).
      keys: b PRNG keys, rows_b int [b]: row i samples token t with
        fold_in(fold_in(keys[i], t), rows_b[i]).
      slots: rows decoded at once (a multiple of the data-parallel size).
      chunk_tokens: tokens decoded between looks at which rows finished.
      limits_b: int [b] the most response tokens of each row (default: the engine's N).

    Returns:
      ({Rows field: host array [b, ...]} in row order, the decode work done).
    """
    batch = len(prompt_tokens_bp)
    scheduler = Scheduler(engine, slots, chunk_tokens)
    scheduler.submit(
        Request(prompt_tokens_bp[i], prompt_mask_bp[i], keys[i], int(rows_b[i]),
                None if limits_b is None else int(limits_b[i]), tag=i) for i in range(batch))
    out: dict[str, np.ndarray] = {}
    for finished in scheduler.run(params):
        at = [request.tag for request in finished.requests]
        for name, x in finished.rows._asdict().items():
            if x is None:
                continue
            out.setdefault(name, np.zeros((batch, *x.shape[1:]), x.dtype))[at] = x
    return out, scheduler.occupancy


def engine_output(pad_token_id: int, s: SlotState) -> GenerateOutput:
    """The GenerateOutput of an engine state whose slot i holds row i (traceable; the
    `finish` of `Rollout.decode_at_once`)."""
    prompt_bp = jnp.where(s.prompt_mask_bp, s.prompt_tokens_bp, pad_token_id).astype(jnp.int32)
    return GenerateOutput(
        sequences_bs=jnp.concatenate([prompt_bp, s.response_bn], axis=1),
        prompt_mask_bp=s.prompt_mask_bp, response_bn=s.response_bn, response_mask_bn=s.mask_bn,
        logprobs_bn=s.logprobs_bn,
        response_lengths_b=jnp.sum(s.mask_bn, axis=1, dtype=jnp.int32),
        routes_bslk=s.routes_bslk)


# Engine calls whose decode work may wait on the device before `Generator.occupancy` adds it
# up (each a small array; a longer list is added up, a sync point on calls long finished).
_PENDING_WORK = 32


class Generator(BucketedCall):
    """The generate call kind of one model on one layout (use `make_generate_fn`).

    Calling it left-pads the prompts to the next prompt bucket and decodes them on the rollout
    engine of that bucket: in one executable (`Rollout.decode_at_once`) when every row has a
    slot and the rows end within one chunk of tokens (nothing for the host to schedule),
    else driven from the host by the engine's scheduler (`decode_rows`); on a pipelined layout
    it runs the static-batch executable compiled for (bucket, batch). Every executable is
    compiled on first use and counted in `compile_cache`.
    """

    def __init__(self, model_config: ModelConfig, gen_config: GenerateConfig, layout: Layout,
                 prompt_buckets: Sequence[int], chunk_tokens: int = CHUNK_TOKENS):
        if model_config.head is not HeadKind.LM:
            raise ValueError(f"generate needs an LM head, got {model_config.head}")
        super().__init__("generate", layout)
        self.chunk_tokens = chunk_tokens
        self.model_config, self.gen_config = model_config, gen_config
        self.prompt_buckets = tuple(sorted(prompt_buckets))
        self._occupancy = Occupancy(0, 0)
        self._pending_work: list[jax.Array] = []  # work_k2 of `decode_at_once` calls
        # One function for every call: `decode_at_once` compiles once per `finish`.
        self._finish = functools.partial(engine_output, gen_config.pad_token_id)
        self._engines: dict[int, Rollout] = {}
        row, rows = layout.batch_sharding(1), layout.batch_sharding(2)
        self._rows, self._rng_sharding = rows, layout.replicated()
        self._static = isinstance(layer_stack(layout), Pipeline)
        # A pipeline's stages do not keep what the layers sow: no routes recorded there.
        routes = None if model_config.moe is None or self._static else layout.batch_sharding(4)
        self._out_shardings = GenerateOutput(rows, rows, rows, rows, rows, row, routes)
        if self._static:
            self._jitted = jax.jit(
                functools.partial(generate, decode_model(model_config, layout), gen_config),
                in_shardings=(layout.param_shardings(abstract_params(model_config)), rows, rows,
                              self._rng_sharding),
                out_shardings=self._out_shardings)

    def _jit_for(self, *args) -> jax.stages.Wrapped:
        return self._jitted

    def rollout_engine(self, prompt_len: int, slots: int) -> Rollout:
        """The rollout engine of prompts padded to `prompt_len` (made on first use, `slots` its
        default size; sharing this call's compile cache), for callers that schedule rows
        themselves (multi-turn rollouts, `dataflow/trajectories.py`)."""
        if prompt_len not in self._engines:
            self._engines[prompt_len] = Rollout(self.model_config, self.gen_config, self.layout,
                                                prompt_len, slots,
                                                compile_cache=self.compile_cache)
        return self._engines[prompt_len]

    def lower_for(self, params, prompt_tokens_bp, prompt_mask_bp, rng, micro_batches: int = 1
                  ) -> dict[str, jax.stages.Lowered]:
        """The programs this call would compile for host prompts [b, P], lowered with nothing
        placed (`params` abstract, `rng` a key of the runtime's kind; module `engine.call`):
        a pipelined layout's static-batch program, else the rollout engine's
        (`Rollout.lowered_programs`: its one program, or the fill, a decode chunk and the first
        compaction that `decode_rows` runs), by name."""
        batch, prompt_len = np.shape(prompt_tokens_bp)
        check_batch_divisible(self.layout, batch, "generate batch")
        bucket = buckets.bucket_length(prompt_len, self.prompt_buckets)
        pad = functools.partial(buckets.pad_axis, length=bucket, axis=1, left=True)
        tokens_bp = pad(np.asarray(prompt_tokens_bp, np.int32),
                        value=self.gen_config.pad_token_id)
        mask_bp = pad(np.asarray(prompt_mask_bp, bool), value=False)
        rng = abstract(rng, self._rng_sharding)
        if self._static:
            return {"generate": self._lower(params, abstract(tokens_bp, self._rows),
                                            abstract(mask_bp, self._rows), rng)}
        slots = batch // micro_batches
        engine = self.rollout_engine(bucket, slots)
        at_once = runs_at_once(micro_batches, self.gen_config.max_new_tokens,
                               self.chunk_tokens)
        smaller = smaller_sizes(slots, self.layout.dp_size)
        return engine.lowered_programs(params, tokens_bp[:slots], mask_bp[:slots], rng,
                                       self._finish, at_once, smaller[0] if smaller else None)

    @property
    def occupancy(self) -> Occupancy:
        """Decode work of the engine's calls so far (a sync point on the calls not counted
        yet)."""
        self._count_work(len(self._pending_work))
        return self._occupancy

    def _count_work(self, calls: int):
        """Adds the decode work of the first `calls` pending calls to `_occupancy`."""
        done, self._pending_work = self._pending_work[:calls], self._pending_work[calls:]
        for work_k2 in fetch(done):
            self._occupancy = Occupancy(*(a + int(b) for a, b in zip(self._occupancy,
                                                                    work_k2.sum(axis=0))))

    @property
    def on_engine(self) -> bool:
        """Whether calls run on the rollout engine (not a pipelined layout's static batch)."""
        return not self._static

    def __call__(self, params, prompt_tokens_bp, prompt_mask_bp, rng,
                 max_new_tokens_b=None, micro_batches: int = 1) -> GenerateOutput:
        """Generates for a batch of left-padded prompts.

        Args:
          params: unboxed parameters, sharded as `layout.param_shardings` says.
          prompt_tokens_bp: int [b, P] left-padded prompts (numpy or jax); b must divide evenly
            over the layout's data-parallel size.
          prompt_mask_bp: bool [b, P], True on real tokens.
          rng: PRNG key.
          max_new_tokens_b: int [b] the most response tokens of each row (with
            `force_max_length`: exactly as many); default `max_new_tokens` for every row. Not
            on a pipelined layout.
          micro_batches: k > 1: rows j::k form micro-batch j, which samples with
            fold_in(rng, j) (row i as row i // k of it), decoded in b / k slots that take
            the queued rows as others finish. Not on a pipelined layout.

        Returns:
          GenerateOutput whose prompt part has the bucketed length (>= P).
        """
        batch, prompt_len = np.shape(prompt_tokens_bp)
        check_batch_divisible(self.layout, batch, "generate batch")
        bucket = buckets.bucket_length(prompt_len, self.prompt_buckets)
        pad = functools.partial(buckets.pad_axis, length=bucket, axis=1, left=True)
        rng = transfer(rng, self._rng_sharding)  # device_put refuses keys multi-process
        if self._static:
            if max_new_tokens_b is not None or micro_batches > 1:
                raise ValueError(f"per-row response lengths need the rollout engine, which a "
                                 f"pipelined layout ({self.layout}) does not run")
            tokens_bp = pad(prompt_tokens_bp, value=self.gen_config.pad_token_id)
            mask_bp = pad(prompt_mask_bp, value=False)
            tokens_bp, mask_bp = jax.device_put(
                (tokens_bp.astype(jnp.int32), mask_bp.astype(bool)), self._rows)
            # Raw uint32 and typed keys need different executables.
            key = (bucket, batch, rng.shape, str(rng.dtype))
            return self._executable(key, params, tokens_bp, mask_bp, rng)(
                params, tokens_bp, mask_bp, rng)
        # The engine schedules rows on the host: the prompts' whole values, on every process.
        prompt_tokens_bp, prompt_mask_bp = fetch((prompt_tokens_bp, prompt_mask_bp))
        tokens_bp = pad(np.asarray(prompt_tokens_bp, np.int32),
                        value=self.gen_config.pad_token_id)
        mask_bp = pad(np.asarray(prompt_mask_bp, bool), value=False)
        slots = batch // micro_batches
        check_batch_divisible(self.layout, slots, "generate micro-batch")
        keys = [rng] if micro_batches == 1 else [jax.random.fold_in(rng, j)
                                                 for j in range(micro_batches)]
        rows = np.arange(batch, dtype=np.int32)
        engine = self.rollout_engine(bucket, slots)
        reach = self.gen_config.max_new_tokens if max_new_tokens_b is None else int(
            np.max(max_new_tokens_b))
        if runs_at_once(micro_batches, reach, self.chunk_tokens):
            out, work_b2 = engine.decode_at_once(params, 0, tokens_bp, mask_bp, keys * batch,
                                                 rows, max_new_tokens_b, self._finish)
            self._pending_work.append(work_b2)
            if len(self._pending_work) > _PENDING_WORK:
                self._count_work(_PENDING_WORK // 2)
            return out
        out, work = decode_rows(engine, params, tokens_bp, mask_bp,
                                [keys[i % micro_batches] for i in rows], rows // micro_batches,
                                slots, self.chunk_tokens, max_new_tokens_b)
        self._occupancy = Occupancy(*(a + b for a, b in zip(self._occupancy, work)))
        response_mask_bn = out["response_mask_bn"]
        host = GenerateOutput(
            sequences_bs=out["sequences_bs"], prompt_mask_bp=mask_bp,
            response_bn=out["sequences_bs"][:, bucket:], response_mask_bn=response_mask_bn,
            logprobs_bn=out["logprobs_bn"],
            response_lengths_b=response_mask_bn.sum(axis=1, dtype=np.int32),
            routes_bslk=out.get("routes_bslk"))
        return GenerateOutput(*transfer(tuple(host), tuple(self._out_shardings)))


def make_generate_fn(
    model_config: ModelConfig,
    gen_config: GenerateConfig,
    layout: Layout,
    *,
    prompt_buckets: Sequence[int] | None = None,
    chunk_tokens: int = CHUNK_TOKENS,
) -> Generator:
    """The generate call kind: `(params, prompt_tokens_bp, prompt_mask_bp, rng) -> GenerateOutput`.

    Args:
      model_config: an LM-head model.
      gen_config: static sampling settings.
      layout: devices, mesh and sharding rules to compile for.
      prompt_buckets: allowed prompt lengths; default powers of two from 16, capped at
        `model_config.max_position_embeddings`.
      chunk_tokens: tokens the engine decodes between looks at which rows finished (the
        rows are compacted, and queued rows take free slots, only then).
    """
    if prompt_buckets is None:
        prompt_buckets = buckets.power_of_two_buckets(model_config.max_position_embeddings)
    return Generator(model_config, gen_config, layout, prompt_buckets, chunk_tokens)
