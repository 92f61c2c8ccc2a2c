"""A generation replica's receipt of new weights beside its decoding.

A multi-process asynchronous run's replica (`run/async_procs.py`) takes part in every publish
of the trainer's weights (a cross-process `reshard`). Received in the replica's main thread,
the publish stops decoding for its whole duration. Received on a thread of its own, into
buffers of their own (the second copy), the replica's main thread goes on decoding with the old
version meanwhile; the new weights are handed to the rollout scheduler once complete, which
decides when rows switch (`async_rl.on_new_version`).

The second copy needs room: the generator's parameters twice, per device, for as long as the
sync lasts. `second_copy_fits` asks the devices where they can say (GPUs, TPUs); where they
cannot (XLA:CPU, whose device memory is the host's), it assumes room. Without room the sync
runs in the main thread and pauses decoding, as before.
"""

from __future__ import annotations

import dataclasses
import math
import threading
from collections.abc import Callable, Sequence

import jax

# Headroom beyond the second copy: the pieces in flight and the pasted boxes of one chunk.
_MARGIN = 1.25


def bytes_per_device(shardings, abstract) -> int:
    """Bytes of the largest per-device share of a parameter tree (shardings and shapes)."""
    per_device: dict[jax.Device, int] = {}
    for sharding, leaf in zip(jax.tree.leaves(shardings), jax.tree.leaves(abstract)):
        nbytes = math.prod(sharding.shard_shape(leaf.shape)) * jax.numpy.dtype(
            leaf.dtype).itemsize
        for device in sharding.device_set:
            per_device[device] = per_device.get(device, 0) + nbytes
    return max(per_device.values(), default=0)


def second_copy_fits(devices: Sequence[jax.Device], bytes_per_device: int) -> bool:
    """Whether every device has `bytes_per_device` (times a margin) free beside what it holds
    (True where a device reports no memory figures, e.g. XLA:CPU)."""
    for device in devices:
        stats = device.memory_stats() if device.process_index == jax.process_index() else None
        if not stats or "bytes_limit" not in stats:
            continue
        if stats["bytes_limit"] - stats.get("bytes_in_use", 0) < _MARGIN * bytes_per_device:
            return False
    return True


@dataclasses.dataclass
class _Sync:
    version: int
    thread: threading.Thread | None = None
    params: object = None
    error: BaseException | None = None


class WeightReceiver:
    """Receives weight versions one at a time, beside the caller's work or inline.

    Args:
      receive: `receive(version)` takes part in the publish of `version` and returns this
        process's copy of the weights (collective: every process calls it for every version).
      overlap: on a thread of its own (the caller keeps decoding); False: inline, a pause.
    """

    def __init__(self, receive: Callable[[int], object], overlap: bool):
        self.receive, self.overlap = receive, overlap
        self._sync: _Sync | None = None

    @property
    def busy(self) -> bool:
        """A version is being received."""
        return self._sync is not None

    def start(self, version: int) -> None:
        """Begins receiving `version` (inline, it is received before this returns)."""
        if self._sync is not None:
            raise RuntimeError(f"weights v{version} before v{self._sync.version} arrived")
        self._sync = sync = _Sync(version)
        if not self.overlap:
            sync.params = self.receive(version)
            return
        sync.thread = threading.Thread(target=self._run, args=(sync,),
                                       name=f"jaxrlhf-weights-v{version}", daemon=True)
        sync.thread.start()

    def _run(self, sync: _Sync) -> None:
        try:
            sync.params = self.receive(sync.version)
        except BaseException as error:  # noqa: BLE001 - raised in the caller's thread
            sync.error = error

    def ready(self) -> tuple[object, int] | None:
        """(params, version) once the version in flight is complete (once), else None."""
        sync = self._sync
        if sync is None or (sync.thread is not None and sync.thread.is_alive()):
            return None
        return self._take()

    def join(self) -> tuple[object, int] | None:
        """Waits for the version in flight (its transfer is deadline-bound by `reshard`'s
        watchdog); (params, version), or None if none was in flight."""
        if self._sync is None:
            return None
        if self._sync.thread is not None:
            self._sync.thread.join()
        return self._take()

    def _take(self) -> tuple[object, int]:
        sync, self._sync = self._sync, None
        if sync.error is not None:
            raise sync.error
        return sync.params, sync.version
