"""Messages between the processes of a multi-process asynchronous run, every wait bounded.

The trainer process and the generation replica processes of `jaxrlhf.run.async_procs` run
different programs, so they cannot meet in device collectives except at the points both
reach (weight publishes, checkpoints). Everything else goes through the coordination service's
key-value store that `jax.distributed` already runs in process 0: small JSON messages (work
orders, "version v is published") and finished batches (token ids, masks, log-probs and
per-token versions as an `.npz`, tens of kilobytes). Keys are written once and deleted by the
reader.

A process waiting for a message that does not come (a peer alive but stuck) must not wait
forever: `Deadline` ends the process with one line naming the step, what it waited for and the
process, as `parallel.watchdog` does for device waits; the other processes then stop within
the heartbeat timeout (`jaxrlhf.distributed.abort`).
"""

from __future__ import annotations

import io
import json
import time
from collections.abc import Callable

import numpy as np

from jaxrlhf import distributed

_META = "__meta__"


def _missing(error: Exception) -> bool:
    return "NOT_FOUND" in str(error)


class Channel:
    """Key-value messages under `prefix` (one run's namespace)."""

    def __init__(self, prefix: str):
        from jax._src import distributed as jax_distributed

        self.client = jax_distributed.global_state.client
        self.prefix = prefix

    def put(self, key: str, message: dict) -> None:
        self.client.key_value_set(f"{self.prefix}/{key}", json.dumps(message))

    def take(self, key: str) -> dict | None:
        """The message at `key` (then deleted), or None if it is not there yet."""
        message = self.get(key)
        if message is not None:
            self.client.key_value_delete(f"{self.prefix}/{key}")
        return message

    def get(self, key: str) -> dict | None:
        """The message at `key`, left there (several processes read it), or None."""
        try:
            text = self.client.key_value_try_get(f"{self.prefix}/{key}")
        except Exception as error:  # noqa: BLE001 - JaxRuntimeError NOT_FOUND
            if _missing(error):
                return None
            raise
        return json.loads(text)

    def peek(self, key: str) -> bool:
        """Whether `key` is there (not deleted: several processes read it)."""
        try:
            self.client.key_value_try_get(f"{self.prefix}/{key}")
        except Exception as error:  # noqa: BLE001
            if _missing(error):
                return False
            raise
        return True

    def put_arrays(self, key: str, arrays: dict[str, np.ndarray], meta: dict) -> None:
        """numpy arrays and a JSON-able dict, as one value."""
        out = io.BytesIO()
        np.savez(out, **arrays, **{_META: np.frombuffer(json.dumps(meta).encode(), np.uint8)})
        self.client.key_value_set_bytes(f"{self.prefix}/{key}", out.getvalue())

    def take_arrays(self, key: str) -> tuple[dict[str, np.ndarray], dict] | None:
        """(arrays, meta) at `key` (then deleted), or None if it is not there yet."""
        try:
            data = self.client.key_value_try_get_bytes(f"{self.prefix}/{key}")
        except Exception as error:  # noqa: BLE001
            if _missing(error):
                return None
            raise
        self.client.key_value_delete(f"{self.prefix}/{key}")
        with np.load(io.BytesIO(data)) as npz:
            arrays = {k: npz[k] for k in npz.files}
        meta = json.loads(arrays.pop(_META).tobytes().decode())
        return arrays, meta


class Deadline:
    """A wait for messages that must make progress within `timeout_s`, else the job stops.

    Args:
      timeout_s: seconds without progress (`progress()`) before `check` stops the process.
      process: this process's index (named in the message).
    """

    def __init__(self, timeout_s: float, process: int):
        self.timeout_s, self.process = timeout_s, process
        self.since = time.monotonic()

    def progress(self) -> None:
        self.since = time.monotonic()

    def check(self, what: Callable[[], str]) -> None:
        """Stops the job, naming `what()` (e.g. "step 3: batch 5 from replica 1 (process 1)"),
        if nothing progressed for `timeout_s`."""
        if time.monotonic() - self.since > self.timeout_s:
            distributed.abort(f"jaxrlhf: process {self.process}: {what()} did not arrive "
                              f"within {self.timeout_s:g} s; stopping the job (the other "
                              "processes stop within the heartbeat timeout)")
