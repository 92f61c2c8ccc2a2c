"""What the planner plans: the dataflow graph, each role's model, and the per-step workload.

A run's `Experiment` comes from its spec (`jaxrlhf.spec.RunSpec.experiment`): the planner never
reads a config. Benchmarks measure like the papers (generation forced to max length), so the
workload is the maximum shapes.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping

from jaxrlhf.dataflow.graph import DataflowGraph
from jaxrlhf.mfc import MFC, Call, Role
from jaxrlhf.models.config import ModelConfig
# The runtime's decode schedules (re-exported: the planner prices them).
from jaxrlhf.parallel.pipeline import DEFAULT_DECODE, DecodeSchedule  # noqa: F401
from jaxrlhf.parallel.strategy import DeviceRange
from jaxrlhf.plan.profile import ModelProfile, profile_of


@dataclasses.dataclass(frozen=True)
class Workload:
    """Shapes of one RL step.

    Attributes:
      batch_size: sequences per step (prompts × responses per prompt).
      prompt_len: prompt slots per sequence.
      new_tokens: generated slots per sequence (generation runs to this length).
      mini_batches: slices of the batch, one optimizer update each, per epoch; a train_step
        MFC makes `updates` = epochs × mini_batches updates on batch_size / mini_batches rows.
      epochs: passes over the batch per train_step MFC.
      mean_new_tokens: the responses' mean length, when shorter than `new_tokens` (None: every
        response runs to `new_tokens`, as benchmarks force it). Train steps and inference pack
        sequences into rows (`engine.packing`), so they compute on the tokens, not the slots.
      group_size: responses per prompt (a GRPO group's n rows share one prompt, which the
        rollout engine prefills once: `prompts_per_device`).
    """

    batch_size: int
    prompt_len: int
    new_tokens: int
    mini_batches: int = 1
    epochs: int = 1
    mean_new_tokens: float | None = None
    group_size: int = 1

    def __post_init__(self):
        if self.batch_size % self.mini_batches:
            raise ValueError(f"mini_batches={self.mini_batches} does not divide the batch of "
                             f"{self.batch_size} sequences")
        if self.batch_size % self.group_size:
            raise ValueError(f"group_size={self.group_size} does not divide the batch of "
                             f"{self.batch_size} sequences")

    @property
    def seq_len(self) -> int:
        return self.prompt_len + self.new_tokens

    def packed_tokens_per_device(self, call: Call, dp_size: int, micro_batches: int,
                                 pipeline: int = 1) -> int:
        """Token slots one device computes per micro-batch of a train step or inference call:
        its sequences' tokens (prompt + mean response), packed into whole rows of `seq_len`
        (at least one). A pipeline computes its rows as they come (padded)."""
        rows = self.rows_per_device(call, dp_size, micro_batches)
        if pipeline > 1 or self.mean_new_tokens is None:
            return rows * self.seq_len
        tokens = rows * (self.prompt_len + min(self.mean_new_tokens, self.new_tokens))
        return max(1, -(-int(round(tokens)) // self.seq_len)) * self.seq_len

    @property
    def updates(self) -> int:
        return self.epochs * self.mini_batches

    def rows(self, call: Call) -> int:
        """Sequences one jit call of this kind processes (one update's slice when training)."""
        return self.batch_size // self.mini_batches if call is Call.TRAIN_STEP else self.batch_size

    def rows_per_device(self, call: Call, dp_size: int, micro_batches: int) -> int:
        """Sequences one device processes per micro-batch, split over data × fsdp."""
        rows, ways = self.rows(call), dp_size * micro_batches
        if rows % ways:
            raise ValueError(f"{rows} sequences do not split over data×fsdp×micro-batches = "
                             f"{dp_size}×{micro_batches}")
        return rows // ways

    def prompts_per_device(self, dp_size: int, micro_batches: int) -> int:
        """Distinct prompts one device prefills per micro-batch of a generate call: the rollout
        engine prefills each prompt once, its group's rows spread over the devices
        (`engine.rollout.targets`), so a device prefills its share of the prompts."""
        prompts = self.batch_size // self.group_size
        return -(-prompts // (dp_size * micro_batches))


@dataclasses.dataclass(frozen=True)
class Experiment:
    """Graph + models + workload.

    Attributes:
      graph: the algorithm's dataflow graph.
      models: role -> ModelConfig for every role with a model-backed MFC.
      workload: the step's shapes.
      fp32_master: role -> whether its optimizer keeps fp32 master weights (trained roles).
      offload_frozen: frozen models wait in host memory between calls when their devices are
        shared with another model's calls.
      host_seconds: host MFC name -> its duration (rule-based rewards); 0 if absent.
      decode: the pipelined decode schedule priced: the runtime's (`parallel.pipeline`
        `DEFAULT_DECODE`, ReaL's across-token schedule) unless pricing another.
      offload_trainable: trained models whose devices hold other models' calls keep their
        parameters and optimizer state in host memory between their own calls
        (`placement.offload_trainable`, `dataflow.runtime.ModelRuntime.make_room`).
    """

    graph: DataflowGraph
    models: tuple[tuple[Role, ModelConfig], ...]
    workload: Workload
    fp32_master: tuple[tuple[Role, bool], ...] = ()
    offload_frozen: bool = False
    host_seconds: tuple[tuple[str, float], ...] = ()
    decode: DecodeSchedule = DEFAULT_DECODE
    offload_trainable: bool = False

    @classmethod
    def of(cls, graph: DataflowGraph, models: Mapping[Role, ModelConfig], workload: Workload,
           *, fp32_master: Mapping[Role, bool] | None = None, offload_frozen: bool = False,
           host_seconds: Mapping[str, float] | None = None,
           decode: DecodeSchedule = DEFAULT_DECODE,
           offload_trainable: bool = False) -> "Experiment":
        missing = [m.name for m in graph.mfcs if not m.host and m.role not in models]
        if missing:
            raise ValueError(f"no model config for the role of MFC(s) {missing}")
        return cls(graph, tuple(models.items()), workload, tuple((fp32_master or {}).items()),
                   offload_frozen, tuple((host_seconds or {}).items()), decode,
                   offload_trainable)

    def model(self, role: Role) -> ModelConfig:
        return dict(self.models)[role]

    @functools.cached_property
    def _profiles(self) -> dict[Role, ModelProfile]:
        return {role: profile_of(config) for role, config in self.models}

    def profile(self, role: Role) -> ModelProfile:
        return self._profiles[role]

    def master(self, role: Role) -> bool:
        return dict(self.fp32_master).get(role, False)

    def model_mfcs(self) -> tuple[MFC, ...]:
        """Model-backed MFCs in graph order."""
        return tuple(self.graph.mfc(n) for n in self.graph.order if not self.graph.mfc(n).host)

    @functools.cached_property
    def _trainable(self) -> dict[Role, bool]:
        return {role: any(m.call is Call.TRAIN_STEP for m in self.graph.calls_of(role))
                for role in self.graph.roles()}

    def trainable(self, role: Role) -> bool:
        return self._trainable[role]

    @functools.cached_property
    def _homes(self) -> dict[Role, str]:
        homes = {}
        for role in self.graph.roles():
            calls = [m for m in self.graph.calls_of(role) if not m.host]
            train = [m for m in calls if m.call is Call.TRAIN_STEP]
            if calls:
                homes[role] = (train or calls)[0].name
        return homes

    def home_mfc(self, role: Role) -> str:
        """The MFC whose layout holds the role's parameters: its train_step, else its first call."""
        return self._homes[role]

    def offloads_state(self, role: Role, devices: Mapping[str, DeviceRange]) -> bool:
        """Whether the trained `role` keeps its state in host memory between its calls, given
        each model MFC's devices (name -> range): with `offload_trainable`, where its calls'
        devices also run another role's calls (as `run.build.runtimes` decides)."""
        if not (self.offload_trainable and self.trainable(role)):
            return False
        mine = [devices[m.name] for m in self.graph.calls_of(role) if not m.host]
        theirs = [devices[m.name] for m in self.model_mfcs() if m.role is not role]
        return any(a.first <= b.last and b.first <= a.last for a in mine for b in theirs)

    def host_mfc_seconds(self, name: str) -> float:
        return dict(self.host_seconds).get(name, 0.0)
