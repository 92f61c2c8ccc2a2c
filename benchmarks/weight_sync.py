"""Weight sync trainer -> generator across processes, against the wire.

`python benchmarks/weight_sync.py [--sizes=tiny,bench,llama-3.2-1b] [--processes=2]
[--cases=0-3:f4>4-5:d2,0-3:d2t2>4-7:t4,0-1:p2>4-7:d4] [--paths=staged,shards,overlap]
[--rounds=3] [--dtype=bfloat16] [--chunk_mb=256] [--transfer_size=0] [--keep_freed]
[--before=CHECKOUT]`, or `--predict`: the
planner's price of a full sync for three models on two clusters (`PREDICTIONS`)
(from the repository root or anywhere else; no PYTHONPATH needed)

Starts `--processes` processes on this machine (8 CPU devices split evenly: the trainer's
layout on the first half of the devices, the generator's on the second, disjoint process
groups) and, per model size and case (`TRAIN>GEN` strategy strings), alternates round by round:

  * wire: a raw loopback socket (no JAX) from each trainer process to its generator process
    (trainer process i to process P/2 + i, the pairs at once), carrying the bytes the sync
    carries between them: the ceiling nothing on this machine can beat;
  * each sync path (`--paths`): `parallel.reshard` of the whole parameter tree from the
    trainer's layout onto the generator's, the cross-process route taking the staged hop (the
    destination's layout built on the sender, then whole meshes cross; the path before issue
    48) or shard to shard (`parallel/shard_transfer.py`); `overlap`: shard to shard, received
    by `run/weight_receiver.py` on a thread while the generator's main thread decodes (a
    forward of the model on one token of 4 rows per step) with the previous copy; `before`:
    shard to shard through `--before`'s parallel/shard_transfer.py (a worktree of an earlier
    commit: `git worktree add /tmp/before <commit>`), for a before/after in one run;
  * `transport`: JAX's own cross-process `device_put` of the same bytes as one flat array,
    one per pair of processes (no slicing, pasting or checksums): the ceiling of any path
    through JAX's transport, against which the wire says what that transport itself costs.

Per row (one JSON line each, then a plain table): bytes that crossed processes (`wire_bytes`,
counted by reshard) against the least any move needs (`need_bytes`: every destination
process's distinct boxes once, `shard_transfer.need_bytes`) and the bytes per generator device
(a replicated destination holds one copy per device: `per_device_bytes`); median seconds over
the rounds, GB/s (need_bytes / seconds) and its share of the wire's GB/s measured in the same
rounds; the generator's pause: a sync blocks the generator process from its start to its end
(the generation loop runs nothing meanwhile), so the pause is its seconds on the generator;
with `overlap`, the sum of the gaps between decode steps beyond their usual length (the sync's
seconds then run to the end of the decode step in which it completed).
Each path's result is checked element for element on the generator against the values the
trainer was filled with (first round).

tiny and W-cpu (`bench`) take 4 kv heads (2 in the shipped sizes) so that t4 divides them.

Timings on this machine are disturbed by other jobs: compare only figures of one invocation
(the paths and the wire alternate within each round).
"""

from __future__ import annotations

import argparse
import contextlib
import enum
import functools
import json
import math
import os
import pathlib
import socket
import statistics
import subprocess
import sys
import time

REPO = pathlib.Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

DEVICES = 8
_MOD = 251  # fill values: (flat index mod 251), exact in bf16


def _args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="tiny,bench,llama-3.2-1b")
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--cases", default="0-3:f4>4-5:d2,0-3:d2t2>4-7:t4,0-1:p2>4-7:d4")
    parser.add_argument("--paths", default="staged,shards,overlap")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--transfer_size", type=int, default=0,
                        help="jax_cross_host_transfer_transfer_size (0: JAX's default)")
    parser.add_argument("--chunk_mb", type=int, default=256,
                        help="reshard's chunk_bytes in MiB (bytes in flight between waits)")
    parser.add_argument("--before", default="",
                        help="a checkout (e.g. a git worktree of an earlier commit) whose "
                             "parallel/shard_transfer.py the `before` path runs")
    parser.add_argument("--keep_freed", action="store_true",
                        help="the run stack's malloc (backend.keep_freed_host_memory): freed "
                             "buffers are reused, not paged in anew, as in a run; each process "
                             "holds the peak of every path (p2>d4 at qwen3-0.6b: over 12 GB)")
    parser.add_argument("--timeout", type=float, default=580.0)
    parser.add_argument("--predict", action="store_true",
                        help="print the planner's predicted sync per version (PREDICTIONS) only")
    parser.add_argument("--worker", nargs=2, metavar=("ADDRESS", "PROCESS_ID"), default=None)
    parser.add_argument("--out", default="")
    args = parser.parse_args(argv)
    if "before" in args.paths.split(",") and not args.before:
        parser.error("--paths: the before path needs --before=CHECKOUT")
    return args


# --- the wire: a plain socket between the same two processes -----------------------------------


def _wire_seconds(chan, role: str, nbytes: int, key: str) -> float:
    """Sends (role "send") or receives ("recv") `nbytes` over loopback TCP; seconds from the
    first byte sent to the receiver's acknowledgement of the last, on the sender."""
    import numpy as np

    if role == "recv":
        with socket.create_server(("127.0.0.1", 0)) as server:
            chan.put(key, {"port": server.getsockname()[1]})
            conn, _ = server.accept()
            with conn:
                buf = memoryview(bytearray(nbytes))
                got = 0
                while got < nbytes:
                    got += conn.recv_into(buf[got:], nbytes - got)
                conn.sendall(b"k")
        return 0.0
    port = None
    while port is None:
        message = chan.take(key)
        port = None if message is None else message["port"]
        time.sleep(0.001)
    payload = np.ones(nbytes, np.uint8)
    with socket.create_connection(("127.0.0.1", port)) as conn:
        start = time.perf_counter()
        conn.sendall(memoryview(payload))
        conn.recv(1)
        return time.perf_counter() - start


# --- the sync --------------------------------------------------------------------------------


def _pattern(shape, index, dtype):
    """The fill of the block `index` of an array of `shape`: its flat index mod 251."""
    import numpy as np

    out = np.zeros([len(range(*s.indices(n))) for s, n in zip(index, shape)], np.int32)
    stride = 1
    for axis in reversed(range(len(shape))):
        coords = np.arange(*index[axis].indices(shape[axis]), dtype=np.int64)
        view = [1] * len(shape)
        view[axis] = -1
        out += ((coords * stride) % _MOD).astype(np.int32).reshape(view)
        stride = stride * shape[axis] % _MOD
    return (out % _MOD).astype(dtype)


def _filled(shardings, abstract, dtype):
    """The trainer's parameters: every process makes only its own shards."""
    import jax

    return jax.tree.map(
        lambda s, a: jax.make_array_from_callback(a.shape, s, lambda i, a=a: _pattern(
            a.shape, i, dtype), dtype=dtype), shardings, abstract)


def _check(tree, dtype) -> None:
    import jax
    import numpy as np

    for x in jax.tree.leaves(tree):
        for shard in x.addressable_shards:
            if not np.array_equal(np.asarray(shard.data), _pattern(x.shape, shard.index, dtype)):
                raise AssertionError(f"wrong values in a shard {shard.index} of {x.shape}")


def _need(src_tree, dst_shardings) -> tuple[int, int]:
    """(need_bytes, bytes one generator device holds)."""
    import jax

    from jaxrlhf.parallel.shard_transfer import need_bytes

    need = per_device = 0
    for x, dst in zip(jax.tree.leaves(src_tree), jax.tree.leaves(dst_shardings)):
        need += need_bytes(x.sharding, dst, x.shape, x.dtype.itemsize)
        per_device += x.dtype.itemsize * math.prod(dst.shard_shape(x.shape))
    return need, per_device


class Mode(enum.Enum):
    """A sync path of the benchmark."""

    STAGED = "staged"  # the staged cross-process hop, the generator paused throughout
    SHARDS = "shards"  # shard to shard, the generator paused throughout
    BEFORE = "before"  # shard to shard through `--before`'s parallel/shard_transfer.py
    TRANSPORT = "transport"  # JAX's cross-process device_put alone (`_transport`)
    OVERLAP = "overlap"  # shard to shard, received on a thread while the generator decodes


def _transport_payload(need: int):
    """What `_transport` sends: `need / (processes / 2)` bytes in one flat uint8 array on the
    first device of each trainer process; a generator process's placeholder for its partner's."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import SingleDeviceSharding

    me, half = jax.process_index(), jax.process_count() // 2
    nbytes = need // half
    if me < half:
        return jax.device_put(jnp.ones((nbytes,), jnp.uint8), jax.local_devices()[0])
    partner = [d for d in jax.devices() if d.process_index == me - half][0]
    return jax.make_array_from_single_device_arrays(
        (nbytes,), SingleDeviceSharding(partner), [], dtype=jnp.uint8)


def _transport(chan, key: str, payload) -> tuple[object, int]:
    """The ceiling of any path through JAX's transport: one single-device cross-process
    `device_put` of `payload` from each trainer process to its generator process (trainer
    process i to P/2 + i, the pairs at once), then the sync's barrier; (received, bytes)."""
    import jax
    from jax.sharding import SingleDeviceSharding

    me, half = jax.process_index(), jax.process_count() // 2
    receiver = (me + half) if me < half else me
    target = [d for d in jax.devices() if d.process_index == receiver][0]
    (moved,) = jax.device_put([payload], [SingleDeviceSharding(target)], may_alias=False)
    jax.block_until_ready(moved)
    _barrier(chan, key)
    return (moved if me >= half else None), payload.size * half


@functools.cache
def _module_of(checkout: str):
    """`checkout`'s parallel/shard_transfer.py as a module of its own (loaded once: its
    programs compile once)."""
    import importlib.util

    path = pathlib.Path(checkout) / "jaxrlhf/parallel/shard_transfer.py"
    spec = importlib.util.spec_from_file_location("shard_transfer_before", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@contextlib.contextmanager
def _shard_transfer_of(checkout: str):
    """`reshard`'s shard-to-shard hop through `checkout`'s parallel/shard_transfer.py (the same
    `move(xs, dsts, wait, names)`), for a before/after comparison in one run."""
    import importlib

    reshard_module = importlib.import_module("jaxrlhf.parallel.reshard")
    before = _module_of(checkout)
    current = reshard_module.shard_transfer
    reshard_module.shard_transfer = before
    try:
        yield
    finally:
        reshard_module.shard_transfer = current


def _decoder(model, gen_layout):
    """One decode step of the generator: the model's forward on one token of 4 rows, with
    whatever weights it is given (a real forward: every weight read, as a decode step does)."""
    import jax
    import jax.numpy as jnp

    from jaxrlhf.models.transformer import Transformer

    tokens = jax.device_put(jnp.ones((4, 1), jnp.int32), gen_layout.batch_sharding(2))
    positions = jax.device_put(jnp.zeros((4, 1), jnp.int32), gen_layout.batch_sharding(2))

    @jax.jit
    def forward(params):
        logits, _ = Transformer(model).apply({"params": params}, tokens, positions,
                                             positions + 1, last_only=True)
        return logits

    def step(params):
        with gen_layout.activation_context():
            return forward(params)

    return step


def _decode_through(step, params, receiver) -> tuple[float, float, int, object]:
    """Decodes with `params` until `receiver` has the new weights; returns (pause seconds,
    sync seconds, steps decoded meanwhile, what the receiver received). The pause: the time during the sync not covered by
    decode steps of the usual length (the median of 5 steps measured before), i.e. the sum of
    each gap between step ends beyond that length."""
    import jax

    times = []
    for _ in range(5):
        t = time.perf_counter()
        jax.block_until_ready(step(params))
        times.append(time.perf_counter() - t)
    usual = statistics.median(times)
    start = time.perf_counter()
    receiver.start(1)
    ends, got = [start], None
    while got is None:
        jax.block_until_ready(step(params))
        ends.append(time.perf_counter())
        got = receiver.ready()
    seconds = time.perf_counter() - start
    pause = sum(max(0.0, b - a - usual) for a, b in zip(ends, ends[1:]))
    return pause, seconds, len(ends) - 1, got[0]


def _case(chan, args, size: str, case: str, rounds: int) -> list[dict]:
    import jax
    import jax.numpy as jnp

    from jaxrlhf.models.sizes import abstract_params, get_size
    from jaxrlhf.parallel import make_layout
    from jaxrlhf.parallel.reshard import CrossPath, cross_process_path, reshard
    from jaxrlhf.run.weight_receiver import WeightReceiver, second_copy_fits

    me, processes = jax.process_index(), jax.process_count()
    half = processes // 2
    dtype = jnp.dtype(args.dtype)
    model = get_size(size, dtype=dtype)
    if model.num_kv_heads < 4:  # tiny and W-cpu: t4 must divide the kv heads
        model = model.replace(num_kv_heads=4)
    train_spec, gen_spec = case.split(">")
    boxed = abstract_params(model)
    train = make_layout(train_spec, model=model, devices=jax.devices()).param_shardings(boxed)
    gen_layout = make_layout(gen_spec, model=model, devices=jax.devices())
    gen = gen_layout.param_shardings(boxed)
    unboxed = jax.tree.map(lambda b: b.value if hasattr(b, "value") else b, boxed,
                           is_leaf=lambda b: hasattr(b, "names"))
    abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, dtype), unboxed)
    params = _filled(train, abstract, dtype)
    need, per_device = _need(params, gen)
    modes = [Mode(p) for p in args.paths.split(",")]
    times = {m: [] for m in modes}
    pauses = {m: [] for m in modes}
    decoded = {m: [] for m in modes}
    wire_bytes = {m: 0 for m in modes}
    wire_times = []
    fits = second_copy_fits(gen_layout.devices, per_device)
    step = _decoder(model, gen_layout) if Mode.OVERLAP in modes and me >= half else None
    current = None  # the generator's weights (decoded with while the next ones arrive)
    payload = _transport_payload(need) if Mode.TRANSPORT in modes else None
    for r in range(rounds + 1):  # round 0 compiles and checks; not timed
        # the wire, between the same pairs of processes, with the bytes each pair carries
        key = f"wire/{size}/{case}/{r}"
        if me < half:
            seconds = _wire_seconds(chan, "send", need // half, f"{key}/{me + half}")
            wire_times += [seconds] if r else []
        else:
            _wire_seconds(chan, "recv", need // half, f"{key}/{me}")
        _barrier(chan, f"{key}/done")
        for mode in modes:
            _barrier(chan, f"{key}/{mode.value}")
            path = CrossPath.STAGED if mode is Mode.STAGED else CrossPath.SHARDS
            before = _shard_transfer_of(args.before) if mode is Mode.BEFORE else (
                contextlib.nullcontext())
            with cross_process_path(path), before:
                receive = lambda: reshard(params, gen,  # noqa: E731
                                          chunk_bytes=args.chunk_mb << 20)
                start = time.perf_counter()
                if mode is Mode.TRANSPORT:
                    moved, wire_bytes[mode] = _transport(chan, f"{key}/sent", payload)
                    seconds = time.perf_counter() - start
                    pause, steps = seconds, 0
                elif mode is Mode.OVERLAP and me >= half and current is not None:
                    receiver = WeightReceiver(lambda v: receive(), overlap=fits)
                    pause, seconds, steps, (moved, stats) = _decode_through(step, current,
                                                                            receiver)
                else:
                    moved, stats = receive()
                    seconds = time.perf_counter() - start
                    pause, steps = seconds, 0
            if mode is not Mode.TRANSPORT:
                wire_bytes[mode] = stats.wire_bytes
                if r == 0 and me >= half:
                    _check(moved, dtype)
                # kept only to decode with (each kept copy is the generator's whole share)
                current = moved if me >= half and Mode.OVERLAP in modes else None
            if r > 0:
                times[mode].append(seconds)
                pauses[mode].append(pause)
                decoded[mode].append(steps)
            del moved
    rows = []
    wire_s = statistics.median(wire_times) if wire_times else None
    for mode in modes:
        rows.append({"size": size, "case": case, "path": mode.value, "processes": processes,
                     "wire_bytes": wire_bytes[mode], "need_bytes": need,
                     "per_device_bytes": per_device, "seconds": statistics.median(times[mode]),
                     "seconds_all": times[mode], "wire_seconds": wire_s,
                     "pause_seconds": statistics.median(pauses[mode]),
                     "steps_during_sync": decoded[mode],
                     "second_copy_fits": fits})
    return rows


def _barrier(chan, name: str) -> None:
    chan.client.wait_at_barrier(f"weight_sync/{name}", timeout_in_ms=600_000)


def _worker(args) -> None:
    address, process_id = args.worker[0], int(args.worker[1])
    from jaxrlhf import distributed
    from jaxrlhf.backend import use_cpu_devices

    cfg = distributed.from_flags(address, args.processes, process_id, heartbeat_timeout_s=30,
                                 wait_timeout_s=args.timeout)
    use_cpu_devices(distributed.cpu_devices_per_process(DEVICES, cfg))
    distributed.initialize(cfg)
    import jax

    if args.transfer_size:
        jax.config.update("jax_cross_host_transfer_transfer_size", args.transfer_size)
    from jaxrlhf.run.channel import Channel

    chan = Channel("weight_sync")
    for size in args.sizes.split(","):
        for case in args.cases.split(","):
            rows = _case(chan, args, size, case, args.rounds)
            # The generator's seconds are its pause; the trainer's side holds the wire.
            chan.put(f"rows/{size}/{case}/{jax.process_index()}", {"rows": rows})
            if jax.process_index() == 0:  # each case's rows as they come (a timeout keeps them)
                with open(args.out, "a") as out:
                    out.writelines(json.dumps(row) + "\n" for row in _merge(chan, args, rows))
                print(f"weight_sync: {size} {case} done", file=sys.stderr, flush=True)


def _merge(chan, args, rows0: list[dict]) -> list[dict]:
    """Process 0's rows with the generator's seconds (the pause) and the wire's GB/s."""
    import jax

    out = []
    gen = jax.process_count() // 2
    for row in rows0:
        theirs = None
        while theirs is None:
            theirs = chan.take(f"rows/{row['size']}/{row['case']}/{gen}")
            time.sleep(0.01)
        mine = [r for r in theirs["rows"] if r["path"] == row["path"]][0]
        chan.put(f"rows/{row['size']}/{row['case']}/{gen}", theirs)
        seconds = max(row["seconds"], mine["seconds"])  # done when both sides are
        gbps = row["need_bytes"] / seconds / 1e9
        wire_gbps = row["need_bytes"] / row["wire_seconds"] / 1e9
        out.append({**row, "seconds": seconds, "trainer_seconds": row["seconds"],
                    "pause_seconds": mine["pause_seconds"],
                    "steps_during_sync": mine["steps_during_sync"],
                    "second_copy_fits": mine["second_copy_fits"],
                    "gbps": gbps, "wire_gbps": wire_gbps,
                    "of_wire": gbps / wire_gbps,
                    "bytes_vs_need": row["wire_bytes"] / row["need_bytes"]})
    return out


# (model, cluster file, generator's strategy on the second half: tensor within a host, data
# across hosts). The trainer holds the first half, fsdp over all of it.
PREDICTIONS = [(model, cluster, gen) for model in ("qwen3-4b", "llama-3.1-8b", "llama3-70b")
               for cluster, gen in (("meshes/h100_16x8.py", dict(data=8, tensor=8)),
                                    ("meshes/tpu_v5p_128.py", dict(data=8, tensor=4)))]


def predict() -> list[dict]:
    """The planner's price of one full sync in bf16 for each of PREDICTIONS."""
    from jaxrlhf.models.sizes import get_size, param_count
    from jaxrlhf.parallel.strategy import DeviceRange
    from jaxrlhf.plan.choice import CallChoice
    from jaxrlhf.plan.cluster import load_cluster
    from jaxrlhf.plan.weight_sync import sync_price

    rows = []
    for model, path, gen in PREDICTIONS:
        cluster = load_cluster(str(REPO / path))
        half = cluster.num_devices // 2
        train = CallChoice(DeviceRange(0, half - 1), fsdp=half)
        generator = CallChoice(DeviceRange(half, 2 * half - 1), **gen)
        price = sync_price(2 * param_count(get_size(model)), train, generator, cluster)
        rows.append({"model": model, "cluster": cluster.name, "gen": generator.axes_str(),
                     "bytes_per_host": price.bytes_per_host, "gen_hosts": price.gen_hosts,
                     "total_bytes": price.total_bytes, "host_gbps": price.host_bandwidth / 1e9,
                     "seconds": price.seconds})
    return rows


def main(argv=None) -> None:
    args = _args(argv)
    if args.predict:
        rows = predict()
        for row in rows:
            print(json.dumps(row))
        print(f"{'model':<14}{'cluster':<14}{'generator':<12}{'GB/host':>9}{'hosts':>6}"
              f"{'GB/s/host':>10}{'s':>8}")
        for r in rows:
            print(f"{r['model']:<14}{r['cluster']:<14}{r['gen']:<12}"
                  f"{r['bytes_per_host'] / 1e9:>9.2f}{r['gen_hosts']:>6}{r['host_gbps']:>10.0f}"
                  f"{r['seconds']:>8.3f}")
        return
    if args.worker:
        _worker(args)
        return
    from jaxrlhf.distributed import reserve_port

    out = pathlib.Path(f"/tmp/weight_sync_{os.getpid()}.json")
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env.update(JAX_PLATFORMS="cpu", PYTHONPATH=str(REPO))
    if not args.keep_freed:
        # glibc's default malloc: memory freed between the paths goes back (the run stack's
        # keep-freed setting would hold every path's peak at once), but every buffer bigger
        # than 128 KiB is then a fresh mmap, paged in anew on each sync.
        env["GLIBC_TUNABLES"] = env.get("GLIBC_TUNABLES", "glibc.malloc.trim_threshold=33554432")
    with reserve_port() as sock:
        address = f"127.0.0.1:{sock.getsockname()[1]}"
        extra = [a for a in (argv or sys.argv[1:]) if not a.startswith("--out")]
        procs = [subprocess.Popen([sys.executable, __file__, *extra, "--worker", address, str(i),
                                   f"--out={out}"], env=env)
                 for i in range(args.processes)]
        try:
            for p in procs:
                p.wait(timeout=args.timeout)
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
    rows = [json.loads(line) for line in out.read_text().splitlines()] if out.exists() else []
    for row in rows:
        print(json.dumps(row))
    print(f"{'size':<14}{'case':<22}{'path':<8}{'wire MB':>9}{'need MB':>9}{'/dev MB':>9}"
          f"{'bytes/need':>11}{'s':>8}{'GB/s':>7}{'wire':>7}{'of wire':>8}{'pause s':>8}")
    for r in rows:
        print(f"{r['size']:<14}{r['case']:<22}{r['path']:<8}{r['wire_bytes'] / 1e6:>9.1f}"
              f"{r['need_bytes'] / 1e6:>9.1f}{r['per_device_bytes'] / 1e6:>9.1f}"
              f"{r['bytes_vs_need']:>11.3f}{r['seconds']:>8.3f}{r['gbps']:>7.2f}"
              f"{r['wire_gbps']:>7.2f}{r['of_wire']:>8.2f}{r['pause_seconds']:>8.3f}")
    if any(p.returncode for p in procs):
        sys.exit(f"weight_sync: a worker failed or ran out of time "
                 f"({[p.returncode for p in procs]}); the rows above are the cases it finished")


if __name__ == "__main__":
    main()
