"""The devices a cluster's calls are compiled for without them: XLA's description of its hardware.

XLA compiles for devices it has only a description of (`jax.experimental.topologies`), so a CPU
host compiles what the cluster would run (`calibration/aot.py`):
  * TPU: libtpu describes a slice by its topology name (`Cluster.topology`, "v5p:4x4x4");
  * GPU: JAX's CUDA plugin describes `Cluster.topology` ("16x1x8": NVLink domains × hosts in
    each × GPUs per host) of GPUs that a target description names (`Cluster.target_config`, a
    `stream_executor.GpuTargetConfigProto` in text format under `meshes/gpu_targets/`: SMs,
    compute capability, memory, caches, clocks). No GPU and no CUDA driver is needed, only the
    plugin (the `[cuda]` extra).
The figures the compiler itself reports (how much HBM a program may use) are read here too, to
check the cluster file's against them.
"""

from __future__ import annotations

import importlib.util
import pathlib
import re
from collections.abc import Sequence

import jax
import jax.numpy as jnp

from jaxrlhf import shipped
from jaxrlhf.parallel.layout import Platform
from jaxrlhf.plan.cluster import Cluster

# libtpu reads these where a TPU VM's metadata server would answer; on any other host it
# prints a warning per unset one. None of them changes what is compiled for a topology.
TPU_HOST_ENV = {"TPU_SKIP_MDS_QUERY": "1", "TPU_WORKER_HOSTNAMES": "localhost",
                "TPU_ACCELERATOR_TYPE": "v5p-8",
                # compiling only: several processes may load it (the suite's workers)
                "ALLOW_MULTIPLE_LIBTPU_LOAD": "1"}


class CompileError(RuntimeError):
    """The cluster's devices cannot be described here (no topology, or no compiler for it)."""


def topology_devices(cluster: Cluster) -> list[jax.Device]:
    """The cluster's devices as XLA's compiler describes them, host by host.

    Raises:
      CompileError: the cluster describes no devices (a TPU's topology, a GPU's topology and
        target description), their compiler is not installed, XLA refuses the description, or
        the topology's devices are not the cluster's hosts × devices per host.
    """
    if cluster.platform is Platform.TPU and cluster.topology:
        devices = _tpu_devices(cluster)
    elif cluster.platform is Platform.GPU and cluster.topology and cluster.target_config:
        devices = _gpu_devices(cluster)
    else:
        raise CompileError(
            f"--cluster: {cluster.name} names no devices to compile for: a TPU topology "
            f"(Cluster.topology) or a GPU topology and target_config, as the meshes/tpu_*.py "
            f"and meshes/h100_*.py files do")
    hosts = {d.process_index for d in devices}
    if (len(hosts), len(devices)) != (cluster.hosts, cluster.num_devices):
        raise CompileError(
            f"--cluster: {cluster.name} has {cluster.hosts} hosts × {cluster.devices_per_host} "
            f"devices, but XLA's {cluster.topology} has {len(hosts)} hosts and "
            f"{len(devices)} devices")
    return devices


def _tpu_devices(cluster: Cluster) -> list[jax.Device]:
    from jax.experimental import topologies

    if importlib.util.find_spec("libtpu") is None:  # the TPU compiler
        raise CompileError('compiling for a TPU needs libtpu: pip install -e ".[tpu]"')
    return list(topologies.get_topology_desc(platform="tpu",
                                             topology_name=cluster.topology).devices)


def cuda_plugin_installed() -> bool:
    """Whether JAX's CUDA plugin (XLA's GPU compiler, for CUDA 12 or 13) is installed."""
    try:
        return any(importlib.util.find_spec(f"jax_plugins.xla_cuda{v}") for v in (12, 13))
    except ModuleNotFoundError:  # no jax_plugins namespace at all
        return False


def target_config_path(cluster: Cluster) -> pathlib.Path:
    """The file of the cluster's GPU description: `meshes/gpu_targets/NAME` of the working
    directory where there is one, else the shipped one (`shipped.resolve`)."""
    return pathlib.Path(shipped.resolve(f"meshes/gpu_targets/{cluster.target_config}"))


def _gpu_devices(cluster: Cluster) -> list[jax.Device]:
    from jax.experimental import topologies

    if not cuda_plugin_installed():
        raise CompileError("compiling for a GPU needs JAX's CUDA plugin: "
                           'pip install -e ".[cuda]"')
    path = target_config_path(cluster)
    if not path.is_file():
        raise CompileError(f"--cluster: {cluster.name}: no GPU description {path}")
    try:
        topology = topologies.get_topology_desc(
            cluster.name, "cuda", target_config=path.read_text(), topology=cluster.topology)
    except NotImplementedError:  # the plugin registered no "cuda" platform
        # It refuses to register where it finds no usable GPU, unless JAX may not use one.
        raise CompileError("JAX's CUDA plugin did not register: run with JAX_PLATFORMS=cpu "
                           "(a compile needs no GPU)") from None
    except jax.errors.JaxRuntimeError as e:  # a description XLA does not parse
        raise CompileError(f"--cluster: {cluster.name}: XLA refuses {path.name} or topology "
                           f"{cluster.topology!r}: {str(e).splitlines()[0]}") from None
    return list(topology.devices)


def reported_hbm_bytes(devices: Sequence[jax.Device]) -> int | None:
    """The HBM a program may use on one of `devices`, as their compiler reports it: compiles a
    program that needs more than any device has and reads the limit off the refusal
    ("... exceeds available HBM (95.74G)"); None where the message says no figure.

    None on GPU: XLA:GPU compiles a program of any size (its scheduler only logs that the
    arguments exceed its memory budget, 80% of the description's `device_memory_size`), so
    its compiler states no limit; the cluster file's usable HBM is the one there.
    """
    if devices[0].platform != "tpu":
        return None
    sharding = jax.sharding.SingleDeviceSharding(devices[0])
    huge = jax.ShapeDtypeStruct((1 << 40,), jnp.int8, sharding=sharding)
    try:
        jax.jit(lambda x: x + 1).lower(huge).compile()
    except Exception as e:  # XLA's RESOURCE_EXHAUSTED, as a runtime error of jaxlib
        found = re.search(r"available HBM \(([\d.]+)([KMGT])\)", str(e))
        if found:
            return int(float(found.group(1)) * 1024 ** " KMGT".index(found.group(2)))
    return None


