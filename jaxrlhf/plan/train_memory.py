"""A train step's optimizer state and gradients, bytes per device.

The parameters' training state (`train_state_bytes`: AdamW's moments and an fp32 master, ZeRO-1
sliced over the data-parallel ranks), and the gradient trees a train step holds: on XLA:CPU
all at once beside the activations (`gradient_bytes`), on the accelerators in two phases, the
backward pass's and the optimizer step's (`gradient_phases`), with a loop of micro-batches'
fp32 sum beside every phase (`gradient_sum_bytes`) and, on XLA:TPU, what a ZeRO-1 step's heap
holds beside its step (`zero1_step_heap_bytes`). `plan/memory.py` adds them to a train step's
peak.
"""

from __future__ import annotations

from jaxrlhf.parallel.layout import Platform
from jaxrlhf.plan.choice import CallChoice
from jaxrlhf.plan.profile import ModelProfile


def train_state_bytes(p: ModelProfile, choice: CallChoice, fp32_master: bool) -> tuple[int, int]:
    """(parameter bytes, optimizer-state bytes) per device of a trained model on `choice`.

    The optimizer state is sharded over the data-parallel ranks too (ZeRO-1,
    `parallel.zero`): 1/d of it per device (exact when a dimension of every leaf divides by d,
    as in every shipped model; a leaf none of whose dimensions divides stays whole)."""
    elements = p.trained_shard_elements(choice.tensor, choice.fsdp, choice.pipeline, choice.expert)
    moment = 4 if (fp32_master or p.param_itemsize == 4) else p.param_itemsize
    optimizer = -(-elements * (2 * moment + (4 if fp32_master else 0)) // choice.data)
    return p.shard_bytes(choice.tensor, choice.fsdp, choice.pipeline, choice.expert), optimizer


def gradient_bytes(p: ModelProfile, choice: CallChoice, tensor: int, stages: int) -> int:
    """Gradient buffers per device of a train step (`engine.train_step`, `engine.microbatch`).

    Per trained element: the gradients cast to fp32 (4 bytes), beside them the backward pass's
    own in the parameter dtype when that is not fp32; over a loop of micro-batches (p = 1 and
    k > 1; a pipeline streams all k through one backward pass) the fp32 accumulator too; and
    the optimizer's update as it is formed, of which XLA keeps about half an fp32 tree live (2
    bytes: measured on CPU devices, fp32 and bf16 parameters, one and several micro-batches,
    `tests/unit/test_plan_memory_terms.py`). All whole over data parallelism: ZeRO-1 slices the
    optimizer state, not the gradients (`parallel.zero` says why).

    With bf16 parameters and a pipeline that is 2 + 4 + 2 = 8 bytes, four times the
    parameters: the backward pass's bf16 gradients (a pipeline sums them over its iterations
    in that dtype), the fp32 copy `microbatch.accumulate` casts them to (divided by the
    weight in place; XLA's buffer assignment on CPU holds both trees at the peak), which the
    global norm and the update read, and the update. None of them is a second accumulator;
    the fp32 tree could shrink to each rank's 1/d ZeRO-1 slice if the norm read the bf16
    gradients through a fused cast and the update cast its slice only (not done: ZeRO-1's
    bitwise equality keeps the gradients whole through the norm, `parallel.zero`)."""
    elements = p.trained_shard_elements(tensor, choice.fsdp, stages, choice.expert)
    loop = stages == 1 and choice.micro_batches > 1
    own_dtype = p.param_itemsize if p.param_itemsize != 4 else 0
    return elements * (4 + own_dtype + (4 if loop else 0) + 2)


def gradient_phases(p: ModelProfile, choice: CallChoice, tensor: int, stages: int,
                    platform: Platform) -> tuple[int, int]:
    """(gradient bytes beside the backward pass's activations, gradient bytes of the optimizer
    step after it) per device of a train step.

    XLA:CPU holds every gradient tree at once beside the activations (`gradient_bytes`, no
    step term). The accelerators' compilers keep the phases apart: the layer scan's backward
    pass writes the parameter-dtype gradients (fp32 ones for fp32 parameters) beside the
    saved activations (a loop's fp32 sum is beside every phase, `gradient_sum_bytes`); once the
    scan ends its saved activations are freed, and the step holds the fp32 gradients while it
    casts, divides and clips them: after a loop the sum beside the divided tree; else XLA:TPU
    beside the parameter-dtype gradients, XLA:GPU freeing each as it is cast. The update is
    formed leaf by leaf in place (no update tree). Measured by `plan --compile` against XLA's
    peaks, bf16 parameters with an fp32 master: Llama-3 7B's actor and critic on d4f2 of a
    v5p-16 and 70B's on d4f4t4 and d32t2 of a v5p-128, each within 7% (before the ZeRO-1
    step's heap terms, `zero1_step_heap_bytes`: d4f4t4 +9.0% with them); 70B's on d2p16t4 and
    d16f2t4 of 128 H100s within 8%; Llama-3.2-1B on d2f2 and on d4 with two micro-batches of
    a v5p-8 within 9% (`tests/test_plan_compile.py`)."""
    if platform is Platform.CPU:
        return gradient_bytes(p, choice, tensor, stages), 0
    elements = p.trained_shard_elements(tensor, choice.fsdp, stages, choice.expert)
    own = p.param_itemsize if p.param_itemsize != 4 else 0
    loop = stages == 1 and choice.micro_batches > 1
    # The step's second tree: a loop's sum divided into a new fp32 tree, else XLA:TPU's
    # parameter-dtype gradients.
    second = 4 if loop else own if platform is Platform.TPU else 0
    return elements * (own or 4), elements * (4 + second)


def gradient_sum_bytes(p: ModelProfile, choice: CallChoice, tensor: int, stages: int,
                       platform: Platform) -> int:
    """The fp32 sum of a loop of micro-batches' gradients (p = 1, k > 1) an accelerator's train
    step carries through every micro-batch's backward pass: live from the first micro-batch to
    the step, so beside the head's phase (its logits) as well as the layers' (their gradients),
    not only beside the latter. Measured by `plan --compile` against XLA's peaks (GiB; the
    model with the sum beside the layers' gradients only, then beside both): Qwen3-30B-A3B's
    actor on f4t2@8 of 8 H100s 80.01 (65.81, 80.03), on d4e2f4@2 of a v5p-64 88.59 (64.45,
    79.39), d4e8@4 94.91 (75.41, 81.97), d4f4t2@2 95.59 (62.25, 76.48; the rest of its gap
    is XLA:TPU's, unpriced), 8 of its layers of 64 experts on f2t2@2 of a v5p-8 20.60 (16.43,
    19.01; `tests/test_plan_compile.py`). XLA:CPU's trees are all beside the activations
    (`gradient_bytes`), so none here."""
    if platform is Platform.CPU or stages > 1 or choice.micro_batches == 1:
        return 0
    return 4 * p.trained_shard_elements(tensor, choice.fsdp, stages, choice.expert)


def zero1_step_heap_bytes(p: ModelProfile, choice: CallChoice, saved: float,
                          platform: Platform) -> int:
    """Bytes XLA:TPU's heap holds beside the optimizer phase's gradients (`gradient_phases`)
    of a ZeRO-1 train step over data parallelism (d > 1), one micro-batch, no pipeline, no
    LoRA:

    * a copy of the largest layer stack (a dense MLP projection's [L, D, I] shard in the
      parameter dtype): the backward scan's gradient accumulator of a parameter stack's shape
      takes that donated parameter's buffer, so XLA copies the stacks the scans read into
      buffers of their own, live from the program's start to the step's end (where the
      update's gathered new parameters land); the smaller stacks' copies it fits into freed
      parameter buffers. Priced in the step alone: the head phase holds it too, but its
      terms are within 2% (7B's actor on d4f2 of a v5p-16) or over (+8%, Llama-3.2-1B's on
      d2f2 of a v5p-8) without it;
    * the backward pass's `saved` activations' space, below the step's fp32 gradient stacks,
      unless it holds one of the largest (an MLP projection's) beside an attention projection's
      (`_step_fills_saved_space`): XLA's heap places the stacks best-fit in the order the step
      forms them, so the freed space first takes a few of the smaller ones (the head's, an
      attention projection's), and a largest stack that no longer fits beside them goes above,
      the space left below it.

    Read from XLA's buffer assignments (`plan --compile --explain`) of Llama-3 70B's actor on
    d8f2t4 of a v5p-128 and of 16 and 8 of its layers on d2f2t2 of a v5p-16, and 7B's critic
    on d8 of a v5p-16 (`tests/test_plan_compile.py`). Where the saved space holds a largest
    stack beside an attention one (70B's actor on d4f4t4, the saved activations 10 GiB, an
    MLP's fp32 stack 4.38 and an attention projection's 1.25: the space took two of the former
    and one of the latter; 8 of its layers on d2f2t2 with 12 and 16 rows a chip, the space
    3 and 4 GiB, the stacks 1.75 and 0.5: one and two), the step's stacks fill it and only the
    copy is held: 70B's d4f4t4 57.36 -> 47.37 GiB against XLA's 43.45. Where it does not (70B's
    d8f2t4: 10 GiB against 8.75 + 2.5; 8 layers with 4 and 8 rows: 1 and 2 GiB against
    1.75 + 0.5; 7B's actor on d4f2 of a v5p-16: 4 against 3.5 + 1), the space took none of
    the largest stacks. Without data parallelism XLA updates the donated buffers in place and
    holds neither; with LoRA the stacks are frozen arguments, not donated."""
    if (platform is not Platform.TPU or choice.data == 1 or choice.pipeline > 1
            or choice.micro_batches > 1 or p.config.lora is not None):
        return 0
    copy = p.largest_layer_leaf_bytes(choice.tensor, choice.fsdp, choice.pipeline, choice.expert)
    if _step_fills_saved_space(p, choice, saved):
        return copy
    return int(copy + saved)


def _step_fills_saved_space(p: ModelProfile, choice: CallChoice, saved: float) -> bool:
    """Whether the backward pass's `saved` activations' space (bytes per device) holds the fp32
    gradient stack of the largest layer leaf beside that of the largest attention projection
    (a layer leaf with a `heads` axis), as the layout shards them (`zero1_step_heap_bytes`)."""
    args = (choice.tensor, choice.fsdp, choice.pipeline, choice.expert)
    attention = max((b for leaf, b in zip(p.leaves, p.leaf_shard_bytes(*args))
                     if leaf.names[:1] == ("layers",) and "heads" in leaf.names), default=0)
    return saved * p.param_itemsize >= 4 * (p.largest_layer_leaf_bytes(*args) + attention)
