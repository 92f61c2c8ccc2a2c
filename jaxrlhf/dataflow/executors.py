"""Executors: one callable per MFC that turns the step buffer into that MFC's outputs.

Each executor moves its inputs to its own layout (the consumer's data-parallel layout), fetches
its model's parameters on that layout through the ModelRuntime (which reallocates them when
the model's previous call used another layout), dispatches the engine call, and returns device
arrays without waiting. The host reward executor is the exception: it must read the generated
tokens, so it blocks on them and hands the scoring to a process pool, returning a future.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
from collections.abc import Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from jaxrlhf.algorithms.routing import is_routes_key
from jaxrlhf.algorithms.spec import TrainSpec, response_values
from jaxrlhf.data.rewards import RewardBatch, RewardPool
from jaxrlhf.data.tokenizer import Tokenizer, decode_response
from jaxrlhf.dataflow.runtime import ModelRuntime
from jaxrlhf.engine.generate import Generator
from jaxrlhf.engine.inference import InferenceBatch, InferenceFn
from jaxrlhf.engine import buckets, microbatch
from jaxrlhf.engine.microbatch import minibatches
from jaxrlhf.engine.train_step import ROUTES_KEY, TrainStep
from jaxrlhf.mfc import MFC
from jaxrlhf.parallel.layout import Layout
from jaxrlhf.parallel.reshard import fetch, transfer

Buffer = Mapping[str, object]


def move_to(layout: Layout, arrays: Mapping[str, object]) -> dict[str, jax.Array]:
    """Batch arrays re-split over `layout`'s data-parallel axes, without waiting."""
    return transfer(dict(arrays), {k: layout.batch_sharding(np.ndim(v)) for k, v in arrays.items()})


# Jitted, so the position arithmetic runs on the devices as one program, not eager ops.
padded_batch = jax.jit(InferenceBatch.padded)


@functools.partial(jax.jit, static_argnums=1)
def _response_part(out, n: int) -> jax.Array:
    """The part of an inference output the step buffer keeps: per response token, or per row."""
    if out.logprobs_bt is not None:
        return out.logprobs_bt[:, -n:]
    if out.values_bt is not None:
        return response_values(out.values_bt, n)
    return out.scores_bk[:, 0]


@functools.partial(jax.jit, static_argnums=1)
def _split(arrays, k: int) -> list:
    """k strided micro-batches (rows j::k) of every array [b, ...]: each stays spread over the
    data-parallel devices (see engine.microbatch)."""
    split_kb = microbatch.split(arrays, k)
    return [jax.tree.map(lambda x, j=j: x[j], split_kb) for j in range(k)]


@jax.jit
def _merge(outputs: list):
    """The inverse of `_split`: micro-batch j's row r back at row r·k + j."""
    return jax.tree.map(lambda *xs: jnp.stack(xs, 1).reshape(-1, *xs[0].shape[1:]), *outputs)


def cut_responses(arrays, max_new_tokens: int):
    """Generated (sequences [b, P + N], sequence mask [b, P + N], response mask [b, N],
    log-probs [b, N], and where recorded the routes [b, P + N, L, k]), host or device arrays,
    cut to the first of `buckets.response_widths` their longest response fits (a sync point
    on one scalar): the columns after it are padding in every row."""
    seq_bs, seq_mask_bs, response_mask_bn, logp_bn, *routes = arrays
    xp = np if isinstance(response_mask_bn, np.ndarray) else jnp
    longest = int(fetch(xp.max(xp.sum(response_mask_bn, axis=1, dtype=xp.int32))))
    width = buckets.bucket_length(longest, buckets.response_widths(max_new_tokens))
    if width == response_mask_bn.shape[1]:
        return arrays
    end = seq_bs.shape[1] - response_mask_bn.shape[1] + width
    return (seq_bs[:, :end], seq_mask_bs[:, :end], response_mask_bn[:, :width],
            logp_bn[:, :width], *(r[:, :end] for r in routes))


def in_micro_batches(call: Callable, arrays, k: int):
    """`call(arrays)` run as k sequential calls on strided micro-batches, outputs merged:
    the same rows, a k-th of the activations live at a time."""
    if k == 1:
        return call(arrays, 0)
    return _merge([call(part, j) for j, part in enumerate(_split(arrays, k))])


def _inputs(mfc: MFC, buf: Buffer, layout: Layout, keys=None) -> dict[str, jax.Array]:
    return move_to(layout, {k: buf[k] for k in (keys or mfc.inputs)})


def generate_executor(mfc: MFC, model: ModelRuntime, layout: Layout, generator: Generator,
                      rng_of_step: Callable[[], jax.Array], micro_batches: int = 1):
    """Reads the MFC's first two inputs (prompt tokens [b, p], prompt mask [b, p]) and writes
    its outputs in order: sequence tokens [b, s], sequence mask [b, s], response mask [b, n],
    behaviour log-probs [b, n]. Keys come from the MFC, so a graph can hold several generate
    calls (ReMax's sampled and greedy responses). With `micro_batches` k > 1, micro-batch j
    samples with fold_in(step rng, j); on the rollout engine its rows queue for b/k slots
    in one call (a slot whose row finished takes the next), else the micro-batches run one
    after the other."""
    prompt_keys = mfc.inputs[:2]
    routed = any(is_routes_key(k) for k in mfc.outputs)  # routing replay's recorded experts

    def outputs(out):
        if routed and out.routes_bslk is None:
            raise ValueError(f"MFC {mfc.name}: its layout ({layout}) records no expert routes "
                             "(a pipeline), which routing replay reads: the checks refuse this "
                             "(run/check.py); give it a layout without pipeline stages")
        return (out.sequences_bs, out.sequence_mask_bs, out.response_mask_bn, out.logprobs_bn,
                *((out.routes_bslk,) if routed else ()))

    def run(buf: Buffer):
        inputs = _inputs(mfc, buf, layout, prompt_keys)
        params, rng = model.params_on(layout), rng_of_step()

        def call(part, j: int):
            key = rng if micro_batches == 1 else jax.random.fold_in(rng, j)
            return outputs(generator(params, *(part[k] for k in prompt_keys), key))

        if generator.on_engine:  # one call: the micro-batches' rows queue for b/k slots
            arrays = outputs(generator(params, *(inputs[k] for k in prompt_keys), rng,
                                       micro_batches=micro_batches))
        else:
            arrays = in_micro_batches(call, inputs, micro_batches)
        arrays = cut_responses(arrays, generator.gen_config.max_new_tokens)
        return dict(zip(mfc.outputs, arrays, strict=True))

    return run


def inference_executor(mfc: MFC, model: ModelRuntime, layout: Layout, infer: InferenceFn,
                       micro_batches: int = 1):
    """ref/actor log-probs, critic values or reward-model scores of sequences.

    The MFC's first three inputs name the sequences: tokens [b, s], mask [b, s], response mask
    [b, n] (further inputs are only dependencies); its one output gets the result.
    """
    (out_key,) = mfc.outputs
    routes = [k for k in mfc.inputs if is_routes_key(k)]  # routing replay's recorded experts
    keys = mfc.inputs[:3] + tuple(routes)

    def run(buf: Buffer):
        inputs = _inputs(mfc, buf, layout, keys)
        n = inputs[keys[2]].shape[1]
        params = model.params_on(layout)

        def call(part, _):
            batch = padded_batch(part[keys[0]], part[keys[1]])
            return _response_part(infer(params, batch, *(part[k] for k in routes)), n)

        out = in_micro_batches(call, inputs, micro_batches)
        model.after_call()
        return {out_key: out}

    return run


@dataclasses.dataclass(frozen=True)
class HostFunction:
    """A role computed by a host function (reward, cost): its process pool and error budget.

    Attributes:
      pool: the worker processes that run the function.
      max_error_rate: a step in which a larger fraction of calls fails (raises, hangs, returns
        a bad value) stops the run: training on a batch of zeros would teach the model nothing
        true, silently.
    """

    pool: RewardPool
    max_error_rate: float


class HostFunctionError(RuntimeError):
    """A host function failed on too many samples of one step."""


def check_error_rate(result: RewardBatch, role: str, max_error_rate: float) -> None:
    """Raises HostFunctionError naming the failures if too many calls of `result` failed."""
    size = len(result.rewards_b)
    if size and result.errors.total / size > max_error_rate:
        shown = "; ".join(result.messages[:3])
        raise HostFunctionError(
            f"{role} function failed on {result.errors.total} of {size} samples this step "
            f"({role}.max_error_rate={max_error_rate}): {shown}")


def host_reward_executor(mfc: MFC, tokenizer: Tokenizer, host: HostFunction,
                         waiter: concurrent.futures.ThreadPoolExecutor,
                         on_result: Callable[[object], None]):
    """Decodes responses (a sync point on the generated tokens) and scores them in the pool.

    The MFC's first three inputs name the sequences as for `inference_executor`.
    """
    (out_key,) = mfc.outputs
    tokens_key, _, response_key = mfc.inputs[:3]

    def run(buf: Buffer):
        # fetch: every process needs all rows (multi-process), to compute the same rewards.
        seq_bs, mask_bn = fetch((buf[tokens_key], buf[response_key]))
        n = mask_bn.shape[1]
        completions = [decode_response(tokenizer, row[-n:].tolist()) for row in seq_bs]
        handle = host.pool.submit(list(buf["prompt_text"]), completions, list(buf["answer"]))

        def collect():
            result = handle.result()
            on_result(result)
            check_error_rate(result, mfc.role.value, host.max_error_rate)
            return result.rewards_b.astype(np.float32)

        return {out_key: waiter.submit(collect)}

    return run


def _train_routes(mfc: MFC, routes_bslk, batch) -> jax.Array:
    """The recorded routes of a train batch's rows: the generated rows' own, which the
    algorithms that record them (`algorithms.routing`) train on as generated."""
    if np.shape(routes_bslk)[:2] != np.shape(batch["tokens_bt"]):
        raise ValueError(f"MFC {mfc.name}: routing replay needs the train batch's rows as "
                         f"generated, got {np.shape(batch['tokens_bt'])} tokens against routes "
                         f"{np.shape(routes_bslk)}")
    return routes_bslk


def train_executor(mfc: MFC, model: ModelRuntime, layout: Layout, spec: TrainSpec,
                   train_step: TrainStep, controller: Callable[[], Mapping[str, float]]):
    """The algorithm's prepare, then epochs × mini-batches optimizer updates."""
    prepare = jax.jit(spec.prepare)
    (out_key,) = mfc.outputs

    routes = [k for k in mfc.inputs if is_routes_key(k)]  # routing replay's recorded experts

    def run(buf: Buffer):
        inputs = _inputs(mfc, buf, layout)
        scalars = {k: np.float32(v) for k, v in controller().items()}
        batch, stats = prepare(inputs, jax.device_put(scalars, layout.replicated()))
        if routes:
            batch = {**batch, ROUTES_KEY: _train_routes(mfc, inputs[routes[0]], batch)}
        state, metrics = model.state, []
        for _ in range(spec.epochs):
            for mini in minibatches(batch, spec.mini_batches):
                state, m = train_step(state, mini)
                metrics.append(m)
        model.update(state)
        averaged = jax.tree.map(lambda *xs: jnp.mean(jnp.stack(xs)), *metrics)
        return {out_key: {**stats, **averaged}}

    return run
