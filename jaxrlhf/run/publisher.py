"""The trainer's publish of new weights, off its critical path.

After an update the one-process asynchronous loop (`run/async_loop.py`) hands the actor's new
parameters to generation. Done inline, the trainer's next update waited for the whole copy onto
the generation layout (and, with `async_rl.weight_sync=delta`, for the comparison that decides
what travels). Here the caller only snapshots the parameters (one device copy per tensor, which
JAX dispatches asynchronously: the next update donates the originals) and a thread of the
publisher's own moves the snapshot to generation; the generation side installs each completed
version when it next looks (`ready`).

At most one version waits: a version offered while another is still unsent replaces it (the
generator only ever wants the newest), so the trainer never queues copies faster than they
travel and memory holds at most two snapshots (one in flight, one waiting). Every wait has a
deadline, and an error of the publisher's thread is raised in the caller at its next call, as
one line naming the version.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp


class PublishError(RuntimeError):
    """A publish failed or did not finish in time (one line naming the version)."""


class Publisher:
    """Moves weight versions to generation in a thread of its own.

    Args:
      transfer: `transfer(params, version)` returns generation's copy of `params` (a
        snapshot the publisher owns); called in the publisher's thread, one version at a time,
        in version order (a superseded version is never transferred).
      timeout_s: the longest any wait for the publisher may take.
    """

    def __init__(self, transfer: Callable[[object], object], timeout_s: float):
        self.transfer, self.timeout_s = transfer, timeout_s
        self.superseded = 0  # versions replaced before they were sent
        self.events: list[tuple[str, int, float]] = []  # (what, version, perf_counter time)
        self._cond = threading.Condition()
        self._waiting: tuple[object, int] | None = None  # (snapshot, version), not yet sent
        self._sending: int | None = None  # the version in flight
        self._done: tuple[object, int] | None = None  # the newest version sent, not yet taken
        self._error: PublishError | None = None
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="jaxrlhf-publish", daemon=True)
        self._thread.start()

    @property
    def busy(self) -> bool:
        """A version waits or is being sent."""
        with self._cond:
            return self._waiting is not None or self._sending is not None

    def offer(self, params, version: int) -> None:
        """Publishes `params` as `version` without waiting for it: a snapshot is taken now
        (asynchronously dispatched device copies), the copy to generation runs in the
        publisher's thread. Raises an earlier version's failure."""
        snapshot = jax.tree.map(jnp.copy, params)
        with self._cond:
            self._raise()
            if self._waiting is not None:
                self.superseded += 1
            self._waiting = snapshot, version
            self.events.append(("offer", version, time.perf_counter()))
            self._cond.notify_all()

    def ready(self) -> tuple[object, int] | None:
        """(generation's params, version) of the newest version sent since the last call, else
        None; raises a failed version's error."""
        with self._cond:
            self._raise()
            done, self._done = self._done, None
            return done

    def wait(self) -> tuple[object, int] | None:
        """Waits (at most `timeout_s`) until every offered version is sent or superseded, then
        `ready()`."""
        with self._cond:
            if not self._cond.wait_for(lambda: self._error is not None or (
                    self._waiting is None and self._sending is None), self.timeout_s):
                version = self._sending if self._sending is not None else self._waiting[1]
                raise PublishError(f"weights v{version}: the publish to generation did not "
                                   f"finish within {self.timeout_s:.0f} s")
        return self.ready()

    def close(self) -> None:
        """Waits for the versions offered, then ends the thread (errors raised as `wait`'s)."""
        try:
            self.wait()
        finally:
            with self._cond:
                self._closed = True
                self._cond.notify_all()
            self._thread.join(self.timeout_s)

    def _raise(self) -> None:
        if self._error is not None:
            raise self._error

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._waiting is not None or self._closed)
                if self._waiting is None:  # closed
                    return
                (snapshot, version), self._waiting = self._waiting, None
                self._sending = version
                self.events.append(("send", version, time.perf_counter()))
            try:
                params = self.transfer(snapshot, version)
                jax.block_until_ready(params)
                error = None
            except Exception as e:  # noqa: BLE001 - raised in the caller's thread
                first = (str(e).splitlines() or [""])[0]
                error = PublishError(f"weights v{version}: the publish to generation failed: "
                                     f"{type(e).__name__}: {first}")
            del snapshot
            with self._cond:
                self._sending = None
                if error is None:
                    self._done = params, version
                    self.events.append(("sent", version, time.perf_counter()))
                else:
                    self._error = error
                    self._waiting = None  # later versions are not sent: the run stops
                self._cond.notify_all()
                if error is not None:
                    return
