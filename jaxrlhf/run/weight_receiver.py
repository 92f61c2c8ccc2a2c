"""A generation replica's receipt of new weights beside its decoding.

A multi-process asynchronous run's replica (`run/async_procs.py`) takes part in every publish
of the trainer's weights (a cross-process `reshard`). Received in the replica's main thread,
the publish stops decoding for its whole duration. Received on a thread of its own, into
buffers of their own (the second copy), the replica's main thread goes on decoding with the old
version meanwhile; the new weights are handed to the rollout scheduler once complete, which
decides when rows switch (`async_rl.on_new_version`).

The second copy needs room: the generator's parameters twice, per device, for as long as the
sync lasts. `second_copy_fits` asks the devices where they can say (GPUs, TPUs), and the host's
available memory for XLA:CPU's (whose device memory is the host's). Without room the sync runs
in the main thread and pauses decoding, as before.
"""

from __future__ import annotations

import dataclasses
import math
import os
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
    """Whether every device has `bytes_per_device` (times a margin) free beside what it holds.

    Devices that report memory figures (GPUs, TPUs) are asked. XLA:CPU's devices report none:
    their memory is this host's, so the host's available memory must hold the second copy of
    every local device at once (on 2 loaded cores, qwen3-0.6b received beside decoding onto 4
    replicated CPU devices was killed for memory: 14.8 GB)."""
    local = [d for d in devices if d.process_index == jax.process_index()]
    host_devices = 0
    for device in local:
        stats = device.memory_stats()
        if not stats or "bytes_limit" not in stats:
            host_devices += 1
            continue
        if stats["bytes_limit"] - stats.get("bytes_in_use", 0) < _MARGIN * bytes_per_device:
            return False
    return host_devices * bytes_per_device * _MARGIN <= _host_available_bytes()


def _host_available_bytes() -> int:
    """MemAvailable of /proc/meminfo (Linux), else the free physical pages."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


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

    @property
    def version(self) -> int | None:
        """The version being received, or None."""
        return None if self._sync is None else self._sync.version

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
