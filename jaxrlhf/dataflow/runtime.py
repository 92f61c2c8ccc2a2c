"""Model runtimes: one model role's parameters across the layouts its calls run on.

A trainable model keeps its authoritative parameters and optimizer state on its *home* layout
(the layout of its train_step). A call on another layout (actor generation, say) gets a copy
made by `parallel.reshard` once per parameter version; the copy is dropped as soon as the last
call of the step that reads it has been dispatched (`done_reading`; JAX keeps the buffers alive
until that call has run), and at the latest when a train_step produces a new version. A frozen
model lives on the layout of its first call; with `offload` it waits in host memory between
calls and is brought back by the next one. A trainable model with `offload_trainable` moves its
parameters and optimizer state to host memory whenever a call of another model is about to run
on its devices (`make_room`); its own inference or generation brings back only the parameters
(dropped again after the call), its train step the whole state.

Zero-redundancy reallocation (HybridFlow's 3D-HybridEngine): where every device's shard of the
copy contains its home shard (`parallel.reshard.contains_shards`, e.g. generation on d4t2 from
training on f4t2 over the same devices), the copy is built from the home parameters, which are
then freed: while the copy lives a device holds the copy's shard alone, not both. When the copy
is dropped, or anything reads the home parameters first, they are cut back out of the copy on
each device (no communication, bitwise the same values).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping

from jaxrlhf.engine.train_step import TrainState
from jaxrlhf.mfc import MFC, Call, Role
from jaxrlhf.models.config import ModelConfig
from jaxrlhf.models.sizes import abstract_params
import jax

from jaxrlhf.parallel.reshard import (ReshardStats, contains_shards, offload_to_host, onload,
                                      reshard)
from jaxrlhf.parallel.layout import Layout


@dataclasses.dataclass
class MoveCounters:
    """Bytes and seconds spent moving parameters, cumulative."""

    realloc_bytes: int = 0
    realloc_seconds: float = 0.0
    offload_bytes: int = 0
    offload_seconds: float = 0.0

    def add(self, stats: ReshardStats, *, offload: bool) -> None:
        if offload:
            self.offload_bytes += stats.bytes_moved
            self.offload_seconds += stats.seconds
        else:
            self.realloc_bytes += stats.bytes_moved
            self.realloc_seconds += stats.seconds

    def as_dict(self) -> dict[str, float]:
        return dataclasses.asdict(self)


class ModelRuntime:
    """Parameters (and, if trainable, optimizer state) of one model role.

    Args:
      role: the model role.
      config: its architecture.
      home: the layout its parameters live on.
      params: parameters on `home`, unless `state` is given.
      state: a TrainState on `home` for a trainable model.
      offload: keep the parameters in host memory between calls (frozen models only).
      offload_trainable: a trainable model's state waits in host memory while other models'
        calls run on its devices (see `make_room`).
      readers: layout -> how many calls of one step read the parameters there; a copy on a
        layout other than home is dropped after its last reader (`done_reading`).
    """

    def __init__(self, role: Role, config: ModelConfig, home: Layout, *, params=None,
                 state: TrainState | None = None, offload: bool = False,
                 offload_trainable: bool = False, readers: Mapping[Layout, int] | None = None):
        if (params is None) == (state is None):
            raise ValueError(f"{role.value}: give exactly one of params and state")
        if offload and state is not None:
            raise ValueError(f"{role.value}: a trainable model's state stays on its devices "
                             "unless offload_trainable")
        if offload_trainable and state is None:
            raise ValueError(f"{role.value}: offload_trainable is for trained models")
        self.role, self.config, self.home = role, config, home
        self._state = state
        self._state_on_host = False  # _state lives in host memory
        self._read_params = None  # params brought back for a call while the state is on host
        self._params = params
        self._copies: dict[Layout, object] = {}
        self._home_in: Layout | None = None  # the copy the freed home parameters live in
        self._offloaded = False
        self.offload_between_calls = offload
        self.offload_trainable = offload_trainable
        self._readers = dict(readers or {})
        self._reads: dict[Layout, int] = {}
        self.counters = MoveCounters()
        self._boxed = abstract_params(config)
        self.after_call()  # an offloaded frozen model waits on host for its first call too

    @property
    def trainable(self) -> bool:
        return self._state is not None

    @property
    def on_host(self) -> bool:
        """Whether the model's parameters (and optimizer state) wait in host memory now."""
        return self._state_on_host or self._offloaded

    @property
    def state(self) -> TrainState:
        """The TrainState on the home layout (brought back whole if it waits on host)."""
        self._restore_home()
        if self._state_on_host:
            self._read_params = None
            self._state, stats = onload(self._state)
            self.counters.add(stats, offload=True)
            self._state_on_host = False
        return self._state

    @property
    def params(self):
        """Parameters on the home layout (onloaded if they were offloaded)."""
        self._restore_home()
        if self._state is not None:
            if not self._state_on_host:
                return self._state.params
            if self._read_params is None:  # the host copy stays the authoritative one
                self._read_params, stats = onload(self._state.params, free_source=False)
                self.counters.add(stats, offload=True)
            return self._read_params
        if self._offloaded:
            self._params, stats = onload(self._params)
            self.counters.add(stats, offload=True)
            self._offloaded = False
        return self._params

    def params_on(self, layout: Layout):
        """Parameters resharded to `layout`, copied once per parameter version; a copy that
        contains the home shards replaces the home parameters while it lives (module
        docstring)."""
        if layout == self.home:
            return self.params
        if layout not in self._copies:
            home, shardings = self.params, layout.param_shardings(self._boxed)
            replaces = not self.on_host and self._read_params is None and _contains(
                home, shardings)
            copy, stats = reshard(home, shardings, free_source=replaces)
            self.counters.add(stats, offload=False)
            self._copies[layout] = copy
            self._read_params = None  # the call reads the copy, not the home parameters
            if replaces:
                self._set_home_params(None)
                self._home_in = layout
        return self._copies[layout]

    def _set_home_params(self, params) -> None:
        if self._state is not None:
            self._state = self._state.replace(params=params)
        else:
            self._params = params

    def _restore_home(self) -> None:
        """Cuts the home parameters back out of the copy that replaced them (each device keeps
        its part of its own copy's shard; leaves whose sharding is the same are shared)."""
        if self._home_in is None:
            return
        layout, self._home_in = self._home_in, None
        params, stats = reshard(self._copies[layout], self.home.param_shardings(self._boxed))
        self.counters.add(stats, offload=False)
        self._set_home_params(params)

    def update(self, state: TrainState) -> None:
        """Installs the state a train_step returned: a new parameter version."""
        if self._state is None:
            raise ValueError(f"{self.role.value} is frozen; it has no train state")
        self._state, self._state_on_host, self._read_params = state, False, None
        self._home_in = None  # the new version replaces the parameters the copy held
        self._copies.clear()
        self._reads.clear()

    def done_reading(self, layout: Layout) -> None:
        """One call on `layout` has been dispatched: after the step's last reader of a copy,
        the copy is dropped (the generation weights once generation is under way)."""
        if layout == self.home:
            return
        self._reads[layout] = self._reads.get(layout, 0) + 1
        if self._reads[layout] >= self._readers.get(layout, 1):
            if self._home_in == layout:
                self._restore_home()
            self._copies.pop(layout, None)
            self._reads.pop(layout)

    def make_room(self) -> None:
        """Another model's call is about to run on this model's devices: with
        `offload_trainable`, the state goes to host memory (a no-op where it is already)."""
        self._read_params = None
        if self.offload_trainable and not self._state_on_host:
            self._restore_home()
            self._state, stats = offload_to_host(self._state)
            self.counters.add(stats, offload=True)
            self._state_on_host = True

    def after_call(self) -> None:
        """Frees what a call brought to the devices: a frozen model goes back to host memory
        if configured; a trainable one waiting on host drops the parameters it read."""
        self._read_params = None
        if self._state is None and self.offload_between_calls and not self._offloaded:
            self._params, stats = offload_to_host(self._params)
            self.counters.add(stats, offload=True)
            self._offloaded = True

    def drop_copies(self) -> None:
        """Releases the copies on other layouts (e.g. generation weights after generation)."""
        self._restore_home()
        self._copies.clear()
        self._reads.clear()


def _contains(params, shardings) -> bool:
    """Whether every leaf's `shardings` shard contains its current shard on each device."""
    return all(contains_shards(x.sharding, d, x.shape) for x, d in
               zip(jax.tree.leaves(params), jax.tree.leaves(shardings), strict=True))


def with_memory_policy(run: Callable, mfc: MFC, layout: Layout, runtimes: Mapping[Role, "ModelRuntime"]):
    """`run` (an MFC's executor) with the runtimes' memory policy around it: trained models
    with `offload_trainable` that share the MFC's devices make room first (and the MFC's own
    model, unless it trains: generation and inference read parameters only); afterwards the
    MFC's own model lets go of what the call read (`done_reading`, `after_call`)."""
    devices = {d.id for d in layout.devices}
    others = [rt for role, rt in runtimes.items() if role is not mfc.role
              and rt.offload_trainable and devices & {d.id for d in rt.home.devices}]
    own = runtimes[mfc.role]

    def wrapped(buf):
        for runtime in others:
            runtime.make_room()
        if mfc.call is not Call.TRAIN_STEP:  # its own inference reads parameters only
            own.make_room()
        out = run(buf)
        if mfc.call is not Call.TRAIN_STEP:
            own.done_reading(layout)
            own.after_call()
        return out

    return wrapped


def readers_per_layout(calls, layouts: Mapping[str, Layout]) -> dict[Layout, int]:
    """Layout -> how many of one model's `calls` (MFCs) read its parameters there per step."""
    out: dict[Layout, int] = {}
    for mfc in calls:
        if not mfc.host and mfc.call is not Call.TRAIN_STEP:
            out[layouts[mfc.name]] = out.get(layouts[mfc.name], 0) + 1
    return out
