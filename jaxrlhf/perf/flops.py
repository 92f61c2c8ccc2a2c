"""Model FLOPs of each MFC: what its fraction of the floor and its MFU divide (`perf.rounds`).

Model FLOPs follow the papers' convention (ReaL, Megatron): 2 FLOPs per matmul parameter per
token for a forward pass, plus QK^T and PV over the `context` slots each token attends to
(dense, as the runtime computes it); a backward pass costs two forwards, so a train step is
three. Recomputation (remat), padding and sampling work are not counted: they are overheads the
floor exists to expose.

MFU of an MFC = its model FLOPs / (its seconds x the peak of *its own* devices), the peak
measured by the matmul probe in the same process, in the same rounds (`jaxrlhf.perf.floor`,
`jaxrlhf.perf.rounds`).
"""

from __future__ import annotations

import enum

from jaxrlhf.models.config import ModelConfig
from jaxrlhf.models.sizes import matmul_params


class Passes(enum.Enum):
    """Forward passes per token of each call kind."""

    generate = 1.0
    inference = 1.0
    train_step = 3.0  # backward = 2 forwards


def forward_flops_per_token(config: ModelConfig, context: int) -> float:
    """Matmul FLOPs of one token's forward pass attending over `context` slots."""
    attention = 2 * 2 * config.num_layers * config.num_heads * config.head_dim * context
    return 2.0 * matmul_params(config) + attention


def call_flops(config: ModelConfig, call: str, rows: int, context: int,
               updates: int = 1) -> float:
    """Model FLOPs of one MFC over `rows` sequences of `context` tokens.

    Args:
      config: the model.
      call: "generate", "inference" or "train_step".
      rows: sequences in the global batch.
      context: prompt + response length of each sequence.
      updates: train_step only: passes over the batch (PPO epochs).
    """
    passes = Passes[call].value * (updates if call == "train_step" else 1)
    return passes * rows * context * forward_flops_per_token(config, context)
