"""Weight versions from the trainer process to generation replica processes, off both paths.

In a multi-process asynchronous run (`run/async_procs.py`) every new policy version moves from
the trainer's devices onto each replica's generation layout by a cross-process `reshard` (shard
to shard, checksummed: `parallel/shard_transfer.py`). JAX pairs the two sides of a
cross-process `device_put` by a per-process transfer counter, and the move ends at a barrier
of every process, so every process must take part in every move, in the same order. The two
sides therefore agree first, through the coordination service (`run/channel.py`), on what
moves: the trainer announces the n-th publish as `pub/n` = {version, the leaves that travel};
from the announcement both sides plan the same buckets from the same global shardings.

Trainer (`TrainerWeights`): after an update it snapshots the actor's parameters and goes on
to its next update; a thread of its own (`run/publisher.py`) announces and sends the snapshot.
At most one version waits behind the one in flight, and a newer one supersedes it (never
announced, so no replica ever waits for it): publishes are numbered apart from versions.
With `async_rl.weight_sync=delta` the leaves that changed are decided at sending time, against
the version last *sent* (a superseded one never counts).

Replica (`ReplicaWeights`): its main thread looks for the next announcement between decode
chunks and receives the version on a thread of its own into a second copy while it keeps
decoding with the old one (`run/weight_receiver.py`); once complete the version is handed to
the rollout scheduler (`on_new_version`). One publish is in flight at a time on both sides.

Where there is no room for the second copy (the trainer's two snapshots, or the replica's
second copy of the generator's weights) that side says so in one line and publishes inline,
pausing: the trainer until the version has arrived, the replica's decoding likewise.

Deadlines: a transfer is watched by `parallel.watchdog` (labelled with the version), an
announcement by `channel.Deadline`, and a failed publish on either side ends the job with one
line naming the version and the process (`distributed.abort`: the others stop within the
heartbeat timeout rather than wait for a transfer nobody will serve).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import jax

from jaxrlhf import distributed
from jaxrlhf.parallel import delta, watchdog
from jaxrlhf.parallel.delta import WeightSync
from jaxrlhf.run.channel import Channel, Deadline
from jaxrlhf.run.publisher import Publisher, PublishError
from jaxrlhf.run.weight_receiver import WeightReceiver

_POLL_S = 0.002


def transfer(params, shardings: list, version: int, mine: int, changed: list[int],
             previous=None):
    """Every process: the actor's parameters onto each replica's layout (collective): the
    leaves `changed` (every process the same), the others kept from `previous` (replica
    `mine`'s weights of the version before; `parallel/delta.py`). Returns replica `mine`'s
    copy (None on the trainer, mine = 0) and the bytes moved."""
    kept, moved_bytes = None, 0
    for r, target in enumerate(shardings, 1):
        with watchdog.label(step=version, transfer=f"weights v{version} -> replica {r}"):
            if r == mine:
                moved, stats = delta.apply(params, previous, target, changed)
            else:  # another replica's copy: this process only takes part
                moved, stats = delta.send(params, target, changed)
        moved_bytes += stats.bytes_moved
        if r == mine:
            kept = moved
    return kept, moved_bytes


def one_line(error: BaseException) -> str:
    """An error's type and first line."""
    return f"{type(error).__name__}: {(str(error).splitlines() or [''])[0]}"


Transfer = Callable[..., tuple[object, int]]  # `transfer`'s signature


class TrainerWeights:
    """Process 0's side: `offer` after each update, `wait` before a collective (a save) or the
    end, when every replica must have taken part in every announced publish.

    Args:
      chan: the run's channel.
      shardings: each replica's parameter shardings (replica r = shardings[r - 1]).
      sync: what travels (`async_rl.weight_sync`).
      timeout_s: the longest a wait for the publisher may take.
      overlap: publish on a thread (the trainer goes on); False: inline, a pause.
      move: the cross-process move (`transfer`).
    """

    def __init__(self, chan: Channel, shardings: list, sync: WeightSync, timeout_s: float,
                 overlap: bool, move: Transfer = transfer):
        self.chan, self.shardings, self.move = chan, shardings, move
        self.tracker = delta.Tracker() if sync is WeightSync.DELTA else None
        self.announced = 0  # publishes announced so far (pub/0, pub/1, ...)
        self.published_bytes = 0
        self.publisher = Publisher(self._send, timeout_s) if overlap else None

    @property
    def superseded(self) -> int:
        return 0 if self.publisher is None else self.publisher.superseded

    def _send(self, params, version: int) -> None:
        """Announces and moves one version (the publisher's thread, or inline)."""
        changed = (list(range(len(jax.tree.leaves(params)))) if self.tracker is None
                   else self.tracker.changed(params))
        self.chan.put(f"pub/{self.announced}", {"version": version, "changed": changed})
        self.announced += 1
        self.published_bytes += self.move(params, self.shardings, version, 0, changed)[1]

    def offer(self, params, version: int) -> None:
        """Publishes `version`: snapshotted now and sent on the publisher's thread (inline
        without room). An earlier version's failure ends the job, named."""
        try:
            if self.publisher is None:
                self._send(params, version)
            else:
                self.publisher.offer(params, version)
        except PublishError as error:
            _abort(0, str(error))
        except Exception as error:  # noqa: BLE001 - inline: the same one line
            _abort(0, f"weights v{version}: the publish to generation failed: "
                      f"{one_line(error)}")

    def check(self) -> None:
        """Ends the job, named, if a publish failed (the trainer's waits for batches call it:
        a version that never arrives holds the batches issued at it)."""
        self._named(lambda publisher: publisher.ready())

    def wait(self) -> None:
        """Until every offered version is sent or superseded (deadline-bound)."""
        self._named(lambda publisher: publisher.wait())

    def close(self) -> None:
        self._named(lambda publisher: publisher.close())

    def _named(self, run: Callable[[Publisher], object]) -> None:
        """`run(publisher)` where there is one, a failed publish ending the job, named."""
        if self.publisher is not None:
            try:
                run(self.publisher)
            except PublishError as error:
                _abort(0, str(error))


class ReplicaWeights:
    """Replica r's side: `first` blocks for the first announced version; `ready` (between
    decode chunks) starts receiving the next announced one and hands over a complete one;
    `drain` waits for the one in flight (a save or stop: every process in step).

    Args:
      chan: the run's channel.
      trainer_params: the trainer's actor parameters (global arrays: their shardings plan the
        move; this process holds none of their shards).
      shardings: as `TrainerWeights`'s.
      replica: r (= this process's index).
      deadline: bounds the waits for announcements.
      overlap: receive on a thread (decoding goes on); False: inline, a pause.
      move: the cross-process move (`transfer`).
    """

    def __init__(self, chan: Channel, trainer_params, shardings: list, replica: int,
                 deadline: Deadline, overlap: bool, move: Transfer = transfer):
        self.chan, self.trainer_params, self.shardings = chan, trainer_params, shardings
        self.replica, self.deadline, self.move = replica, deadline, move
        self.received = 0  # publishes taken part in so far
        self.latest = None  # the newest version's weights received (delta's base)
        self.announcements: dict[int, dict] = {}  # version -> its announcement
        self.receiver = WeightReceiver(self._receive, overlap)

    @property
    def busy(self) -> bool:
        """A version is being received."""
        return self.receiver.busy

    def _receive(self, version: int):
        announced = self.announcements.pop(version)
        self.latest = self.move(self.trainer_params, self.shardings, version, self.replica,
                                announced["changed"], self.latest)[0]
        return self.latest

    def _next(self) -> dict | None:
        return self.chan.get(f"pub/{self.received}")

    def _start(self, announced: dict) -> None:
        version = announced["version"]
        self.announcements[version] = announced
        self.received += 1
        self._guarded(version, lambda: self.receiver.start(version))

    def first(self) -> tuple[object, int]:
        """(weights, version) of the first publish, waited for (deadline-bound)."""
        while (announced := self._next()) is None:
            self.deadline.check(lambda: f"replica {self.replica}: the first weights")
            time.sleep(_POLL_S)
        self._start(announced)
        return self.drain()

    def ready(self) -> tuple[object, int] | None:
        """A version complete since the last call (then, not before the caller installs it,
        the next is begun at the next call), else None; begins receiving an announced
        version when none is in flight."""
        received = self._taken(self.receiver.ready)
        if received is not None:
            return received
        if not self.receiver.busy and (announced := self._next()) is not None:
            self.deadline.progress()
            self._start(announced)
            return self._taken(self.receiver.ready)  # inline: already complete
        return None

    def drain(self) -> tuple[object, int] | None:
        """Waits for the version in flight (its transfer is watched); (weights, version), or
        None if none was."""
        return self._taken(self.receiver.join)

    def _taken(self, take) -> tuple[object, int] | None:
        return self._guarded(self.receiver.version, take)

    def _guarded(self, version: int | None, run: Callable[[], object]):
        """`run()`, a failure of the receipt of `version` ending the job in one line."""
        try:
            return run()
        except Exception as error:  # noqa: BLE001 - the receiver's (thread's), one line
            _abort(self.replica, f"weights v{version}: the receipt on generation replica "
                                 f"{self.replica} failed: {one_line(error)}")


def _abort(process: int, what: str) -> None:
    distributed.abort(f"jaxrlhf: process {process}: {what}; stopping the job (the other "
                      "processes stop within the heartbeat timeout)")
