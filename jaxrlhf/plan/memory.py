"""The memory model: bytes per device of one MFC, and of a whole plan over time.

One MFC on its own (`call_memory`), per device:
  * params: the model's parameters in the call's layout (exact, from the parameter tree);
  * optimizer (train): AdamW m and v (fp32 with a fp32 master or fp32 params, else the
    parameter dtype) plus the fp32 master copy, of the trained parameters (with LoRA the
    adapters alone, `ModelProfile.trained_shard_elements`);
  * grads (train): on XLA:CPU the fp32 gradients (and the parameter-dtype ones they are cast
    from), the fp32 accumulator over a loop of micro-batches (not after a pipeline's one
    backward pass), and the optimizer's update as it is formed (`train_memory`), all
    beside the activations; on a TPU or GPU the backward pass's gradients beside the
    activations and the optimizer step's trees after them (`step`, `gradient_phases`);
    whole over data parallelism (ZeRO-1 slices the optimizer state only);
  * activations: what the backward pass keeps under the remat policy plus one layer's working
    set (train; a mixture of experts' sparse block works on T*k rows of its grouped matmuls
    and fp32 [T, E] router arrays, and with expert parallelism on e*T*k-row all-to-all
    buffers, `_mlp_bytes`); without a backward pass (inference, generation's prefill) the layers and then
    the head run one after the other, so the larger of one layer's forward peak and the logits
    phase (generation adds the second cache copy its layer scan writes); the runtime's
    attention materialises fp32 scores [heads, query, slot], which dominate at long context;
  * kv_cache (pipelined generate): keys and values of every slot of every row of one executor
    call;
  * state (generate on the rollout engine): its slots' KV cache at full capacity, an argument
    every executable of the engine takes and gives back (donated: one copy), so XLA counts it
    with the batch arguments, not the temporaries; the prefill (a fill: its output state at
    the fill's capacity, not the full one), the decode loop (an advance) and the first
    compaction (the state and its compacted copy, beside the parameters it does not take but
    the devices keep) are executables of their own, and the largest of the three is the peak.
    A call whose
    rows all fit the slots and end within one chunk runs as one executable
    (`engine.generate.runs_at_once`): both phases' buffers and the cache are its temporaries;
  * logits (train): the head's phase of the backward pass, before the layers' (the peak is
    the larger of the two phases, `MemoryBreakdown.temporaries`): fp32 logits over the
    (tensor-sharded) vocabulary, kept for the backward pass, and their gradient (the readout
    reduces the log-softmax over the vocabulary as it goes), of one micro-batch, and the head
    weight's gradient: a loop of micro-batches runs one at a time, and over a pipeline's
    output the head runs one micro-batch's rows at a time and recomputes them in the backward
    pass (`engine.inference.readout_in_chunks`; inference's head likewise runs one streamed
    piece at a time, and an accelerator's log-probs one row chunk of at most 1 GiB of logits,
    `engine.inference.head_row_chunks`);
  * gathered: a layer's largest weight matrix sliced out of the scanned stack or all-gathered
    over fsdp, and with fsdp the LM head's table; after a pipeline, an fp32 copy of the head's
    weight (bf16 parameters, `_head_copy_bytes`);
  * pipelines (p > 1): a stage holds 1/p of the layers' parameters, state and gradients (the
    embedding and head whole, `ModelProfile.shard_bytes`) and of what they save for the
    backward pass, but for every iteration of the schedule: the runtime's GPipe loop keeps
    them for all M + p - 1 (bubble iterations compute on filler), or with stage
    rematerialisation only every iteration's stage input; a train step's stages also hold
    all M micro-batches' activations (one buffer, each micro-batch's input replaced by its
    output) and the embedding's output they are split from (`_stage_buffers`). A generate or inference MFC with M
    micro-batches runs as M executor calls on slices of the batch, each streamed through the
    pipeline in gcd(M, slice rows) pieces (`streamed_micro_batches`): a call holds one
    slice's stage buffers and KV cache, a layer works on one piece. On XLA:CPU a stage of
    several layers holds a copy of its weights (`stage_weight_copy_bytes`).

A plan (`plan_memory`) adds what other models keep on the same devices while the MFC runs,
following the runtime (`dataflow.runtime.ModelRuntime`): a trained model's parameters and
optimizer state stay on its home layout (its train_step's), unless `offload_trainable` sends
them to host memory while other models run (where its devices run other models' calls; its
own calls then hold its parameters, its train step the optimizer state too); a frozen model's parameters stay on
the layout of its first call unless the experiment offloads frozen models; a copy on another
layout lives from the first to the last call that uses it within a step. Making a copy is a
peak of its own (`plan/moves.py`): both layouts and the reshard programs' buffers, beside what
the devices keep.

`compare_with_compiled` lines an estimate up against `compiled.memory_analysis()`.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable

import numpy as np

from jaxrlhf.engine.decoding import config_records_routes, decodes_layer_by_layer
from jaxrlhf.engine.generate import runs_at_once
from jaxrlhf.engine.inference import head_row_chunks
from jaxrlhf.engine.rollout.scheduler import smaller_sizes
from jaxrlhf.engine.rollout.state import capacity_for
from jaxrlhf.engine.rollout.targets import send_width
from jaxrlhf.mfc import MFC, Call, Role
from jaxrlhf.models import attention, mixed_cache
from jaxrlhf.models.attention import AttentionImpl
from jaxrlhf.models.config import HeadKind, ModelConfig, RematPolicy
from jaxrlhf.parallel.layout import Platform
from jaxrlhf.parallel.pipeline import remats_stages
from jaxrlhf.plan.choice import CallChoice, ExecutionPlan
from jaxrlhf.plan.cluster import Cluster
from jaxrlhf.plan.experiment import Experiment, Workload
from jaxrlhf.plan.expert_memory import (block_weight_copy_bytes, decode_expert_copy_bytes,
                                        expert_order_bytes, projections_gathered)
from jaxrlhf.plan.moves import MoveMemory, holds_home_shards, move_memory
from jaxrlhf.plan.profile import ModelProfile
from jaxrlhf.plan.train_memory import (gradient_phases, gradient_sum_bytes, train_state_bytes,
                                       zero1_step_heap_bytes)

_GIB = 1 << 30


@dataclasses.dataclass(frozen=True)
class MemoryBreakdown:
    """Bytes per device of one MFC, by kind (see the module docstring)."""

    params: int = 0
    optimizer: int = 0
    grads: int = 0
    activations: int = 0
    kv_cache: int = 0
    logits: int = 0
    gathered: int = 0
    state: int = 0
    step: int = 0  # a TPU train step's gradients after its backward pass (`gradient_phases`)
    carried: int = 0  # a loop's fp32 gradient sum, beside every phase (`gradient_sum_bytes`)

    @property
    def arguments(self) -> int:
        """What the compiled call takes as inputs (besides the batch)."""
        return self.params + self.optimizer

    @property
    def temporaries(self) -> int:
        """Activations and cache, plus the larger of a train step's two backward phases: the
        head's (logits) runs first, and its buffers are freed before the layers' gradients
        and weight slices are formed (`grads`, `gathered`; inference and generation have no
        logits term), both beside a loop's gradient sum (`carried`); or, larger, a TPU train
        step's optimizer phase after the backward pass, its activations freed (`step`)."""
        backward = self.activations + self.kv_cache + self.carried + max(
            self.logits, self.grads + self.gathered)
        return max(backward, self.step)

    @property
    def total(self) -> int:
        return self.arguments + self.state + self.temporaries

    def describe(self) -> str:
        parts = [(f.name, getattr(self, f.name)) for f in dataclasses.fields(self)]
        return ", ".join(f"{name} {value / _GIB:.2f} GiB" for name, value in parts if value)


def _sharded(dim: int, ways: int) -> float:
    """A dimension split `ways` ways, or whole when `ways` does not divide it (as the layout)."""
    return dim / ways if dim % ways == 0 else dim


def layer_working_bytes(p: ModelProfile, tokens: int, context: int, tensor: int,
                        expert: int = 1) -> float:
    """One decoder layer's forward live set for `tokens` local tokens over `context` slots
    (`expert`: the expert-parallel degree, `_mlp_bytes`)."""
    c, a = p.config, p.act_itemsize
    per_token = a * (6 * c.hidden_size + 2 * _sharded(p.attn_dim, tensor)
                     + 2 * _sharded(p.kv_dim, tensor)) + _mlp_bytes(p, tensor, 4, 2, 3, expert)
    norms = 2 * 4 * c.hidden_size  # fp32 RMSNorm intermediates
    # fp32 scores, their fp32 softmax and the probabilities cast to the compute dtype.
    scores = _sharded(c.num_heads, tensor) * context * (4 + 4 + a)
    return tokens * (per_token + norms + scores)


def saved_activation_bytes(p: ModelProfile, tokens: int, context: int, tensor: int,
                           expert: int = 1) -> float:
    """What all layers keep for the backward pass under the model's remat policy."""
    c, a = p.config, p.act_itemsize
    match c.remat:
        case RematPolicy.NONE:
            per_layer = layer_working_bytes(p, tokens, context, tensor, expert)
        case RematPolicy.DOTS:  # matmul outputs without batch dims, plus the layer input
            per_layer = tokens * (a * (3 * c.hidden_size + _sharded(p.attn_dim, tensor)
                                       + 2 * _sharded(p.kv_dim, tensor))
                                  + _mlp_bytes(p, tensor, 2, 1, 1, expert))
        case RematPolicy.FULL:
            per_layer = tokens * a * c.hidden_size
    return c.num_layers * per_layer


def forward_peak_bytes(p: ModelProfile, tokens: int, context: int, tensor: int,
                       expert: int = 1, platform: Platform | None = None) -> float:
    """Peak live bytes of one layer's forward pass when nothing is kept for a backward pass:
    the attention half or the MLP half, whichever is bigger (XLA frees each as it goes). The MLP
    peaks while the gate·up product is written: the residual, gate, up and their product;
    a sparse block on `platform`'s blocked grouped matmuls with each block's weight copy too
    (`block_weight_copy_bytes`; None leaves it out: generation's calls, not measured)."""
    c, a = p.config, p.act_itemsize
    copies = block_weight_copy_bytes(p, tokens, tensor, expert, platform) / max(tokens, 1)
    norms = 4 * c.hidden_size
    attention = (norms + a * (2 * c.hidden_size + 2 * _sharded(p.attn_dim, tensor)
                              + 2 * _sharded(p.kv_dim, tensor))
                 + _sharded(c.num_heads, tensor) * context * (4 + 4 + a))
    mlp = a * c.hidden_size + _mlp_bytes(p, tensor, 3, 1, 2, expert, exchange_apart=True,
                                         block_copies=copies)
    return tokens * max(attention, mlp)


def _mlp_bytes(p: ModelProfile, tensor: int, widths: int, rows: int, router: int,
               expert: int = 1, exchange_apart: bool = False,
               block_copies: float = 0) -> float:
    """Bytes per token of `widths` hidden-width arrays of the feed-forward block: a dense MLP's
    [tokens, I/t]; a sparse block's [T*k, F] rows of its grouped matmuls (F as the rules cut
    the experts, `ModelProfile.expert_tensor_ways`), beside `rows` arrays of the T*k rows at
    model width (the tokens gathered in expert order, the experts' outputs) and `router` fp32
    [T, E] arrays (the router's logits, its softmax). With e > 1 expert ranks the grouped
    matmuls run over the e·T·k rows of the static all-to-all buffers, and the send, receive
    and return buffers hold e·T·k rows at model width (`models.expert_parallel`). A mixed
    model's layers hold either block: the larger counts.

    `exchange_apart` (a forward pass that keeps nothing for a backward one): XLA frees each
    buffer once it is read, so the exchange and the grouped matmuls peak apart: the larger of
    the matmuls' arrays and an exchange's, the T·k rows in expert order beside the send and
    receive buffers (or the return exchange's pair), (2e + 1)·T·k rows at model width: where
    XLA's heap peaks in Qwen3-30B-A3B's inference on e2f16 and d4e4f2 of a v5p-64.
    `block_copies`: bytes per token of the experts' weights copied per block, live beside the
    grouped matmuls' arrays (`block_weight_copy_bytes`)."""
    c, a = p.config, p.act_itemsize
    dense = widths * _sharded(c.intermediate_size, tensor) * a
    m = c.moe
    if m is None:
        return dense
    width = m.expert_intermediate_size / p.expert_tensor_ways(tensor)
    buffers = 3 if expert > 1 else 0
    matmuls = expert * m.top_k * a * (widths * width + rows * c.hidden_size) + block_copies
    if exchange_apart:
        held = max(matmuls, expert_order_bytes(p, expert))
        if expert > 1:
            held = max(held, m.top_k * a * (2 * expert + 1) * c.hidden_size)
    else:
        held = matmuls + expert * m.top_k * a * buffers * c.hidden_size
    sparse = held + router * 4 * m.num_experts
    return max(sparse, dense) if m.mixed else sparse


def _logit_bytes(p: ModelProfile, tokens: int, tensor: int, copies: int) -> float:
    width = _sharded(p.out_dim, tensor) if p.config.head is HeadKind.LM else 1
    return tokens * width * 4 * copies


def _head_backward_bytes(p: ModelProfile, tokens: int, tensor: int) -> float:
    """The head's phase of a train step's backward pass over `tokens` local tokens: fp32
    logits and their gradient (`_logit_bytes`), and the head weight's fp32 gradient twice (a
    micro-batch's or chunk's and the sum it is added to). The layers' gradients are not yet
    formed (`MemoryBreakdown.temporaries`). Measured on CPU devices against XLA
    (`tests/unit/test_plan_memory_terms.py`)."""
    head = 2 * 4 * p.config.hidden_size * _sharded(p.out_dim, tensor)
    return _logit_bytes(p, tokens, tensor, 2) + (head if p.config.head is HeadKind.LM else 0)


def _head_copy_bytes(p: ModelProfile, choice: CallChoice) -> int:
    """The fp32 copy of the LM head's weight a pipelined train step reads its output with, so
    the head's gradient is summed over the chunks in fp32
    (`engine.inference.readout_in_chunks`); none for fp32 parameters or a scalar head."""
    if p.config.head is not HeadKind.LM or p.param_itemsize == 4:
        return 0
    return int(4 * p.config.hidden_size * _sharded(p.out_dim, choice.tensor) / choice.fsdp)


def _gathered_bytes(p: ModelProfile, choice: CallChoice, scanned: bool) -> float:
    """Weights materialised beside the parameters while a layer runs.

    A layer's weight matrix is copied out of the scanned layer stack (`scanned`: XLA
    materialises the dynamic slice) or all-gathered over fsdp just before its matmul and freed
    after it, so at the peak one matrix is live: the largest, an MLP projection (and its cast
    to the compute dtype); in a sparse block, one projection of all its experts [E, D, F]
    (or all three, `projections_gathered`).
    With fsdp the LM head's table is gathered too, early, and held through the layers.
    """
    c = p.config
    matrix = c.hidden_size * _sharded(c.intermediate_size, choice.tensor)
    if c.moe is not None:  # a sparse block's projection holds all E experts [E, D, F]
        experts = c.moe.num_experts * c.hidden_size * c.moe.expert_intermediate_size
        experts //= p.expert_tensor_ways(choice.tensor) * choice.expert
        experts *= projections_gathered(p, choice)
        matrix = max(matrix, experts) if c.moe.mixed else experts
    live = matrix * p.param_itemsize if (scanned or choice.fsdp > 1) else 0
    cast = matrix * p.act_itemsize if p.act_itemsize != p.param_itemsize else 0
    head = 0
    if choice.fsdp > 1 and c.head is HeadKind.LM:
        head = c.hidden_size * _sharded(p.out_dim, choice.tensor) * p.param_itemsize
    return live + cast + head


def _fill_peak(fill: float, fill_state: float, fresh_cache: float) -> float:
    """A fill's bytes beside the parameters: the fresh cache its prompts are prefilled into
    (`fresh_cache`, live through the layers) beside the larger of the layers' working set
    (the rest of `fill`) and its output, the slots' state at the fill's capacity (P +
    `capacity_for(1, N)` slots, `fill_state`), which the last step writes after the layers'
    buffers are freed: XLA:TPU lays those out in the output's space (ppo_7b's fill on d4t2 of
    a v5p-16: 8.0 GiB of fresh cache and 8.5 of temporaries beside the 8.2 GiB state)."""
    return fresh_cache + max(fill - fresh_cache, fill_state)


def _tpu_decode_copies(p: ModelProfile, state: float, tensor: int, platform: Platform) -> float:
    """What XLA:TPU's decode chunk on the scanned stack holds beside its state: one layer's
    keys and values transposed for the splash kernel ([S, k, P + C, d], 1/L of the state) and
    the stacked q, k and v projections [L, D, ...] copied into the token loop's layout (Llama-3
    7B's shape with 4 layers on d2t2 of a v5p-8: 512 MiB and 64 + 2 x 16 MiB). Measured on
    TPU only."""
    if platform is not Platform.TPU:
        return 0.0
    c = p.config
    projections = c.num_layers * c.hidden_size * (
        _sharded(p.attn_dim, tensor) + 2 * _sharded(p.kv_dim, tensor)) * p.param_itemsize
    return state / c.num_layers + projections


def _compaction_peak(p: ModelProfile, rows: int, dp: int, state: float) -> float:
    """The rollout engine's first compaction (`rollout.programs.compact`), which takes the
    state, not the parameters: the state, its compacted copy (`smaller_sizes`' largest) and,
    a layer at a time, the rows in flight between the data-parallel devices: the send buffer
    and the all-to-all's receive buffer, each dp x `send_width` rows of one layer's keys or
    values. (ppo_7b on d4t2 of a v5p-16: 16 GiB of state, 12 compacted and 1.4 of
    temporaries, beside 7.5 GiB of parameters, the program XLA puts highest.) The parameters
    are not its arguments, so XLA's peak leaves them out, but they stay on the devices
    (`calibration.aot.resident_bytes` adds them to XLA's figure). `rows`: the slots a device
    holds."""
    smaller = smaller_sizes(rows * dp, dp)
    if not smaller:
        return 0.0
    per_row = state / rows
    in_flight = 2 * dp * send_width(rows, dp) * per_row / (2 * p.config.num_layers)
    return state + smaller[0] // dp * per_row + in_flight


def stage_weight_copy_bytes(p: ModelProfile, call: Call, choice: CallChoice, cpu: bool) -> int:
    """The copy of a stage's layer weights (and, training, of their gradients) a pipelined
    call holds on XLA:CPU.

    `parallel.pipeline` views the layer stack [L, ...] as [S, L/S, ...] and vmaps each stage's
    scan over its L/S layers; the batched scan reads its layers from a transposed [L/S, S, ...]
    view, which XLA:CPU materialises (a copy of the stage's weights; its gradients come back
    through the same transpose). With one layer per stage the transpose is a bitcast. Measured
    on CPU devices only, so priced only there."""
    per_stage = p.config.num_layers // choice.pipeline
    if not cpu or choice.pipeline == 1 or per_stage == 1:
        return 0
    copies = 2 if call is Call.TRAIN_STEP else 1
    return copies * per_stage * p.layer_shard_bytes(choice.tensor) // choice.fsdp


def _stage_buffers(p: ModelProfile, choice: CallChoice, tokens: int) -> float:
    """The activations of the `tokens` one jit call streams through a pipeline, all its
    micro-batches together, twice (0 without a pipeline): the buffer that carries them through
    the schedule (`parallel.pipeline.Pipeline`: each micro-batch's output takes its input's
    place) and, at the start, the embedding's output it is split from. XLA:GPU holds both at a
    pipelined train step's peak (ReaL's heuristic 7B critic on d4p4t8@64 of H100s), beside the
    saved stage inputs and, not priced here, the zero-filled gradient buffer of the head's
    backward loop, which it allocates at the program's start."""
    if choice.pipeline == 1:
        return 0.0
    return 2 * tokens * p.config.hidden_size * p.act_itemsize


def streamed_micro_batches(work: Workload, call: Call, choice: CallChoice) -> int:
    """Micro-batches one jit call of a pipelined generate or inference MFC streams.

    The executor runs such an MFC as `choice.micro_batches` = M sequential calls on strided
    slices of the batch (`dataflow.executors.in_micro_batches`), and the layout's pipeline
    streams M micro-batches of each slice again, or gcd(M, the slice's rows on each
    data-parallel device) when M does not divide them (`parallel.pipeline.Pipeline.num_micro`):
    the batch is split twice, M·gcd ways."""
    return math.gcd(choice.micro_batches,
                    work.rows_per_device(call, choice.dp_size, choice.micro_batches))


def pipelined_saved_bytes(p: ModelProfile, choice: CallChoice, tokens: int, context: int,
                           remat_stages: bool) -> float:
    """What a stage keeps for its backward pass over the schedule's M + p - 1 iterations
    (bubble ones included): GPipe keeps every iteration's saved activations of its L/p layers;
    with `remat_stages` (`parallel.pipeline.Pipeline.remat_stages`) only every iteration's
    stage input, plus one stage's saved activations while it recomputes one micro-batch."""
    stages = choice.pipeline
    per_stage = saved_activation_bytes(p, tokens, context, choice.tensor, choice.expert) / stages
    if stages == 1:
        return per_stage
    iterations = choice.micro_batches + stages - 1
    if not remat_stages:
        return per_stage * iterations
    return iterations * tokens * p.config.hidden_size * p.act_itemsize + per_stage


def scores_live(config: ModelConfig, platform: Platform, pipelined: bool) -> bool:
    """Whether a layer's attention holds its fp32 [heads, query, slot] scores on `platform`:
    XLA's einsums do (`attention=xla`, and `auto` on a CPU); the flash kernels stream them a
    block at a time: Pallas (`auto` on a TPU, `kernels/tpu_attention.py`) and cuDNN (`auto` on
    a GPU) where it takes the shapes, which is never inside a pipeline's stages
    (`models.attention.cudnn_fallback_reason`)."""
    match attention.resolve_impl(config.attention, platform.value):
        case AttentionImpl.PALLAS:
            return False
        case AttentionImpl.CUDNN:
            return pipelined or attention.cudnn_shape_reason(config.dtype,
                                                             config.head_dim) is not None
    return True


def call_memory(p: ModelProfile, call: Call, work: Workload, choice: CallChoice,
                fp32_master: bool = False, remat_stages: bool | None = None,
                platform: Platform = Platform.GPU) -> MemoryBreakdown:
    """Bytes per device of one MFC on its own (its own model's parameters included);
    `remat_stages` prices a pipeline that checkpoints each stage or not (train_step only;
    None: as the runtime does, `parallel.pipeline.remats_stages`); `platform`: the devices'
    backend (`Cluster.platform`)."""
    if remat_stages is None:
        remat_stages = remats_stages(p.config.remat)
    rows = work.rows_per_device(call, choice.dp_size, choice.micro_batches)
    s, t, stages, e = work.seq_len, choice.tensor, choice.pipeline, choice.expert
    # The slots whose attention scores a layer holds: all of them where attention writes its
    # [heads, query, slot] scores, none under a kernel that streams them (`scores_live`).
    span = (lambda n: n) if scores_live(p.config, platform, stages > 1) else (lambda n: 0)
    params = p.shard_bytes(t, choice.fsdp, stages, choice.expert)
    # Generation decodes with a stack of its own whatever the config says
    # (`engine.decoding.decode_model`): layer by layer where `decodes_layer_by_layer` says so,
    # on the layer weights sliced out of their stacks once per call (a copy held through the
    # call, no per-layer slice copy), else scanned.
    by_layer = call is Call.GENERATE and decodes_layer_by_layer(
        platform, stages > 1, choice.fsdp, config_records_routes(p.config))
    scanned = (p.config.scan_layers or call is Call.GENERATE) and not by_layer
    gathered = int(_gathered_bytes(p, choice, scanned)) + stage_weight_copy_bytes(
        p, call, choice, platform is Platform.CPU)
    if by_layer:
        gathered += p.config.num_layers * p.layer_shard_bytes(t)
    match call:
        case Call.TRAIN_STEP:  # packed rows (`engine.packing`)
            tokens = work.packed_tokens_per_device(call, choice.dp_size, choice.micro_batches,
                                                   stages)
            params, optimizer = train_state_bytes(p, choice, fp32_master)
            # A pipeline streams all micro-batches through one forward and its stages hold
            # them all; the head (logits, their log-softmax and its gradient) then runs over
            # its output one micro-batch at a time, recomputed in the backward pass
            # (`engine.inference.readout_in_chunks`): one micro-batch's logits, as a loop.
            if stages > 1:
                gathered += _head_copy_bytes(p, choice)
            saved = pipelined_saved_bytes(p, choice, tokens, span(s), remat_stages)
            activations = (saved + layer_working_bytes(p, tokens, span(s), t, e)
                           + _stage_buffers(p, choice, tokens * choice.micro_batches))
            grads, step = gradient_phases(p, choice, t, stages, platform)
            step += zero1_step_heap_bytes(p, choice, saved, platform)
            return MemoryBreakdown(
                params=params, optimizer=optimizer, grads=grads, step=step,
                carried=gradient_sum_bytes(p, choice, t, stages, platform),
                activations=int(activations), logits=int(_head_backward_bytes(p, tokens, t)),
                gathered=gathered)
        case Call.INFERENCE:  # the layers, then the head: the larger phase is the peak
            # One of the executor's calls (a micro-batch); a pipeline streams it in pieces.
            tokens = work.packed_tokens_per_device(call, choice.dp_size, choice.micro_batches,
                                                   stages)
            # The head runs over the pipeline's output in the same pieces, and on an
            # accelerator in row chunks of bounded logits (`engine.inference.head_row_chunks`).
            piece = tokens / (streamed_micro_batches(work, call, choice) if stages > 1 else 1)
            head_piece = piece
            if stages == 1 and platform is not Platform.CPU and p.config.head is HeadKind.LM:
                vocab = int(_sharded(p.out_dim, t))
                head_piece = piece / head_row_chunks(max(1, round(piece / s)), s, vocab)
            peak = max(forward_peak_bytes(p, piece, span(s), t, e, platform),
                       _logit_bytes(p, head_piece, t, 2))
            return MemoryBreakdown(params=params, gathered=gathered,
                                   activations=int(peak + _stage_buffers(p, choice, tokens)))
        case Call.GENERATE if stages == 1:  # the rollout engine (`engine.rollout`)
            kv_per_token = p.kv_bytes_per_token() / t
            prompts = work.prompts_per_device(choice.dp_size, choice.micro_batches)
            tokens = prompts * work.prompt_len
            # A fill prefills each distinct prompt once into a fresh cache of their own (then
            # into the rows' slots) on the scanned stack, one layer's weights sliced at a time;
            # an advance runs the token loop on the weights held `gathered`.
            fill = (max(forward_peak_bytes(p, tokens, span(work.prompt_len), t, e),
                        _logit_bytes(p, prompts, t, 1)) + tokens * kv_per_token
                    + _gathered_bytes(p, choice, scanned=True))
            advance = (forward_peak_bytes(p, rows, span(s), t, e) + _logit_bytes(p, rows, t, 2)
                       + gathered + decode_expert_copy_bytes(p, choice, platform, by_layer))
            # The slots' cache: a sliding layer's holds its window alone in the layer-by-layer
            # state, and in the stacked one where every layer slides (Mistral) or the layers
            # differ (Gemma 3: its sliding layers' stack apart, `models.mixed_cache`); only a
            # model with experts whose layers differ keeps every slot there (`rollout.state`).
            windowed = (by_layer or not p.config.layers_differ
                        or mixed_cache.splits_cache(p.config))
            state = int(rows * p.kv_cache_bytes(s, windowed=windowed) / t)
            if runs_at_once(choice.micro_batches, work.new_tokens):
                # One executable fills and decodes (the main job's short calls): XLA keeps the
                # fill's buffers beside the advance's, and the slots' cache is one of its
                # temporaries, not a donated argument.
                return MemoryBreakdown(params=params, gathered=gathered,
                                       activations=int(fill + advance + state - gathered))
            fill_state = rows * p.kv_cache_bytes(
                work.prompt_len + capacity_for(1, work.new_tokens), windowed=windowed) / t
            peak = max(_fill_peak(fill, fill_state, tokens * kv_per_token),
                       state + advance + (0 if by_layer else _tpu_decode_copies(
                           p, state, t, platform)),
                       _compaction_peak(p, rows, choice.dp_size, state))
            return MemoryBreakdown(params=params, activations=int(peak - state - gathered),
                                   gathered=gathered, state=state)
        case Call.GENERATE:  # a pipeline's static batch, one executor call per micro-batch
            # Pipelined decoding keeps every row of the call in flight, each stage its layers'
            # cache; the prefill streams the call's rows in pieces (the decode steps are far
            # smaller).
            kv = rows * s * p.kv_bytes_per_token() / (t * stages)
            tokens = rows * work.prompt_len
            piece = tokens / streamed_micro_batches(work, call, choice)
            peak = (max(forward_peak_bytes(p, piece, span(s), t, e), _logit_bytes(p, rows, t, 1))
                    + _stage_buffers(p, choice, tokens))
            # The layer scan reads the cache as its input and writes the new cache as its
            # output: a second copy lives through every pass.
            return MemoryBreakdown(params=params, activations=int(peak + kv), kv_cache=int(kv),
                                   gathered=gathered)
    raise ValueError(f"unknown call kind {call}")


@dataclasses.dataclass(frozen=True)
class DoesNotFit:
    """An MFC whose peak on some device exceeds the usable memory."""

    mfc: str
    device: int
    needed: int
    available: int
    own: MemoryBreakdown
    others: int  # bytes other models (and other copies) keep on that device meanwhile

    def __str__(self) -> str:
        return (f"MFC {self.mfc} does not fit on device {self.device}: needs "
                f"{self.needed / _GIB:.2f} GiB ({self.own.describe()}; other models resident "
                f"{self.others / _GIB:.2f} GiB) but {self.available / _GIB:.2f} GiB are usable")


@dataclasses.dataclass(frozen=True)
class MoveDoesNotFit:
    """A parameter move (before call `mfc`) whose peak on some device exceeds the usable
    memory."""

    mfc: str
    role: str
    layout: str
    device: int
    needed: int
    available: int
    move: MoveMemory

    def __str__(self) -> str:
        m = self.move
        return (f"moving {self.role}'s parameters to {self.layout} for MFC {self.mfc} does not "
                f"fit on device {self.device}: needs {self.needed / _GIB:.2f} GiB (source "
                f"{m.source / _GIB:.2f}, destination {m.destination / _GIB:.2f}, buffers "
                f"{m.temporaries / _GIB:.2f} GiB, beside what stays) but "
                f"{self.available / _GIB:.2f} GiB are usable")


@dataclasses.dataclass(frozen=True)
class PlanMemory:
    """Peak bytes per device of every MFC in a plan and of every parameter move, and those
    that do not fit."""

    peak: dict[str, int]
    violations: tuple[DoesNotFit | MoveDoesNotFit, ...]
    # the peak of making each parameter copy, by the MFC it is made for (`move_memory`)
    moves: dict[str, int] = dataclasses.field(default_factory=dict)

    @property
    def fits(self) -> bool:
        return not self.violations


def own_memory(experiment: Experiment, mfc: MFC, choice: CallChoice,
               platform: Platform = Platform.GPU) -> MemoryBreakdown:
    p = experiment.profile(mfc.role)
    return call_memory(p, mfc.call, experiment.workload, choice, experiment.master(mfc.role),
                       platform=platform)


def _resident(experiment: Experiment, plan: ExecutionPlan, role: Role,
              offloads_state: bool = False) -> tuple[CallChoice, int]:
    """(home layout, bytes per device) a role keeps between calls; 0 bytes when offloaded (a
    trained model that offloads its state brings it back for its own calls only)."""
    home = plan[experiment.home_mfc(role)]
    p = experiment.profile(role)
    if experiment.trainable(role):
        if offloads_state:
            return home, 0
        return home, sum(train_state_bytes(p, home, experiment.master(role)))
    if experiment.offload_frozen:
        return home, 0
    return home, p.shard_bytes(home.tensor, home.fsdp, home.pipeline, home.expert)


def _copy_lifetimes(experiment: Experiment, plan: ExecutionPlan, order: list[str]):
    """(role, a choice with the copy's param layout, first index, last index) of every
    non-home parameter copy."""
    spans: dict[tuple, list[int]] = {}
    first_choice = {}
    for i, name in enumerate(order):
        mfc = experiment.graph.mfc(name)
        home = plan[experiment.home_mfc(mfc.role)]
        if plan[name].param_layout != home.param_layout:
            key = (mfc.role, plan[name].param_layout)
            spans.setdefault(key, []).append(i)
            first_choice.setdefault(key, plan[name])
    return [(role, first_choice[role, layout], min(ix), max(ix))
            for (role, layout), ix in spans.items()]


def _copy_bytes(experiment: Experiment, plan: ExecutionPlan, role: Role, copy: CallChoice,
                home_bytes: int) -> int:
    """What a parameter copy on `copy`'s layout adds per device while it lives: its shard,
    less the home parameters where it holds their shards (the runtime then drops them,
    `dataflow.runtime.ModelRuntime.params_on`) and they sit on the devices (`home_bytes`)."""
    p = experiment.profile(role)
    nbytes = p.shard_bytes(copy.tensor, copy.fsdp, copy.pipeline, copy.expert)
    home = plan[experiment.home_mfc(role)]
    if home_bytes and holds_home_shards(home, copy):
        nbytes -= p.shard_bytes(home.tensor, home.fsdp, home.pipeline, home.expert)
    return nbytes


OwnMemory = Callable[[MFC, CallChoice], MemoryBreakdown]


def plan_memory(experiment: Experiment, plan: ExecutionPlan, cluster: Cluster,
                own: OwnMemory | None = None, *, offload_trainable: bool | None = None
                ) -> PlanMemory:
    """Peak bytes per device of each MFC, given everything else the plan keeps on its devices.

    Args:
      experiment, plan, cluster: what to check.
      own: (mfc, choice) -> its `call_memory` (default `own_memory`; the search passes a cache).
      offload_trainable: overrides `experiment.offload_trainable` (trained models that share
        their devices wait in host memory while other models' calls run, `dataflow.runtime`).
    """
    if offload_trainable is not None:
        experiment = dataclasses.replace(experiment, offload_trainable=offload_trainable)
    own_of = own or functools.partial(own_memory, experiment, platform=cluster.platform)
    order = [m.name for m in experiment.model_mfcs()]
    devices = {name: choice.devices for name, choice in plan.items()}
    base = np.zeros(cluster.num_devices)
    resident = {}
    for role in dict(experiment.models):
        home, nbytes = _resident(experiment, plan, role, experiment.offloads_state(role, devices))
        resident[role] = (home, nbytes)
        base[home.devices.first:home.devices.last + 1] += nbytes
    copies = _copy_lifetimes(experiment, plan, order)
    peak, violations = {}, []
    for i, name in enumerate(order):
        mfc, choice = experiment.graph.mfc(name), plan[name]
        own = own_of(mfc, choice)
        home, home_bytes = resident[mfc.role]
        # What the call itself adds: all of `own`, minus what already sits resident on home.
        extra = own.total - (own.arguments if home_bytes and choice.param_layout ==
                             home.param_layout else 0)
        others = base.copy()
        for role, copy, first, last in copies:
            if not first <= i <= last:
                continue
            # A copy that holds the home shards replaces the home parameters while it lives.
            nbytes = _copy_bytes(experiment, plan, role, copy, resident[role][1])
            if role is mfc.role and copy.param_layout == choice.param_layout:
                others[copy.devices.first:copy.devices.last + 1] -= (
                    experiment.profile(role).shard_bytes(copy.tensor, copy.fsdp, copy.pipeline, copy.expert)
                    - nbytes)  # the MFC's own params are in `extra`
            else:
                others[copy.devices.first:copy.devices.last + 1] += nbytes
        window = others[choice.devices.first:choice.devices.last + 1]
        worst = int(np.argmax(window))
        needed = int(window[worst] + extra)
        peak[name] = needed
        if needed > cluster.usable_hbm_bytes:
            violations.append(DoesNotFit(name, choice.devices.first + worst, needed,
                                         cluster.usable_hbm_bytes, own, int(window[worst])))
    moves = {}
    for role, copy, first, _ in copies:  # each copy is made before its first call runs
        name = order[first]
        needed, device, move = _move_peak(experiment, plan, base, copies, resident, role, copy,
                                          first)
        moves[name] = needed
        if needed > cluster.usable_hbm_bytes:
            violations.append(MoveDoesNotFit(name, role.value, str(copy), device, needed,
                                             cluster.usable_hbm_bytes, move))
    return PlanMemory(peak, tuple(violations), moves)


def _move_peak(experiment: Experiment, plan: ExecutionPlan, base: np.ndarray, copies: list,
               resident: dict, role: Role, copy: CallChoice, first: int
               ) -> tuple[int, int, MoveMemory]:
    """(bytes, device, the move) at the peak of moving `role`'s parameters from their home to
    the copy on `copy`'s layout, before call `first`: what the devices keep (`base`, the other
    copies alive then) and the move's buffers (`move_memory`) on the devices of either layout
    (a move between device sets forms the destination's shards on the source's devices
    first). The home parameters are resident (in `base`) unless offloaded; a copy that
    replaces them frees them chunk by chunk (`MoveMemory.peak`)."""
    home, home_bytes = resident[role]
    move = move_memory(experiment.profile(role), home, copy)
    replaces = bool(home_bytes) and holds_home_shards(home, copy)
    extra = move.peak(replaces) - (move.source if home_bytes else 0)
    held = base.copy()
    for other_role, other, start, last in copies:
        if start <= first <= last and (other_role, other.param_layout) != (role,
                                                                           copy.param_layout):
            held[other.devices.first:other.devices.last + 1] += _copy_bytes(
                experiment, plan, other_role, other, resident[other_role][1])
    lo = min(home.devices.first, copy.devices.first)
    hi = max(home.devices.last, copy.devices.last)
    window = held[lo:hi + 1]
    worst = int(np.argmax(window))
    return int(window[worst] + extra), lo + worst, move


@dataclasses.dataclass(frozen=True)
class MemoryCheck:
    """An estimate beside XLA's own accounting of the compiled call (bytes per device)."""

    estimated_arguments: int
    compiled_arguments: int
    estimated_temporaries: int
    compiled_temporaries: int

    @property
    def arguments_ratio(self) -> float:
        return self.estimated_arguments / max(self.compiled_arguments, 1)

    @property
    def temporaries_ratio(self) -> float:
        return self.estimated_temporaries / max(self.compiled_temporaries, 1)


def compare_with_compiled(estimate: MemoryBreakdown, analysis, input_bytes: int = 0
                          ) -> MemoryCheck:
    """Lines up an estimate with `compiled.memory_analysis()` (the `--validate` hook).

    Args:
      estimate: `call_memory` of the call.
      analysis: the object `jax.stages.Compiled.memory_analysis()` returns.
      input_bytes: per-device bytes of the batch arguments, which the estimate leaves out.
    """
    return MemoryCheck(
        estimated_arguments=estimate.arguments + input_bytes,
        compiled_arguments=int(analysis.argument_size_in_bytes),
        estimated_temporaries=estimate.temporaries,
        compiled_temporaries=int(analysis.temp_size_in_bytes),
    )
