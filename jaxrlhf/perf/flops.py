"""Model FLOPs of each MFC and the figures measured against the floor (seconds, MFU).

Model FLOPs follow the papers' convention (ReaL, Megatron): 2 FLOPs per matmul parameter per
token for a forward pass, plus QK^T and PV over the `context` slots each token attends to
(dense, as the runtime computes it); a backward pass costs two forwards, so a train step is
three. Recomputation (remat), padding and sampling work are not counted: they are overheads the
floor exists to expose.

MFU of an MFC = its model FLOPs / (its seconds x the peak of *its own* devices). The peak is
the probe measured in the same process (`jaxrlhf.perf.floor`); if an MFC ever runs faster than
that probe, the probe was wrong and the peak used is raised to the MFC's rate (and flagged), so
MFU is at most 1 by construction. `with_peak_no_call_beat` applies the same correction to the
floor of every row of one run, so the fraction of the floor is at most 1 too.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Sequence

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


@dataclasses.dataclass(frozen=True)
class Figures:
    """One MFC's (or one step's) measured seconds against its floor.

    Attributes:
      name: the MFC name, or "step".
      seconds: median measured wall seconds.
      flops: model FLOPs.
      devices: devices the MFC runs on.
      peak: measured matmul FLOP/s of those devices (the probe).
      machine_peak: measured matmul FLOP/s of the whole machine (the floor's denominator).
    """

    name: str
    seconds: float
    flops: float
    devices: int
    peak: float
    machine_peak: float

    @property
    def floor_seconds(self) -> float:
        """The work at the machine's measured peak."""
        return self.flops / self.machine_peak

    @property
    def fraction_of_floor(self) -> float:
        """floor seconds / measured seconds (1 = at the floor)."""
        return self.floor_seconds / self.seconds

    @property
    def rate(self) -> float:
        return self.flops / self.seconds

    @property
    def peak_used(self) -> float:
        """The probe's peak, raised to the achieved rate if the probe underestimated it."""
        return max(self.peak, self.rate)

    @property
    def peak_raised(self) -> bool:
        return self.rate > self.peak

    @property
    def mfu(self) -> float:
        """Model FLOPs utilisation of this MFC's own devices; <= 1 by construction."""
        return self.rate / self.peak_used

    def as_dict(self) -> dict[str, float | int | bool]:
        return {
            "seconds": self.seconds, "gflops": self.flops / 1e9,
            "floor_seconds": self.floor_seconds, "fraction_of_floor": self.fraction_of_floor,
            "mfu": self.mfu, "devices": self.devices,
        }


def with_peak_no_call_beat(rows: Sequence[Figures]) -> tuple[list[Figures], float]:
    """The rows of one run on one consistent peak, and the factor the probe was raised by.

    A call that runs faster than the probe said its devices can proves that the probe was slowed
    (by other load while it ran, say): the devices' true peak is at least that call's rate. All
    rows then scale their peaks, the machine's too, by the largest such ratio (1 when no call beat
    the probe), so every row's MFU and fraction of the floor are at most 1.
    """
    factor = max([1.0, *(f.rate / f.peak for f in rows)])
    scaled = [dataclasses.replace(f, peak=f.peak * factor, machine_peak=f.machine_peak * factor)
              for f in rows]
    return scaled, factor
