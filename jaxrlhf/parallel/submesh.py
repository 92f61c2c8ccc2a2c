"""Carving a cluster into sub-meshes, by ReaL's rule.

A legal sub-mesh is either
  * 1, 2, 4, 8, ... (a power of two) devices inside one host, starting at a multiple of its size
    (so sub-meshes nest and never straddle a host boundary), or
  * a run of whole hosts.
Devices are indexed globally in host order (grouped by `device.process_index`), so a device
range such as `8-15` on a 2×8 cluster is the whole second host.

The planner enumerates candidates with `legal_submeshes`; layouts validate their range with
`check_submesh`.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence

import jax
import numpy as np
from jax.experimental import mesh_utils

from jaxrlhf.parallel.strategy import DeviceRange


@dataclasses.dataclass(frozen=True)
class ClusterShape:
    """`num_hosts` hosts with `devices_per_host` accelerators each."""

    num_hosts: int
    devices_per_host: int

    @property
    def num_devices(self) -> int:
        return self.num_hosts * self.devices_per_host


def group_by_host(devices: Sequence[jax.Device]) -> list[list[jax.Device]]:
    """Devices grouped by process (host), hosts in process order, devices in id order."""
    by_host = sorted(devices, key=lambda d: (d.process_index, d.id))
    return [list(group) for _, group in itertools.groupby(by_host, key=lambda d: d.process_index)]


def cluster_devices(devices: Sequence[jax.Device] | None = None) -> list[jax.Device]:
    """The global device order that device ranges index into: host by host, id within host."""
    hosts = group_by_host(jax.devices() if devices is None else devices)
    return [device for host in hosts for device in host]


def cluster_shape(devices: Sequence[jax.Device]) -> ClusterShape:
    hosts = group_by_host(devices)
    sizes = {len(host) for host in hosts}
    if len(sizes) != 1:
        raise ValueError(f"hosts have unequal device counts {sorted(sizes)}")
    return ClusterShape(num_hosts=len(hosts), devices_per_host=sizes.pop())


def _is_power_of_two(n: int) -> bool:
    return n >= 1 and n & (n - 1) == 0


def check_submesh(cluster: ClusterShape, devices: DeviceRange) -> None:
    """Raises a one-line ValueError unless `devices` is a legal sub-mesh of `cluster`."""
    per_host = cluster.devices_per_host
    if devices.last >= cluster.num_devices:
        raise ValueError(
            f"device range {devices} is out of bounds for {cluster.num_devices} devices"
        )
    if devices.first % per_host == 0 and devices.size % per_host == 0:
        return  # whole hosts
    if devices.size > per_host:
        raise ValueError(
            f"device range {devices} spans more than one host ({per_host} devices each) "
            f"but does not cover whole hosts"
        )
    if not _is_power_of_two(devices.size) or per_host % devices.size:
        raise ValueError(
            f"device range {devices} has {devices.size} devices; a sub-mesh inside a host must "
            f"have a power-of-two size dividing {per_host}"
        )
    if devices.first % devices.size:
        raise ValueError(
            f"device range {devices} is not aligned: it must start at a multiple of its "
            f"size {devices.size}"
        )


def legal_submeshes(cluster: ClusterShape) -> list[DeviceRange]:
    """Every legal sub-mesh of `cluster`, smallest first."""
    per_host = cluster.devices_per_host
    found: list[DeviceRange] = []
    size = 1
    while size < per_host:
        if per_host % size == 0:
            found += [
                DeviceRange(start, start + size - 1)
                for start in range(0, cluster.num_devices, size)
            ]
        size *= 2
    for num_hosts in range(1, cluster.num_hosts + 1):
        found += [
            DeviceRange(host * per_host, (host + num_hosts) * per_host - 1)
            for host in range(cluster.num_hosts - num_hosts + 1)
        ]
    return found


def mesh_devices(
    all_devices: Sequence[jax.Device], devices: DeviceRange, mesh_shape: tuple[int, ...]
) -> np.ndarray:
    """The device array of a mesh of `mesh_shape` over `all_devices[devices]`.

    When the range is the whole device list, `mesh_utils.create_device_mesh` picks an order
    that follows the physical interconnect (TPU torus, GPU NVLink islands); where a mesh axis
    is no product of whole torus axes (t2 on a 4×4×4 slice) it may split one. For a strict
    subset that helper does not apply, and a plain reshape keeps neighbouring devices on the
    fastest (last, tensor) axis.
    """
    chosen = [all_devices[i] for i in devices.indices()]
    if len(chosen) == len(all_devices):
        return mesh_utils.create_device_mesh(mesh_shape, devices=chosen,
                                             allow_split_physical_axes=True)
    return np.asarray(chosen, dtype=object).reshape(mesh_shape)
