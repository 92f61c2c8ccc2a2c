"""Deadlines on cross-process waits: a wait that does not end in time stops the job, named.

A multi-controller job waits on its other processes in a few places: a cross-process transfer
(`reshard`'s CROSS hop), a coordination-service barrier, `fetch` of values that span processes,
and the end of a step, whose device programs may hold collectives spanning processes. JAX's
heartbeat ends the job when a process *dies*, but not when a peer is alive and never arrives: a
misrouted connection, a barrier one process skips or a collective one process never enqueues
leave every process waiting forever, idle. Each such wait therefore runs inside `guard(what)`;
a monitor thread ends the process when a guard outlives its deadline, printing one line that
names the wait, the step and MFC it belongs to (`label`) and the process. The other processes
then stop within the heartbeat timeout, as for any dead process (`distributed.abort`'s way:
`os._exit`, skipping JAX's exit barrier, which would wait for the stuck peers).

Single-process runs wait on nothing but their own devices: `configure` enables the deadlines
only for multi-process jobs (`jaxrlhf.distributed.initialize` does), and `guard` is then a
no-op.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import os
import sys
import threading
import time
from collections.abc import Callable

_POLL_S = 0.5


@dataclasses.dataclass(frozen=True)
class _Wait:
    what: str
    where: str  # the labels when the wait began, e.g. "step 3, MFC actor_train"
    deadline: float  # time.monotonic() past which the job stops


class _Watchdog:
    def __init__(self):
        self.timeout_s: float | None = None  # None: disabled
        self.process = 0
        # Each thread's own: a publish on a thread of its own names its version while the
        # main thread's step and MFC labels come and go.
        self.local = threading.local()
        self.waits: dict[int, _Wait] = {}
        self.ids = itertools.count()
        self.lock = threading.Lock()
        self.monitor: threading.Thread | None = None

    def start_monitor(self) -> None:
        if self.monitor is None:
            self.monitor = threading.Thread(target=self._watch, name="jaxrlhf-watchdog",
                                            daemon=True)
            self.monitor.start()

    def _watch(self) -> None:
        while True:
            time.sleep(_POLL_S)
            now = time.monotonic()
            with self.lock:
                late = [w for w in self.waits.values() if w.deadline < now]
            if late:
                self._stop(late[0])

    def _stop(self, wait: _Wait) -> None:
        where = f" ({wait.where})" if wait.where else ""
        print(f"jaxrlhf: process {self.process}: {wait.what}{where} did not complete within "
              f"{self.timeout_s:g} s; stopping the job (the other processes stop within the "
              "heartbeat timeout)", file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(1)


_DOG = _Watchdog()


def configure(timeout_s: float | None, process: int = 0) -> None:
    """Enables deadlines of `timeout_s` seconds on every guarded wait (None disables them)."""
    if timeout_s is not None and timeout_s <= 0:
        raise ValueError(f"wait timeout must be positive, got {timeout_s}")
    _DOG.timeout_s, _DOG.process = timeout_s, process
    if timeout_s is not None:
        _DOG.start_monitor()


def timeout_s() -> float | None:
    """The deadline of a guarded wait in seconds (None when disabled)."""
    return _DOG.timeout_s


@contextlib.contextmanager
def label(**labels):
    """Names what the enclosed waits of this thread belong to, e.g. `label(step=3)`,
    `label(mfc="actor_gen")`."""
    before = _labels()
    _DOG.local.labels = {**before, **labels}
    try:
        yield
    finally:
        _DOG.local.labels = before


def _labels() -> dict[str, object]:
    return getattr(_DOG.local, "labels", {})


def _where() -> str:
    return ", ".join(f"{key} {value}" for key, value in _labels().items())


@contextlib.contextmanager
def guard(what: str | Callable[[], str]):
    """The enclosed wait must end within the configured timeout, else the job stops, named.

    `what` may be a function giving the description, so that hot paths of single-process runs
    (where guards are off) never build it.
    """
    if _DOG.timeout_s is None:
        yield
        return
    text = what() if callable(what) else what
    wait_id = next(_DOG.ids)
    with _DOG.lock:
        _DOG.waits[wait_id] = _Wait(text, _where(), time.monotonic() + _DOG.timeout_s)
    try:
        yield
    finally:
        with _DOG.lock:
            del _DOG.waits[wait_id]
