"""Model runtimes: one model role's parameters across the layouts its calls run on.

A trainable model keeps its authoritative parameters and optimizer state on its *home* layout
(the layout of its train_step). A call on another layout (actor generation, say) gets a copy
made by `parallel.reshard` once per parameter version; the copy is dropped when a train_step
produces a new version, so the next step reallocates from the fresh parameters. A frozen
model lives on the layout of its first call; with `offload` it waits in host memory between
calls and is brought back by the next one.
"""

from __future__ import annotations

import dataclasses


from jaxrlhf.engine.train_step import TrainState
from jaxrlhf.mfc import Role
from jaxrlhf.models.config import ModelConfig
from jaxrlhf.models.sizes import abstract_params
from jaxrlhf.parallel.reshard import ReshardStats, offload_to_host, onload, reshard
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
    """

    def __init__(self, role: Role, config: ModelConfig, home: Layout, *, params=None,
                 state: TrainState | None = None, offload: bool = False):
        if (params is None) == (state is None):
            raise ValueError(f"{role.value}: give exactly one of params and state")
        if offload and state is not None:
            raise ValueError(f"{role.value}: a trainable model's state stays on its devices")
        self.role, self.config, self.home = role, config, home
        self.state = state
        self._params = params
        self._copies: dict[Layout, object] = {}
        self._offloaded = False
        self.offload_between_calls = offload
        self.counters = MoveCounters()
        self._boxed = abstract_params(config)

    @property
    def trainable(self) -> bool:
        return self.state is not None

    @property
    def params(self):
        """Parameters on the home layout (onloaded if they were offloaded)."""
        if self.state is not None:
            return self.state.params
        if self._offloaded:
            self._params, stats = onload(self._params)
            self.counters.add(stats, offload=True)
            self._offloaded = False
        return self._params

    def params_on(self, layout: Layout):
        """Parameters resharded to `layout`, copied once per parameter version."""
        if layout == self.home:
            return self.params
        if layout not in self._copies:
            copy, stats = reshard(self.params, layout.param_shardings(self._boxed))
            self.counters.add(stats, offload=False)
            self._copies[layout] = copy
        return self._copies[layout]

    def update(self, state: TrainState) -> None:
        """Installs the state a train_step returned: a new parameter version."""
        if self.state is None:
            raise ValueError(f"{self.role.value} is frozen; it has no train state")
        self.state = state
        self._copies.clear()

    def after_call(self) -> None:
        """Frees per-call copies of a frozen model and offloads it if configured."""
        if self.state is None and self.offload_between_calls and not self._offloaded:
            self._params, stats = offload_to_host(self._params)
            self.counters.add(stats, offload=True)
            self._offloaded = True

    def drop_copies(self) -> None:
        """Releases the copies on other layouts (e.g. generation weights after generation)."""
        self._copies.clear()
