"""The per-step scheduler: dispatch each MFC as soon as its inputs exist, never wait for devices.

JAX dispatch is asynchronous, so "running" an MFC means enqueuing its jitted functions and
getting back arrays that are futures. MFCs on disjoint meshes therefore run at the same time,
and MFCs on the same devices run in the order they were enqueued. The scheduler's only jobs are
to pick a deterministic dispatch order (every host of a multi-controller job must enqueue the
same programs in the same order), to resolve host-side futures (e.g. reward functions running
in a process pool) at named sync points, and to time everything without adding syncs.

Dispatch order: graph order, except that among MFCs whose inputs exist, device MFCs go before
host MFCs, because a host MFC blocks the Python thread on device values and everything
dispatched before it keeps the devices busy meanwhile.

Timing: a watcher thread per MFC waits for the MFC's outputs to be ready and stamps the time;
the main thread never waits for it. An MFC's start on the timeline is the latest of its
dispatch, its inputs' readiness and the end of the previous MFC on overlapping devices, which is
when XLA can start it.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import threading
import time
from collections.abc import Callable, Mapping

import jax

from jaxrlhf.dataflow.graph import DataflowGraph
from jaxrlhf.parallel import watchdog

Buffer = dict[str, object]
Executor = Callable[[Buffer], Mapping[str, object]]


@dataclasses.dataclass
class MFCTiming:
    """Host-clock times (seconds since step start) of one MFC in one step."""

    name: str
    devices: frozenset[int]
    dispatched: float = 0.0
    dispatch_done: float = 0.0
    ready: float = 0.0
    start: float = 0.0  # when the devices could begin it: see module docstring

    @property
    def seconds(self) -> float:
        return max(self.ready - self.start, 0.0)


@dataclasses.dataclass
class StepTiming:
    mfcs: dict[str, MFCTiming]
    host_blocked: dict[str, float]  # sync point -> seconds the host thread waited
    seconds: float

    @property
    def host_blocked_seconds(self) -> float:
        return sum(self.host_blocked.values())


def _resolve(value, sync_point: str, blocked: dict[str, float]):
    """Returns the value, waiting (and counting the wait) if it is a host future."""
    if isinstance(value, concurrent.futures.Future):
        t0 = time.perf_counter()
        value = value.result()
        blocked[sync_point] = blocked.get(sync_point, 0.0) + time.perf_counter() - t0
    return value


def _deleted_buffer(error: RuntimeError) -> bool:
    """Whether `error` only says an array was deleted or donated (by a later MFC)."""
    text = str(error)
    return "deleted" in text or "donated" in text


def _wait_ready(outputs: Mapping[str, object]) -> None:
    for value in outputs.values():
        if isinstance(value, concurrent.futures.Future):
            value = value.result()
        try:
            jax.block_until_ready(value)
        except RuntimeError as error:
            # An output donated or deleted downstream is ready by definition; anything else
            # (an XLA runtime error such as out-of-memory) is the MFC's failure.
            if not _deleted_buffer(error):
                raise


class Scheduler:
    """Runs one step of a dataflow graph.

    Args:
      graph: the validated graph.
      executors: MFC name -> function from the step buffer to that MFC's outputs (device arrays,
        host values, or `concurrent.futures.Future`s of host values). Executors dispatch work and
        return without waiting for devices; one that needs host values waits inside and its
        wait is charged to it.
      devices: MFC name -> ids of the devices it runs on (empty for host MFCs).
    """

    def __init__(self, graph: DataflowGraph, executors: Mapping[str, Executor],
                 devices: Mapping[str, frozenset[int]]):
        missing = [n for n in graph.order if n not in executors]
        if missing:
            raise ValueError(f"no executor for MFC(s) {missing}")
        self.graph, self.executors, self.devices = graph, executors, devices

    def dispatch_order(self, available: set[str]) -> list[str]:
        """The deterministic order in which MFCs are dispatched, given the dataset keys."""
        have, pending, order = set(available), list(self.graph.order), []
        while pending:
            ready = [n for n in pending if set(self.graph.mfc(n).inputs) <= have]
            if not ready:
                raise ValueError(f"MFCs {pending} wait for keys nobody produces")
            device_ready = [n for n in ready if not self.graph.mfc(n).host]
            name = (device_ready or ready)[0]
            pending.remove(name)
            order.append(name)
            have |= set(self.graph.mfc(name).outputs)
        return order

    def run_step(self, dataset: Mapping[str, object]) -> tuple[Buffer, StepTiming]:
        """Dispatches every MFC once; returns the step buffer (all keys) and the timing."""
        missing = [k for k in self.graph.dataset_keys if k not in dataset]
        if missing:
            raise KeyError(f"the dataset batch lacks keys {missing}")
        t0 = time.perf_counter()
        clock = lambda: time.perf_counter() - t0
        buffer: Buffer = dict(dataset)
        blocked: dict[str, float] = {}
        timings: dict[str, MFCTiming] = {}
        watchers: list[threading.Thread] = []
        failures: dict[str, BaseException] = {}
        for name in self.dispatch_order(set(dataset)):
            mfc = self.graph.mfc(name)
            with watchdog.label(mfc=name):
                inputs = {k: _resolve(buffer[k], f"{name}<-{k}", blocked) for k in mfc.inputs}
                buffer.update(inputs)
                timing = MFCTiming(name, self.devices.get(name, frozenset()), dispatched=clock())
                outputs = self.executors[name]({**buffer, **inputs})
            unknown = set(outputs) - set(mfc.outputs)
            if unknown:
                raise ValueError(f"MFC {name} returned undeclared keys {sorted(unknown)}")
            timing.dispatch_done = clock()
            buffer.update(outputs)
            timings[name] = timing
            watcher = threading.Thread(target=self._stamp,
                                       args=(timing, outputs, clock, failures), daemon=True)
            watcher.start()
            watchers.append(watcher)
        for name, watcher in zip(timings, watchers):
            with watchdog.label(mfc=name), watchdog.guard("the MFC's device work"):
                watcher.join()
            if name in failures:
                raise failures[name]
        for key, value in list(buffer.items()):
            with watchdog.guard(lambda: f"step end: value {key!r}"):
                buffer[key] = _resolve(value, f"end<-{key}", blocked)
        self._place_on_timeline(timings)
        return buffer, StepTiming(timings, blocked, clock())

    @staticmethod
    def _stamp(timing: MFCTiming, outputs, clock, failures: dict[str, BaseException]) -> None:
        try:
            _wait_ready(outputs)
        except Exception as error:  # noqa: BLE001 - handed to the main thread, raised there
            failures[timing.name] = error
        timing.ready = max(clock(), timing.dispatch_done)

    def _place_on_timeline(self, timings: dict[str, MFCTiming]) -> None:
        """Sets each MFC's start: dispatch, inputs ready, and overlapping devices free."""
        done: list[MFCTiming] = []
        for timing in sorted(timings.values(), key=lambda t: t.dispatched):
            start = timing.dispatched
            for pred in self.graph.graph.predecessors(timing.name):
                start = max(start, timings[pred].ready)
            for other in done:
                if other.devices & timing.devices:
                    start = max(start, other.ready)
            timing.start = min(start, timing.ready)
            done.append(timing)
