"""The bytes a mixture-of-experts block holds beyond its grouped matmuls, per platform.

Each term was found in XLA's buffer assignment of a compiled call (TPU through libtpu, GPU
through JAX's CUDA plugin, for described topologies) and is tested there on a small shape
(tests/test_plan_compile.py, tests/test_plan_compile_gpu.py); `plan/memory.py` adds them to a
call's peak.
"""

from __future__ import annotations

from jaxrlhf.models.grouped_experts import block_layout
from jaxrlhf.parallel.layout import Platform
from jaxrlhf.plan.choice import CallChoice
from jaxrlhf.plan.profile import ModelProfile


def expert_order_bytes(p: ModelProfile, expert: int) -> float:
    """Bytes per token while a sparse block puts its e·T·k rows at model width into expert
    order or back (a forward pass that keeps nothing, `_mlp_bytes`): the rows and their
    permuted copy. XLA holds both at `jnp.take`'s gather and the select that fills its
    out-of-range rows (`grouped_experts.experts_swiglu`), and at the scatter of the experts'
    outputs back to token order. Where t cuts each expert's width F (D > 3·F/t), this phase
    and not the grouped matmuls is the block's peak: Qwen3-30B-A3B's inference on f16t2 of a
    v5p-64, two [T·k, D] arrays of 3 GiB in XLA's buffer assignment."""
    return 2 * expert * p.config.moe.top_k * p.act_itemsize * p.config.hidden_size


def block_weight_copy_bytes(p: ModelProfile, tokens: int, tensor: int, expert: int,
                             platform: Platform | None) -> float:
    """The experts' weights a GPU's sparse block copies per block of rows: its grouped matmuls
    run blocked (`grouped_experts.blocked_grouped_matmul`, `block_layout`), each block of the
    e·T·k rows multiplied by a copy of its expert's [D, F/t] slice, and XLA:GPU gathers the
    gate, up and down copies in one fusion (the three share the blocks' expert ids), so all
    three live beside the matmuls: Qwen3-30B-A3B's log-probs on f4t2 of 8 H100s, three
    [3,200, 2048, 384] bf16 copies of 4.7 GiB; 2 layers of 16 experts on f2t2 of 4, three
    [400, 2048, 384] of 600 MiB in XLA's buffer assignment. TPUs run `ragged_dot` (no copy);
    on XLA:CPU, whose matmuls are blocked too, the copies are not measured, so not priced."""
    m = p.config.moe
    if m is None or platform is not Platform.GPU:
        return 0
    _, blocks = block_layout(int(expert * tokens * m.top_k), m.num_experts // expert)
    width = m.expert_intermediate_size / p.expert_tensor_ways(tensor)
    return 3 * blocks * p.config.hidden_size * width * p.act_itemsize


def projections_gathered(p: ModelProfile, choice: CallChoice) -> int:
    """How many of a sparse block's three expert projections are gathered at once: all three
    where fsdp cuts their embed dim and e or t runs the block in its shard_map, whose inputs
    take that dim whole (`models.expert_parallel.expert_swiglu`), so gate, up and down are
    gathered before it runs (Qwen3-30B-A3B's inference on f16t2 of a v5p-64: three
    [128, 2048, 384] bf16 slices, 604 MB in XLA's buffer assignment); else one at a time."""
    in_shard_map = choice.expert > 1 or p.expert_tensor_ways(choice.tensor) > 1
    return 3 if choice.fsdp > 1 and in_shard_map else 1


def decode_expert_copy_bytes(p: ModelProfile, choice: CallChoice, platform: Platform,
                              by_layer: bool) -> int:
    """The copy of the experts' gate and up stacks a TPU decode loop over the scanned layers
    holds, where t leaves each expert's width F/t off the 128 lanes: XLA lays those parameters
    out with their embed dim minor (no lane padding) and the grouped matmul reads them F/t
    minor, so it copies both stacks whole into that layout, F/t padded to 128, before the token
    loop (Qwen3-30B-A3B's generation on d4e2t4 of a v5p-64: two [48, 64, 2048, 192] stacks of
    3 GiB; none at F/t = 768, d8e4)."""
    m = p.config.moe
    if m is None or platform is not Platform.TPU or by_layer:
        return 0
    width = m.expert_intermediate_size // p.expert_tensor_ways(choice.tensor)
    if width % 128 == 0:
        return 0
    gate_up = 2 * p.expert_shard_bytes(choice.tensor, choice.fsdp, 1, choice.expert) // 3
    return gate_up * (-(-width // 128) * 128) // width
