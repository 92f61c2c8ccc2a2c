"""The analytic time model of one MFC, of a parameter reallocation and of offload/onload.

Every estimate is a `CallCost`: seconds each resource would take at peak (matmul FLOPs, HBM
bytes, link bytes), fixed latencies, and counts of overhead events: layer launches (each pass
through the model launches its layers' kernels, plus the embedding, head and sampling, which cost
about one more layer), jit calls (host dispatch and the wait for the result) and per-array
operations (the optimizer updates, and a parameter movement moves, each parameter array on its
own). `CallCost.seconds(cluster)` divides by the cluster's efficiency factors, prices the events
at its `layer_overhead`, `call_overhead` and `array_overhead`, and adds the parts. Adding,
rather than overlapping, compute, memory and communication is conservative, and it makes
calibration a linear least-squares fit (`fit_calibration`). The overheads matter where the
work is tiny: one decode step of a large model (ReaL's CUDA-graph gap) or any call of a small
one.

Per call kind, on a sub-mesh with degrees d × f × t (× p pipeline stages) and k micro-batches,
rows r = batch/(d·f·k) per device and micro-batch:
  * train_step: (3 + remat recompute) forward passes of FLOPs, split t ways; per micro-batch
    tensor-parallel all-reduces of activations (2 per layer per forward or backward pass:
    `tensor_reduces_per_layer`), fsdp
    all-gathers of the weights (forward, recompute, backward) and a reduce-scatter of the
    gradients, and a data-parallel all-reduce of the gradients: the runtime constrains its
    gradient accumulator to the parameter sharding, so gradients are reduced every micro-batch.
    Then one optimizer update, bound by HBM traffic over the state. Times `updates`.
  * inference: one forward pass, its all-reduces and one fsdp all-gather per micro-batch.
  * generate: prefill (compute-bound forward over the prompt), then one decode step per new
    token, bound by reading the weights and the whole KV cache (the runtime attends over every
    cache slot), with fsdp gathering the weights on every step.
A mesh axis whose device group spans hosts communicates at the inter-host bandwidth.
Train steps and inference pack sequences into rows (`engine.packing`): their work is counted
on the r rows' tokens (prompt + the workload's mean response), in whole rows of the sequence
length (`Workload.packed_tokens_per_device`), not on r padded rows.

Pipelines (p > 1; `pipelined`). The layers are cut into p stages of d × f × t devices each; a
stage does 1/p of a micro-batch's work (FLOPs, collectives, weight reads) per slot. The k
micro-batches stream through the stages, GPipe or 1F1B alike in k + p - 1 slots, so the bubble
is (p-1)/(k+p-1) of the time; every slot ends with a stage-to-stage send of the micro-batch's
activations (and, training, of their gradients back), on the slowest hop's link. A pipelined
train_step is one backward pass per update, so its gradients are reduced once per update, not
per micro-batch. Pipelined decoding keeps every micro-batch in flight. The runtime keeps the
pipeline full across tokens as ReaL does (`DecodeSchedule.ACROSS_TOKENS`,
`engine/pipelined_decode.py`): max(k, p) slots per token (with k < p a token waits for its
micro-batch to come round); `DecodeSchedule.PER_TOKEN` prices one pipeline pass per token
(k + p - 1 slots). A pipelined train step is one jit call per update; pipelined inference
is a jit call per micro-batch, each streaming its rows in pieces with a fill and drain of its
own (`inference_cost`).

Mixtures of experts (`ModelConfig.moe`). A token's FLOPs are its router's and its top_k
experts' (`ModelProfile.matmul_params`), not all E; the rules cut each expert's width t ways as
a dense MLP's, so the experts' FLOPs are split t ways and their block's output is summed over t
like the MLP's; the router runs whole on every tensor rank (`tensor_split_flops`,
`tensor_reduces_per_layer`). A decode step reads the
weights of the experts its rows route to (`expert_read_fraction`); every other weight movement
(fsdp gathers, reallocation, offload, the optimizer's update) moves all E experts. With
expert parallelism (e > 1: the batch split d·e·f ways, 1/e of the experts on each expert rank)
the sparse layers exchange tokens by all-to-all (`expert_all_to_all`), the experts' gradients
are reduced over d ranks and the rest over d·e (`_reduce_gradients`).

Parameter movements (`realloc_cost`, `offload_cost`). Each device of a layout holds one block
of every matrix, whatever the data degree (`plan/blocks.py`; the embedding and head, a few
percent of the bytes, are priced like a layer). A destination device needs its block; the part
of it that it already holds under the source layout stays, the rest moves — from a device on
its own host (intra-host bandwidth) where the source has a replica there, else across hosts.

Routes (what `parallel.reshard` can do):
  * NONE: same devices and same (f, t): every device already holds its block.
  * DIRECT: one jit or one device_put: the same device set, or a single host (one process), or
    across hosts with equal device counts and equal shard shapes (JAX's cross-process limit).
  * STAGED: any other cross-host move goes through host memory: offload the source shards,
    send them over the network, onload the destination shards.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Sequence

import numpy as np
from scipy import optimize

from jaxrlhf.mfc import Call
from jaxrlhf.models.config import RematPolicy
from jaxrlhf.parallel.pipeline import remats_stages
from jaxrlhf.parallel.strategy import Axis
from jaxrlhf.plan.blocks import axis_size, missing_share, stride
from jaxrlhf.plan.choice import CallChoice
from jaxrlhf.plan.cluster import OVERHEADS, Calibration, Cluster
from jaxrlhf.plan.experiment import DEFAULT_DECODE, DecodeSchedule, Workload
from jaxrlhf.plan.memory import streamed_micro_batches
from jaxrlhf.plan.profile import ModelProfile


@dataclasses.dataclass(frozen=True)
class CallCost:
    """Seconds at peak per resource, fixed latency (not scaled by any efficiency), and counts of
    overhead events: `launches` (layer launches), `calls` (jit calls) and `arrays` (per-array
    operations: parameter arrays updated by the optimizer or moved)."""

    compute: float = 0.0
    memory: float = 0.0
    comm: float = 0.0
    fixed: float = 0.0
    launches: float = 0.0
    calls: float = 0.0
    arrays: float = 0.0

    def __add__(self, other: "CallCost") -> "CallCost":
        return CallCost(*(a + b for a, b in zip(self.parts(), other.parts())))

    def times(self, k: float) -> "CallCost":
        return CallCost(*(a * k for a in self.parts()))

    def parts(self) -> tuple[float, ...]:
        return (self.compute, self.memory, self.comm, self.fixed, self.launches, self.calls,
                self.arrays)  # the fields in order (spelled out: the search adds millions)

    def seconds(self, cluster: Cluster) -> float:
        return (self.compute / cluster.matmul_efficiency + self.memory / cluster.hbm_efficiency
                + self.comm / cluster.comm_efficiency + self.fixed
                + self.launches * cluster.layer_overhead + self.calls * cluster.call_overhead
                + self.arrays * cluster.array_overhead)


ZERO = CallCost()


def axis_link(cluster: Cluster, choice: CallChoice, axis: Axis) -> tuple[float, float]:
    """(bandwidth, latency) of one mesh axis: inter-host when its device groups span hosts.

    The mesh is the range's devices reshaped to the mesh axes (`mesh_order`), so an axis with
    stride s and size n groups devices first, first+s, ..., first+s(n-1); sub-meshes are
    host-aligned, so the first group is representative. A pipeline is as slow as its slowest
    hop, so a pipeline axis that spans hosts uses the inter-host link.
    """
    size = axis_size(choice, axis)
    last = choice.devices.first + stride(axis, choice) * (size - 1)
    if cluster.host_of(last) != cluster.host_of(choice.devices.first):
        return cluster.inter_host_bandwidth, cluster.inter_host_latency
    return cluster.intra_host_bandwidth, cluster.intra_host_latency


def all_reduce(nbytes: float, n: int, link: tuple[float, float]) -> CallCost:
    """Ring all-reduce of an `nbytes` buffer over n devices."""
    if n == 1:
        return ZERO
    bandwidth, latency = link
    return CallCost(comm=2 * (n - 1) / n * nbytes / bandwidth, fixed=2 * (n - 1) * latency)


def all_gather(nbytes: float, n: int, link: tuple[float, float]) -> CallCost:
    """Ring all-gather whose result is `nbytes` per device (also a reduce-scatter's cost)."""
    if n == 1:
        return ZERO
    bandwidth, latency = link
    return CallCost(comm=(n - 1) / n * nbytes / bandwidth, fixed=(n - 1) * latency)


def _forward(p: ModelProfile, cluster: Cluster, choice: CallChoice, tokens: int, context: int,
             flop_passes: float = 1.0, layer_passes: float = 1.0) -> CallCost:
    """Forward-pass equivalents over `tokens` local tokens.

    Args:
      flop_passes: forward passes worth of FLOPs (split t ways).
      layer_passes: passes through the layers that each do `tensor_reduces_per_layer`
        tensor all-reduces of the activations and launch the layers (plus one for embedding
        and head).
    """
    flops = tensor_split_flops(p, context, choice.tensor, choice.expert) * tokens * flop_passes
    activation = tokens * p.config.hidden_size * p.act_itemsize
    reduces = all_reduce(activation, choice.tensor, axis_link(cluster, choice, Axis.TENSOR))
    return (CallCost(compute=flops / cluster.peak_bf16_flops)
            + reduces.times(tensor_reduces_per_layer(p, choice.tensor)
                            * p.config.num_layers * layer_passes)
            + expert_all_to_all(p, cluster, choice, tokens).times(layer_passes)
            + CallCost(launches=(p.config.num_layers + 1) * layer_passes))


def tensor_split_flops(p: ModelProfile, context: int, tensor: int, expert: int = 1) -> float:
    """Forward FLOPs per local token one device of a tensor group does: the dense part
    (attention, dense MLPs, head) split t ways, a sparse block's experts as the rules cut
    their width (`ModelProfile.expert_tensor_ways`: t ways where t divides it), its router
    whole on every tensor rank (each routes the same tokens). With e > 1 expert ranks the local
    experts' grouped matmuls run over the e·T·k rows of the static all-to-all buffers
    (`models.expert_parallel`: dropless, a worst-case buffer per peer), e times the rows."""
    router = 2.0 * p.router_params
    experts = 2.0 * p.expert_matmul_params - router
    dense = p.forward_flops_per_token(context) - router - experts
    return dense / tensor + router + experts * expert / p.expert_tensor_ways(tensor)


def tensor_reduces_per_layer(p: ModelProfile, tensor: int) -> int:
    """All-reduces over the t ranks of a layer's activations per pass: attention's output and
    the feed-forward's, a dense MLP's or a sparse block's (its experts' partial outputs over
    their cut width, `models.expert_parallel`). A sparse block whose experts t does not cut
    (`ModelProfile.expert_tensor_ways` 1: each rank computes them whole) sums nothing, but
    a mixed model's scanned layers run the dense MLP beside it (`models.transformer`)."""
    m = p.config.moe
    if m is None or m.mixed or p.expert_tensor_ways(tensor) > 1:
        return 2
    return 1


def expert_all_to_all(p: ModelProfile, cluster: Cluster, choice: CallChoice,
                      tokens: float) -> CallCost:
    """One pass of the sparse layers' all-to-alls over `tokens` local tokens (0 without expert
    parallelism): per sparse layer the dispatch and the return, each exchanging a buffer of
    e·T·k rows of the model width (`models.expert_parallel`) of which (e-1)/e leaves the
    device; a backward pass runs the same two exchanges transposed."""
    e, m = choice.expert, p.config.moe
    if e == 1 or m is None:
        return ZERO
    bandwidth, latency = axis_link(cluster, choice, Axis.EXPERT)
    buffer = e * tokens * m.top_k * p.config.hidden_size * p.act_itemsize
    one = CallCost(comm=(e - 1) / e * buffer / bandwidth, fixed=(e - 1) * latency)
    return one.times(2 * len(m.sparse_layers(p.config.num_layers)))


def _reduce_gradients(p: ModelProfile, cluster: Cluster, choice: CallChoice) -> CallCost:
    """The data-parallel all-reduce of a device's gradients: the experts' (1/e of them held)
    over the d data ranks, every other parameter's over the d·e ranks that replicate it."""
    shard = p.shard_bytes(choice.tensor, choice.fsdp, choice.pipeline, choice.expert)
    experts = p.expert_shard_bytes(choice.tensor, choice.fsdp, choice.pipeline, choice.expert)
    link = axis_link(cluster, choice, Axis.DATA if choice.data > 1 else Axis.EXPERT)
    return (all_reduce(shard - experts, choice.data * choice.expert, link)
            + all_reduce(experts, choice.data, link))


def expert_read_fraction(p: ModelProfile, rows: int) -> float:
    """Expected share of a sparse layer's experts that `rows` tokens route to, k each, all
    experts equally likely: 1 - (1 - k/E)^rows. A decode step's grouped matmuls read only the
    weights of experts that got a token (0 for a dense model)."""
    m = p.config.moe
    if m is None:
        return 0.0
    return 1.0 - (1.0 - m.top_k / m.num_experts) ** rows


def _gather_weights(p: ModelProfile, cluster: Cluster, choice: CallChoice) -> CallCost:
    """One fsdp all-gather of every layer's weights (tensor-sharded result per device)."""
    link = axis_link(cluster, choice, Axis.FSDP)
    return all_gather(p.shard_bytes(choice.tensor, 1, 1, choice.expert), choice.fsdp, link)


def _remat_passes(p: ModelProfile, context: int) -> float:
    """Extra forward-pass equivalents the backward pass recomputes."""
    match p.config.remat:
        case RematPolicy.NONE:
            return 0.0
        case RematPolicy.DOTS:  # attention einsums have batch dims: recomputed
            attention = 4 * p.config.num_layers * p.attn_dim * context
            return attention / p.forward_flops_per_token(context)
        case RematPolicy.FULL:
            return 1.0


def optimizer_bytes_per_param(p: ModelProfile, fp32_master: bool) -> int:
    """HBM bytes one optimizer update reads and writes per parameter."""
    state = 4 if (fp32_master or p.param_itemsize == 4) else p.param_itemsize
    master = 2 * 4 if fp32_master else 0
    return 4 + 2 * 2 * state + 2 * p.param_itemsize + master  # grads, m and v, params, master


def stage_send(p: ModelProfile, cluster: Cluster, choice: CallChoice, tokens: int) -> CallCost:
    """One stage-to-stage send of `tokens` local tokens' hidden states (point to point); zero
    without a pipeline. Tensor ranks hold the activations replicated and each sends its copy
    on its own link, so the bytes per device are the whole activation."""
    if choice.pipeline == 1:
        return ZERO
    bandwidth, latency = axis_link(cluster, choice, Axis.PIPELINE)
    return CallCost(comm=tokens * p.config.hidden_size * p.act_itemsize / bandwidth,
                    fixed=latency)


def pipelined(micro: CallCost, send: CallCost, choice: CallChoice, slots: int) -> CallCost:
    """`slots` pipeline slots: each a stage's 1/p share of one micro-batch's `micro` work, then
    one `send`. Without a pipeline (p = 1) that is `slots` micro-batches one after another."""
    return micro.times(slots / choice.pipeline) + send.times(slots)


def schedule_slots(choice: CallChoice) -> int:
    """Slots of a GPipe or 1F1B schedule of M micro-batches over p stages: M + p - 1."""
    return choice.micro_batches + choice.pipeline - 1


def bubble_fraction(choice: CallChoice) -> float:
    """Share of a pipelined pass that each stage idles: (p - 1) / (M + p - 1)."""
    return (choice.pipeline - 1) / schedule_slots(choice)


def train_cost(p: ModelProfile, work: Workload, choice: CallChoice, cluster: Cluster,
               fp32_master: bool, remat_stages: bool | None = None) -> CallCost:
    """One train_step MFC: `work.updates` optimizer updates (`remat_stages`: a pipeline that
    recomputes each stage's forward in the backward pass, one more forward; None: as the
    runtime does, `parallel.pipeline.remats_stages`)."""
    if remat_stages is None:
        remat_stages = remats_stages(p.config.remat)
    tokens = work.packed_tokens_per_device(Call.TRAIN_STEP, choice.dp_size,
                                           choice.micro_batches, choice.pipeline)
    s = work.seq_len
    full = p.config.remat is RematPolicy.FULL
    again = int(remat_stages and choice.pipeline > 1)
    # Backward = 2 forwards of FLOPs but one pass through the layers' all-reduces.
    micro = _forward(p, cluster, choice, tokens, s,
                     flop_passes=3 + again + _remat_passes(p, s), layer_passes=2 + full + again)
    micro = micro + _gather_weights(p, cluster, choice).times(2 + full + again + 1)  # + scatter
    grads = _reduce_gradients(p, cluster, choice)
    # Activations forward, their gradients back.
    send = stage_send(p, cluster, choice, tokens).times(2)
    update_bytes = (p.shard_elements(choice.tensor, choice.fsdp, choice.pipeline, choice.expert)
                    * optimizer_bytes_per_param(p, fp32_master))
    # One jit call per update, whose optimizer runs a few kernels per parameter array.
    update = CallCost(memory=update_bytes / cluster.hbm_bandwidth, calls=1, arrays=len(p.leaves))
    if choice.pipeline == 1:  # the accumulator is reduced after every micro-batch
        passes = (micro + grads).times(choice.micro_batches)
    else:  # one backward pass through the pipeline, one reduction
        passes = pipelined(micro, send, choice, schedule_slots(choice)) + grads
    return (passes + update).times(work.updates)


def inference_cost(p: ModelProfile, work: Workload, choice: CallChoice,
                   cluster: Cluster) -> CallCost:
    """One forward pass over the batch (log-probs, values or scores): a jit call per
    micro-batch. A pipeline streams each call's rows through its stages again, in the pieces
    `memory.streamed_micro_batches` counts, each call with its own fill and drain: pieces +
    p - 1 slots of a piece's work (`dataflow.executors.in_micro_batches` runs the calls)."""
    tokens = work.packed_tokens_per_device(Call.INFERENCE, choice.dp_size,
                                           choice.micro_batches, choice.pipeline)
    s = work.seq_len
    calls = choice.micro_batches
    pieces = streamed_micro_batches(work, Call.INFERENCE, choice) if choice.pipeline > 1 else 1
    micro = (_forward(p, cluster, choice, tokens / pieces, s)
             + _gather_weights(p, cluster, choice))
    send = stage_send(p, cluster, choice, tokens / pieces)
    slots = pieces + choice.pipeline - 1
    return pipelined(micro, send, choice, slots).times(calls) + CallCost(calls=calls)


def decode_step_cost(p: ModelProfile, work: Workload, choice: CallChoice,
                     cluster: Cluster) -> CallCost:
    """One decode step of one micro-batch: every row feeds one token."""
    rows = work.rows_per_device(Call.GENERATE, choice.dp_size, choice.micro_batches)
    s = work.seq_len
    t = choice.tensor
    experts = p.expert_shard_bytes(t, 1, 1, choice.expert)
    # An expert rank's experts take the assignments of all e ranks' rows.
    weights = (p.shard_bytes(t, 1, 1, choice.expert) - experts
               + experts * expert_read_fraction(p, rows * choice.expert))
    reads = weights + rows * s * p.kv_bytes_per_token() / t
    return (_forward(p, cluster, choice, rows, s) + _gather_weights(p, cluster, choice)
            + CallCost(memory=reads / cluster.hbm_bandwidth))


def prefill_rows(work: Workload, choice: CallChoice) -> int:
    """Prompts one device prefills per micro-batch: the rollout engine prefills each distinct
    prompt once (a GRPO group's rows share it); a pipeline's static batch prefills every row."""
    if choice.pipeline > 1:
        return work.rows_per_device(Call.GENERATE, choice.dp_size, choice.micro_batches)
    return work.prompts_per_device(choice.dp_size, choice.micro_batches)


def prefill_cost(p: ModelProfile, work: Workload, choice: CallChoice,
                 cluster: Cluster) -> CallCost:
    """The prefill of one micro-batch's prompts (a forward pass over them)."""
    tokens = prefill_rows(work, choice) * work.prompt_len
    return _forward(p, cluster, choice, tokens, work.seq_len) + _gather_weights(p, cluster, choice)


def generate_cost(p: ModelProfile, work: Workload, choice: CallChoice, cluster: Cluster,
                  decode: DecodeSchedule = DEFAULT_DECODE,
                  tokens: int | None = None) -> CallCost:
    """Prefill over the prompts, then `tokens` (None: `new_tokens`) decode steps, per
    micro-batch."""
    rows = work.rows_per_device(Call.GENERATE, choice.dp_size, choice.micro_batches)
    prefill = prefill_cost(p, work, choice, cluster)
    prefill_send = stage_send(p, cluster, choice, prefill_rows(work, choice) * work.prompt_len)
    token_send = stage_send(p, cluster, choice, rows)
    # All micro-batches in flight; a token of each takes (module docstring):
    match decode:
        case DecodeSchedule.PER_TOKEN:
            cycle = schedule_slots(choice)
        case DecodeSchedule.ACROSS_TOKENS:
            cycle = max(choice.micro_batches, choice.pipeline)
    decode = pipelined(decode_step_cost(p, work, choice, cluster), token_send, choice, cycle)
    calls = choice.micro_batches if choice.pipeline == 1 else 1
    return (pipelined(prefill, prefill_send, choice, schedule_slots(choice))
            + decode.times(work.new_tokens if tokens is None else tokens)
            + CallCost(calls=calls))


def call_cost(p: ModelProfile, call: Call, work: Workload, choice: CallChoice, cluster: Cluster,
              fp32_master: bool = False,
              decode: DecodeSchedule = DEFAULT_DECODE) -> CallCost:
    """The cost of one MFC of kind `call` (see the module docstring)."""
    match call:
        case Call.TRAIN_STEP:
            return train_cost(p, work, choice, cluster, fp32_master)
        case Call.INFERENCE:
            return inference_cost(p, work, choice, cluster)
        case Call.GENERATE:
            return generate_cost(p, work, choice, cluster, decode)
    raise ValueError(f"unknown call kind {call}")


_FITTED = ("compute", "memory", "comm", "launches", "calls", "arrays")  # x₁ ... x₆


def fit_calibration(records: Sequence[tuple[CallCost, float]], default: Calibration,
                    source: str = "") -> Calibration:
    """Efficiencies and overheads that best explain measured MFC times (the `--calibrate` hook).

    Solves measured - fixed ≈ compute·x₁ + memory·x₂ + comm·x₃ + launches·x₄ + calls·x₅ +
    arrays·x₆ with x ≥ 0 by non-negative least squares on errors relative to each measurement
    (so a 10 ms MFC counts as much as a 10 s one); efficiency = 1/x, clipped to (0, 1] (x = 0:
    the term explains nothing, so it gets the best efficiency, 1), and the layer, call and
    transfer overheads are x₄, x₅, x₆ seconds. A term no record exercises keeps the default.

    Args:
      records: (model estimate at unit efficiency, measured seconds) per timed MFC.
      default: the values to keep for unexercised terms (e.g. `cluster.calibration()`).
      source: a note stored in the calibration.
    """
    a = np.array([[getattr(c, name) for name in _FITTED] for c, _ in records], dtype=np.float64)
    seconds = np.array([s for _, s in records], dtype=np.float64)
    if np.any(seconds <= 0):
        raise ValueError("measured seconds must be positive")
    b = seconds - np.array([c.fixed for c, _ in records])
    used = a.sum(axis=0) > 0
    x = np.zeros(len(_FITTED))
    x[used], _ = optimize.nnls(a[:, used] / seconds[:, None], b / seconds)
    defaults = (default.matmul_efficiency, default.hbm_efficiency, default.comm_efficiency)
    eff = [(min(1.0, 1.0 / xi) if xi > 0 else 1.0) if u else d
           for xi, u, d in zip(x[:3], used[:3], defaults)]
    overheads = {name: float(xi) if u else getattr(default, name)
                 for name, xi, u in zip(OVERHEADS, x[3:], used[3:])}
    return Calibration(*eff, source=source or f"fit on {len(records)} MFC timings", **overheads)


class Route(enum.Enum):
    NONE = "none"
    DIRECT = "direct"
    STAGED = "staged"


@dataclasses.dataclass(frozen=True)
class ReallocCost:
    """How a reallocation goes, what it costs, and the global bytes that cross a link."""

    route: Route
    cost: CallCost
    bytes_moved: int


def choose_route(src: CallChoice, dst: CallChoice, cluster: Cluster) -> Route:
    if src.param_layout == dst.param_layout:
        return Route.NONE
    if src.devices == dst.devices:
        return Route.DIRECT
    hosts = set(cluster.hosts_of(src.devices)) | set(cluster.hosts_of(dst.devices))
    same_shards = (src.num_devices == dst.num_devices and src.tensor == dst.tensor
                   and src.fsdp == dst.fsdp and src.pipeline == dst.pipeline
                   and src.expert == dst.expert)
    return Route.DIRECT if len(hosts) == 1 or same_shards else Route.STAGED


def _incoming(p: ModelProfile, src: CallChoice, dst: CallChoice, cluster: Cluster
              ) -> tuple[np.ndarray, np.ndarray]:
    """Per destination device: bytes it must receive, and the share of them found on its host."""
    devices = np.arange(dst.devices.first, dst.devices.last + 1)
    shard = p.shard_bytes(dst.tensor, dst.fsdp, dst.pipeline, dst.expert)
    needed = shard * missing_share(src, dst)
    per_host = cluster.devices_per_host
    host_first = (devices // per_host) * per_host
    on_host = np.clip(np.minimum(host_first + per_host, src.devices.last + 1)
                      - np.maximum(host_first, src.devices.first), 0, None)
    local_share = np.minimum(on_host / (src.fsdp * src.tensor * src.pipeline * src.expert), 1.0)
    return needed, local_share


def host_transfer_cost(nbytes: float, arrays: int, cluster: Cluster) -> CallCost:
    """Moving `nbytes` per device in `arrays` arrays between device and host memory (either
    way): every device streams its shards over its own host link at once."""
    return CallCost(comm=nbytes / cluster.host_link_bandwidth, arrays=arrays)


def offload_cost(p: ModelProfile, choice: CallChoice, cluster: Cluster) -> CallCost:
    """Moving one layout's parameter shards between device and host memory (either way)."""
    nbytes = p.shard_bytes(choice.tensor, choice.fsdp, choice.pipeline, choice.expert)
    return host_transfer_cost(nbytes, len(p.leaves), cluster)


def realloc_cost(p: ModelProfile, src: CallChoice, dst: CallChoice,
                 cluster: Cluster) -> ReallocCost:
    """Moving a model's parameters from layout `src` to layout `dst` (a new copy on `dst`)."""
    route = choose_route(src, dst, cluster)
    if route is Route.NONE:
        return ReallocCost(route, CallCost(), 0)
    needed, local_share = _incoming(p, src, dst, cluster)
    if route is Route.STAGED:
        network = float(np.max(needed)) / cluster.inter_host_bandwidth
        cost = (offload_cost(p, src, cluster) + CallCost(comm=network)
                + offload_cost(p, dst, cluster))
        return ReallocCost(route, cost, int(needed.sum()))
    seconds = (needed * local_share / cluster.intra_host_bandwidth
               + needed * (1.0 - local_share) / cluster.inter_host_bandwidth)
    cost = CallCost(comm=float(np.max(seconds)), arrays=len(p.leaves))
    return ReallocCost(route, cost, int(needed.sum()))
