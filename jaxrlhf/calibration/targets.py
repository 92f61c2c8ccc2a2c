"""The devices a cluster's calls are compiled for without them: XLA's description of its hardware.

libtpu describes a TPU slice by its topology name (`Cluster.topology`,
`jax.experimental.topologies.get_topology_desc`): a CPU host then compiles what that slice would
run (`calibration/aot.py`). The figures the compiler itself reports (how much HBM a program may
use) are read here too, to check the cluster file's against them.
"""

from __future__ import annotations

import importlib.util
import re
from collections.abc import Sequence

import jax
import jax.numpy as jnp

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
      CompileError: the cluster names no topology, its compiler is not installed, or the
        topology's devices are not the cluster's hosts × devices per host.
    """
    if cluster.platform is not Platform.TPU or not cluster.topology:
        raise CompileError(f"--cluster: {cluster.name} names no TPU topology to compile for "
                           f"(Cluster.topology); the meshes/tpu_*.py files do")
    from jax.experimental import topologies

    if importlib.util.find_spec("libtpu") is None:  # the TPU compiler
        raise CompileError('compiling for a TPU needs libtpu: pip install -e ".[tpu]"')
    topology = topologies.get_topology_desc(platform="tpu", topology_name=cluster.topology)
    devices = list(topology.devices)
    hosts = {d.process_index for d in devices}
    if (len(hosts), len(devices)) != (cluster.hosts, cluster.num_devices):
        raise CompileError(
            f"--cluster: {cluster.name} has {cluster.hosts} hosts × {cluster.devices_per_host} "
            f"devices, but libtpu's {cluster.topology} has {len(hosts)} hosts and "
            f"{len(devices)} devices")
    return devices


def reported_hbm_bytes(devices: Sequence[jax.Device]) -> int | None:
    """The HBM a program may use on one of `devices`, as their compiler reports it: compiles a
    program that needs more than any device has and reads the limit off the refusal
    ("... exceeds available HBM (95.74G)"); None where the message says no figure."""
    sharding = jax.sharding.SingleDeviceSharding(devices[0])
    huge = jax.ShapeDtypeStruct((1 << 40,), jnp.int8, sharding=sharding)
    try:
        jax.jit(lambda x: x + 1).lower(huge).compile()
    except Exception as e:  # XLA's RESOURCE_EXHAUSTED, as a runtime error of jaxlib
        found = re.search(r"available HBM \(([\d.]+)([KMGT])\)", str(e))
        if found:
            return int(float(found.group(1)) * 1024 ** " KMGT".index(found.group(2)))
    return None


