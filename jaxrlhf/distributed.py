"""Multi-process runs: `jax.distributed` from flags or the environment, before JAX starts.

One process per host (or, for tests and CPU runs, several processes on one machine) runs the
same command; `jax.distributed` connects them through a coordination service that process 0
hosts. Where the settings come from, first match wins:

  * flags `--coordinator_address=HOST:PORT --num_processes=N --process_id=I`,
  * the environment `JAXRLHF_COORDINATOR_ADDRESS`, `JAXRLHF_NUM_PROCESSES`,
    `JAXRLHF_PROCESS_ID` (what `launch/local.sh` sets),
  * `--coordinator_address=auto`: JAX detects them on SLURM, Cloud TPU pods and Open MPI,
  * nothing: a single process, no `jax.distributed` at all.

CPU backend: cross-process collectives use gloo, and a cross-process `device_put` (generation
on one host, training on another) uses JAX's socket transfer server, so each process gets a
transfer address (`JAXRLHF_TRANSFER_ADDRESS`, else a free port on the interface that reaches
the coordinator).

Failures never hang the survivors: the coordination service's heartbeat timeout is short
(`--heartbeat_timeout`, default 15 s), after which JAX terminates every other process with a
message naming the dead one ("tasks are unhealthy (stopped sending heartbeats): 1", or, when
process 0 died, that the coordination service — the leader task, process 0 — is gone). A
Python exception in one process must not leave the others waiting at JAX's exit barrier, so
`abort` exits at once without it and the heartbeat does the rest.
"""

from __future__ import annotations

import dataclasses
import enum
import importlib.util
import os
import socket
import sys

from jaxrlhf import backend

ENV_COORDINATOR = "JAXRLHF_COORDINATOR_ADDRESS"
ENV_NUM_PROCESSES = "JAXRLHF_NUM_PROCESSES"
ENV_PROCESS_ID = "JAXRLHF_PROCESS_ID"
ENV_TRANSFER_ADDRESS = "JAXRLHF_TRANSFER_ADDRESS"
AUTO = "auto"
_LOOPBACK = ("localhost", "127.0.0.1", "::1", "[::1]")


class DistributedError(ValueError):
    """Multi-process settings that cannot work (reported in one line by the entry point)."""


class LaunchKind(enum.Enum):
    SINGLE = "single"  # one process, no jax.distributed
    EXPLICIT = "explicit"  # coordinator, process count and id given
    AUTO = "auto"  # detected by JAX from the cluster environment (SLURM, TPU pod, Open MPI)


@dataclasses.dataclass(frozen=True)
class DistributedConfig:
    """How this process joins the job.

    Attributes:
      kind: single process, explicit settings or cluster auto-detection.
      coordinator_address: "HOST:PORT" of process 0's coordination service (EXPLICIT only).
      num_processes: processes in the job (1 for SINGLE, 0 = detected for AUTO).
      process_id: this process, 0..num_processes-1 (-1 = detected for AUTO).
      heartbeat_timeout_s: a process silent this long is declared dead and the job stops.
      init_timeout_s: how long to wait for every process to connect at start.
      shutdown_timeout_s: how long a finished process waits for the others at exit.
      wait_timeout_s: a cross-process wait (transfer, barrier, a step's device work) that lasts
        longer stops the job with a message naming it (`jaxrlhf.parallel.watchdog`).
    """

    kind: LaunchKind = LaunchKind.SINGLE
    coordinator_address: str = ""
    num_processes: int = 1
    process_id: int = 0
    heartbeat_timeout_s: int = 15
    init_timeout_s: int = 300
    shutdown_timeout_s: int = 120
    wait_timeout_s: float = 600.0

    @property
    def multi_process(self) -> bool:
        return self.kind is not LaunchKind.SINGLE


def _int_setting(flag_value: int | None, env: str, name: str) -> int | None:
    if flag_value is not None:
        return flag_value
    text = os.environ.get(env, "")
    if not text:
        return None
    try:
        return int(text)
    except ValueError:
        raise DistributedError(f"{name}: ${env}={text!r} is not an integer") from None


def from_flags(coordinator_address: str | None, num_processes: int | None,
               process_id: int | None, heartbeat_timeout_s: int = 15,
               wait_timeout_s: float = 600.0) -> DistributedConfig:
    """The settings from flags (None = not given) and the environment; validates them."""
    address = coordinator_address or os.environ.get(ENV_COORDINATOR, "")
    count = _int_setting(num_processes, ENV_NUM_PROCESSES, "--num_processes")
    index = _int_setting(process_id, ENV_PROCESS_ID, "--process_id")
    if heartbeat_timeout_s < 1:
        raise DistributedError(f"--heartbeat_timeout={heartbeat_timeout_s} must be at least 1 s")
    if wait_timeout_s <= 0:
        raise DistributedError(f"--wait_timeout={wait_timeout_s} must be positive")
    common = dict(heartbeat_timeout_s=heartbeat_timeout_s, wait_timeout_s=wait_timeout_s)
    if address == AUTO:
        if count is not None or index is not None:
            raise DistributedError("--coordinator_address=auto detects --num_processes and "
                                   "--process_id from the cluster; do not give them")
        return DistributedConfig(LaunchKind.AUTO, num_processes=0, process_id=-1, **common)
    if not address:
        if count not in (None, 1) or index not in (None, 0):
            raise DistributedError(f"--num_processes={count} --process_id={index} need "
                                   f"--coordinator_address=HOST:PORT (or ${ENV_COORDINATOR})")
        return DistributedConfig(**common)
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise DistributedError(f"--coordinator_address={address!r} is not HOST:PORT")
    if count is None or index is None:
        raise DistributedError(f"--coordinator_address={address} needs --num_processes and "
                               "--process_id")
    if count < 1:
        raise DistributedError(f"--num_processes={count} must be at least 1")
    if not 0 <= index < count:
        raise DistributedError(f"--process_id={index} is not in 0..{count - 1} "
                               f"(--num_processes={count})")
    if count == 1:
        return DistributedConfig(**common)
    return DistributedConfig(LaunchKind.EXPLICIT, address, count, index, **common)


def cpu_devices_per_process(total: int, cfg: DistributedConfig) -> int:
    """`cpu_devices` counts the whole job's CPU devices; each process holds an equal share.

    With `--coordinator_address=auto` the process count is unknown until JAX joins the job,
    so there `cpu_devices` is per process. On GPUs and TPUs it means nothing and is not split
    (a v5p-128 pod's 16 processes would not divide the default 8).
    """
    split = cfg.kind is LaunchKind.EXPLICIT and _cpu_backend()
    processes = cfg.num_processes if split else 1
    if total < 1 or total % processes:
        raise DistributedError(f"cpu_devices={total} does not split evenly over "
                               f"{processes} processes")
    return total // processes


def _local_address_towards(host: str) -> str:
    """This machine's address on the interface that routes to `host` (no packet is sent)."""
    if host.strip("[]") in _LOOPBACK:
        return "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((host.strip("[]"), 9))
        return probe.getsockname()[0]


# Sockets that hold this process's reserved ports for as long as it lives (see `reserve_port`).
_RESERVED: list[socket.socket] = []


def reserve_port(host: str = "127.0.0.1") -> socket.socket:
    """A bound socket holding a free port until it is closed, shareable only by SO_REUSEPORT.

    JAX's servers (the coordination service's gRPC server and the cross-host transfer server)
    bind their ports with SO_REUSEPORT, and the transfer server binds lazily, at the first
    cross-process `device_put`. Picking a free port and releasing it before they bind (what
    this module used to do) leaves a window, seconds to minutes long, in which another job's
    reuse-port server can take the same port; the two then silently share it, the kernel hands
    some connections to the wrong process and a transfer waits forever with every process
    idle (reproduced: the multi-process test hung this way under `pytest -n 2`). A port held by
    this socket cannot be taken by anyone but a SO_REUSEPORT bind of the same user, and nobody
    else picks it: the kernel never hands out a port in use. The socket does not listen, so it
    receives no connection of its own.
    """
    sock = socket.socket(socket.AF_INET6 if ":" in host.strip("[]") else socket.AF_INET,
                         socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host.strip("[]"), 0))
    return sock


def transfer_address(coordinator_address: str) -> str:
    """The "HOST:PORT" this process serves cross-process device_put from (port reserved)."""
    if os.environ.get(ENV_TRANSFER_ADDRESS):
        return os.environ[ENV_TRANSFER_ADDRESS]
    host = _local_address_towards(coordinator_address.rpartition(":")[0])
    # Port 0 handed to the transfer server itself hangs the first transfer (the peers are told
    # port 0), so the port is chosen here and held until the process ends.
    _RESERVED.append(reserve_port(host))
    return f"{host}:{_RESERVED[-1].getsockname()[1]}"


def initialize(cfg: DistributedConfig) -> None:
    """Joins the job (no-op for a single process). Must run before JAX starts a backend."""
    if not cfg.multi_process:
        return
    import jax
    from jax._src import distributed as jax_distributed  # the coordinator address JAX chose

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    explicit = cfg.kind is LaunchKind.EXPLICIT
    jax.distributed.initialize(
        coordinator_address=cfg.coordinator_address if explicit else None,
        num_processes=cfg.num_processes if explicit else None,
        process_id=cfg.process_id if explicit else None,
        initialization_timeout=cfg.init_timeout_s,
        heartbeat_timeout_seconds=cfg.heartbeat_timeout_s,
        shutdown_timeout_seconds=cfg.shutdown_timeout_s,
    )
    from jaxrlhf.parallel import watchdog

    # Not jax.process_index(): that would start the backend before the transfer address is set.
    watchdog.configure(cfg.wait_timeout_s, process=jax_distributed.global_state.process_id)
    if _cpu_backend():
        # Read by the backend when it starts, which is after initialize: the coordinator is
        # known. TPU and GPU plugins move arrays between hosts themselves.
        jax.config.update("jax_cross_host_transfer_socket_address",
                          transfer_address(jax_distributed.global_state.coordinator_address))
        backend.give_cpu_client_threads()


_ACCELERATOR_PLUGINS = ("libtpu", "jax_cuda12_plugin", "jax_cuda13_plugin", "jax_rocm7_plugin")


def _cpu_backend() -> bool:
    """Whether JAX will run on the CPU backend (asked before any backend starts)."""
    platforms = os.environ.get("JAX_PLATFORMS", "")
    if platforms:
        return platforms.split(",")[0].strip() == "cpu"
    return not any(importlib.util.find_spec(name) for name in _ACCELERATOR_PLUGINS)


def process_index() -> int:
    import jax

    return jax.process_index()


def is_main_process() -> bool:
    """Process 0: the one that prints progress and writes metrics files."""
    return process_index() == 0


def dead_processes() -> list[int]:
    """Processes the coordination service no longer hears from ([] when it cannot tell)."""
    from jax._src import distributed as jax_distributed

    state = jax_distributed.global_state
    everyone = list(range(state.num_processes or 1))
    try:
        live = state.client.get_live_nodes(everyone)
    except Exception:  # noqa: BLE001 - the service itself is gone (process 0 died)
        return [0] if state.process_id else []
    return sorted(set(everyone) - set(live))


def failure_message(error: BaseException) -> str:
    """Why this process stops: a dead peer if there is one (its death usually caused `error`)."""
    dead = dead_processes()
    me = process_index()
    if dead:
        return (f"jaxrlhf: process {me} stops because process(es) {dead} died "
                f"({type(error).__name__}: {error})")
    return f"jaxrlhf: process {me} failed: {type(error).__name__}: {error}"


def abort(message: str, code: int = 1) -> None:
    """Prints `message` and exits at once, skipping JAX's exit barrier (multi-process only).

    The barrier would wait `shutdown_timeout_s` for processes that are themselves blocked in a
    collective with this one; exiting hard lets the heartbeat stop them within seconds.
    """
    print(message, file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(code)
