"""Weight versions from a trainer process to a generation replica process off both paths
(run/remote_weights.py), in two real processes under jax.distributed (no model, seconds):

  * the trainer's next update starts before the version it published after the previous one
    has arrived at the replica, and the replica decodes while a version is in flight: shown by
    events, not timing. The replica's side of each transfer waits, before taking part, for
    the trainer's word that its next update has begun and for a decode step of its own begun
    while the version was in flight; a publish that blocked either side would never complete
    (and the deadlines would stop the processes);
  * after every version the replica's weights equal, bit for bit, the trainer's newest
    version, and a blocking publish (both sides inline) of the same versions ends with the very
    same bytes, for `weight_sync` full and delta (whose leaves change at different versions,
    and whose base must be the version last *sent* when newer ones supersede waiting ones);
  * a publish or a receipt that fails in flight ends its process with one line naming the
    version.

All slow: in one of two fresh-clone CI runs (-n 2) the replica made no decode step while v1 was
in flight for 60 s, so its gate never opened and the trainer's transfer watchdog stopped the job;
not yet understood, so these stay out of the default suite until it is.
"""

import hashlib
import sys
import threading
import time

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from tests.processes import run_processes

VERSIONS = 6
SHAPES = {"a": ((8, 4), P("x", None), P(None, "y")), "b": ((4,), P(), P("y")),
          "c": ((2, 8, 4), P(None, "x"), P()), "d": ((3, 5), P(), P())}


def _layouts():
    """(the trainer's shardings on process 0's devices, the replica's on process 1's)."""
    meshes = [Mesh(np.array([d for d in jax.devices() if d.process_index == p]), (axis,))
              for p, axis in ((0, "x"), (1, "y"))]
    return [{k: NamedSharding(mesh, spec[1 + i]) for k, spec in SHAPES.items()}
            for i, mesh in enumerate(meshes)]


def _initial(shardings):
    """Version 0 on the trainer's devices (another process: arrays without local shards)."""
    def leaf(k, i):
        value = np.random.default_rng(i).standard_normal(SHAPES[k][0]).astype(np.float32)
        return jax.make_array_from_callback(value.shape, shardings[k], lambda idx: value[idx],
                                            dtype=value.dtype)

    return {k: leaf(k, i) for i, k in enumerate(SHAPES)}


@jax.jit
def _update(params, version):
    """Version `version`: leaf i moves at the versions divisible by i + 1 (delta has both
    changed and unchanged leaves to carry); by amounts exact in float32."""
    return {k: x + jax.numpy.where(version % (i + 1) == 0, version * 0.5, 0.0).astype(x.dtype)
            for i, (k, x) in enumerate(sorted(params.items()))}


def _digest(params) -> str:
    h = hashlib.sha256()
    for k in sorted(params):
        h.update(np.asarray(jax.device_get(params[k])).tobytes())
    return h.hexdigest()[:16]


def _trainer(chan, replica_shardings, sync, overlap: bool, params, fail_from=None) -> None:
    from jaxrlhf.run.remote_weights import TrainerWeights, transfer

    def failing(params, shardings, version, *args):
        if fail_from is not None and version >= fail_from:  # the first sent from v3 on
            raise RuntimeError(f"device lost while sending\nsecond line v{version}")
        return transfer(params, shardings, version, *args)

    weights = TrainerWeights(chan, [replica_shardings], sync, 60.0, overlap, move=failing)
    weights.offer(params, 0)
    params = _update(params, 1)
    for version in range(1, VERSIONS + 1):
        weights.offer(params, version)
        print(f"event {sync.value}-{overlap} update-after {version} {time.perf_counter()}",
              flush=True)
        if version < VERSIONS:  # the next update, while version travels
            params = jax.block_until_ready(_update(params, version + 1))
        chan.put(f"go/{version}", {})  # (the replica's side waits for it)
        if overlap and version < 3:  # versions 1, 2 travel alone, later ones may supersede
            while chan.get(f"arrived/{version}") is None:
                time.sleep(0.002)
    weights.close()
    print(f"trainer {sync.value} overlap={overlap} {_digest(params)} "
          f"superseded={weights.superseded}", flush=True)


def _replica(chan, trainer_params, replica_shardings, sync, overlap: bool, fail_at=None):
    from jaxrlhf.run.channel import Deadline
    from jaxrlhf.run.remote_weights import ReplicaWeights, transfer

    decoded_in_flight = {}  # version -> set by a decode step begun while it was in flight

    def gated(params, shardings, version, mine, changed, previous):
        if overlap and version > 0:
            while chan.get(f"go/{version}") is None:  # the trainer's next update began
                time.sleep(0.002)
            decoded = decoded_in_flight.setdefault(version, threading.Event())
            assert decoded.wait(60), f"no decode step beside v{version}"
        moved = transfer(params, shardings, version, mine, changed, previous)
        if fail_at is not None and version >= fail_at:  # the first received from v3 on,
            # after taking part, as a checksum refused on arrival is
            raise RuntimeError(f"bucket of 'a' corrupt in transit\nsecond line v{version}")
        return moved

    weights = ReplicaWeights(chan, trainer_params, [replica_shardings], 1, Deadline(60.0, 1),
                             overlap, move=gated)
    params, version = weights.first()
    decode = jax.jit(lambda w: sum(jax.numpy.sum(x) for x in w.values()))
    while version < VERSIONS:
        in_flight = weights.receiver.version
        if in_flight is not None:
            decoded_in_flight.setdefault(in_flight, threading.Event())
        jax.block_until_ready(decode(params))  # a decode chunk with the installed weights
        if in_flight is not None:
            print(f"event {sync.value}-{overlap} decode-in-flight {in_flight} "
                  f"{time.perf_counter()}", flush=True)
            decoded_in_flight[in_flight].set()
        if (received := weights.ready()) is not None:
            params, version = received
            chan.put(f"arrived/{version}", {})
            print(f"event {sync.value}-{overlap} arrived {version} {time.perf_counter()}",
                  flush=True)
    print(f"replica {sync.value} overlap={overlap} {_digest(params)}", flush=True)


def _worker(address: str, process_id: int, case: str) -> None:
    from jaxrlhf import distributed
    from jaxrlhf.backend import use_cpu_devices

    cfg = distributed.from_flags(address, 2, process_id, heartbeat_timeout_s=5,
                                 wait_timeout_s=60)
    use_cpu_devices(2)
    distributed.initialize(cfg)
    from jaxrlhf.parallel.delta import WeightSync
    from jaxrlhf.parallel.reshard import process_local
    from jaxrlhf.run.channel import Channel

    trainer_shardings, replica_shardings = _layouts()
    runs = ([(sync, overlap) for sync in WeightSync for overlap in (True, False)]
            if case == "runs" else [(WeightSync.FULL, True)])
    with process_local():
        for n, (sync, overlap) in enumerate(runs):
            chan = Channel(f"test/{case}/{n}")
            params = _initial(trainer_shardings)
            if process_id == 0:
                _trainer(chan, replica_shardings, sync, overlap, params,
                         fail_from=3 if case == "fail-trainer" else None)
            else:
                _replica(chan, params, replica_shardings, sync, overlap,
                         fail_at=3 if case == "fail" else None)


@pytest.fixture(scope="module")
def runs():
    return run_processes(__file__, 2, timeout=300)


def _events(out: str, run: str) -> dict[str, dict[int, float]]:
    """{what: {version: time}} of one run's events ("full-True": full, overlapped)."""
    events: dict[str, dict[int, float]] = {}
    for w in map(str.split, out.splitlines()):
        if w and w[0] == "event" and w[1] == run:
            events.setdefault(w[2], {}).setdefault(int(w[3]), float(w[4]))
    return events


@pytest.mark.slow  # flaked once in CI (below)
def test_the_trainer_goes_on_and_the_replica_decodes_while_a_version_is_in_flight(runs):
    (p0, out0, err0), (p1, out1, err1) = runs
    assert p0.returncode == 0 and p1.returncode == 0, (err0[-2000:], err1[-2000:])
    for run in ("full-True", "delta-True"):  # both processes read this machine's clock
        trainer, replica = _events(out0, run), _events(out1, run)
        arrived = replica["arrived"]
        assert max(arrived) == VERSIONS, out1[-2000:]
        for version, t in arrived.items():
            assert trainer["update-after"][version] < t  # the next update began before
            assert replica["decode-in-flight"][version] < t  # decoding went on meanwhile


@pytest.mark.slow  # flaked once in CI (below)
def test_after_every_version_the_weights_equal_a_blocking_publish_bit_for_bit(runs):
    (p0, out0, err0), (p1, out1, err1) = runs
    assert p0.returncode == 0 and p1.returncode == 0, (err0[-2000:], err1[-2000:])
    for sync in ("full", "delta"):
        trainer = [line.split()[3] for line in out0.splitlines()
                   if line.startswith(f"trainer {sync} ")]
        replica = [line.split()[3] for line in out1.splitlines()
                   if line.startswith(f"replica {sync} ")]
        assert len(trainer) == len(replica) == 2, (out0[-2000:], out1[-2000:])
        # overlapped and blocking: the trainer's newest version, both
        assert trainer[0] == trainer[1] == replica[0] == replica[1]


def _named_version(line: str) -> int:
    """v in "... weights v<v>: ..." (-1 if absent); a version after 2 may be superseded, so
    the failing one is the first sent from 3 on."""
    return int(line.split("weights v")[1].split(":")[0]) if "weights v" in line else -1


@pytest.mark.slow  # ~12 s: the trainer waits for the heartbeat to see the replica gone
def test_a_receipt_failed_in_flight_is_one_line_naming_the_version():
    (p0, _, err0), (p1, out1, err1) = run_processes(__file__, 2, timeout=300, args=("fail",))
    assert p1.returncode == 1, err1[-2000:]
    last = err1.strip().splitlines()[-1]
    version = _named_version(last)
    assert version >= 3 and last == (
        f"jaxrlhf: process 1: weights v{version}: the receipt on generation replica 1 failed: "
        "RuntimeError: bucket of 'a' corrupt in transit; stopping the job (the other "
        "processes stop within the heartbeat timeout)"), err1[-2000:]
    assert f"arrived {version}" not in out1  # never handed to decoding
    assert p0.returncode != 0  # the trainer does not wait forever for a replica gone



@pytest.mark.slow  # ~12 s, as above
def test_a_publish_failed_in_flight_is_one_line_naming_the_version():
    (p0, out0, err0), (p1, _, err1) = run_processes(__file__, 2, timeout=300,
                                                    args=("fail-trainer",))
    assert p0.returncode == 1, err0[-2000:]
    last = err0.strip().splitlines()[-1]
    version = _named_version(last)
    assert version >= 3 and last == (
        f"jaxrlhf: process 0: weights v{version}: the publish to generation failed: "
        "RuntimeError: device lost while sending; stopping the job (the other processes stop "
        "within the heartbeat timeout)"), err0[-2000:]
    assert p1.returncode != 0

if __name__ == "__main__":
    _worker(sys.argv[1], int(sys.argv[2]), sys.argv[3] if len(sys.argv) > 3 else "runs")
