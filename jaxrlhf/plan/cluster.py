"""What the planner knows about a cluster: hosts, devices, memory, speeds, efficiencies.

A cluster file (`meshes/a100_16x8.py`, ...) defines `get_cluster()` returning a frozen `Cluster`.
Its efficiency factors and overheads are defaults; a calibration file (JSON, written by
`--calibrate` from measured MFC times, see `cost.fit_calibration`) overrides them.
`load_cluster` looks for `<workdir>/calibration/NAME.json` first, then
`meshes/calibration/NAME.json` beside the cluster file.

Units: bytes, seconds, FLOP/s, bytes/s. Bandwidths are per device and per direction: what one
device can push into one link while every device does the same (so an inter-host figure is the
host's network bandwidth divided by its devices).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import pathlib

from jaxrlhf import shipped
from jaxrlhf.parallel.layout import Platform
from jaxrlhf.parallel.submesh import ClusterShape, check_submesh, legal_submeshes
from jaxrlhf.parallel.strategy import DeviceRange


OVERHEADS = ("layer_overhead", "call_overhead", "array_overhead")


@dataclasses.dataclass(frozen=True)
class Calibration:
    """Fitted efficiency factors (achieved / peak for matmuls, HBM streaming and collectives)
    and overheads (seconds per layer launch, jit call and per-array operation; None keeps the
    cluster file's)."""

    matmul_efficiency: float
    hbm_efficiency: float
    comm_efficiency: float
    source: str = ""  # how it was obtained, e.g. "fit on 12 MFC timings, 2025-01-01"
    layer_overhead: float | None = None
    call_overhead: float | None = None
    array_overhead: float | None = None

    def __post_init__(self):
        for field in ("matmul_efficiency", "hbm_efficiency", "comm_efficiency"):
            value = getattr(self, field)
            if not 0.0 < value <= 1.0:
                raise ValueError(f"calibration {field}={value} must lie in (0, 1]")
        for field in OVERHEADS:
            value = getattr(self, field)
            if value is not None and value < 0:
                raise ValueError(f"calibration {field}={value} must be >= 0 seconds")

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "Calibration":
        return cls(**json.loads(text))


# A cluster's physical figures: zero or below describes no hardware, and would price every plan
# as free or as never fitting (a negative hbm_bytes "does not fit: needs 0.00 GiB").
_POSITIVE_FIGURES = ("hbm_bytes", "peak_bf16_flops", "hbm_bandwidth", "intra_host_bandwidth",
                     "inter_host_bandwidth", "host_link_bandwidth")


@dataclasses.dataclass(frozen=True)
class Cluster:
    """A homogeneous cluster of `hosts` × `devices_per_host` accelerators.

    Attributes:
      name: names the calibration file.
      hosts, devices_per_host: the grid; devices are indexed host by host.
      hbm_bytes: device memory per device.
      peak_bf16_flops: dense bf16 matmul peak per device.
      hbm_bandwidth: device memory bandwidth.
      intra_host_bandwidth: device-to-device bandwidth inside a host (NVLink, ICI).
      inter_host_bandwidth: device-to-device bandwidth across hosts (per device share of the NIC).
      host_link_bandwidth: device <-> host memory (PCIe), for offload and staging.
      intra_host_latency, inter_host_latency: per collective hop (alpha of the alpha-beta model).
      layer_overhead: seconds of kernel launch and dispatch per decoder layer per forward pass;
        it matters only when a pass is tiny (one decode step), where it is ReaL's CUDA-graph gap.
      call_overhead: seconds of host work per jit call (dispatch, argument handling, waiting for
        the result); it matters only for small models.
      array_overhead: seconds per parameter array the optimizer updates or a movement moves,
        beside the bytes (kernel launches or transfer calls per array).
      usable_hbm_fraction: share of hbm_bytes a plan may fill (allocator, XLA workspace).
      matmul_efficiency, hbm_efficiency, comm_efficiency: achieved / peak; calibrated, as are
        the two overheads.
      calibration_source: where the calibrated values came from ("" for the file's defaults).
      platform: the backend of the devices, where the runtime makes choices of its own that
        the memory model counts: on XLA:CPU and XLA:GPU generation decodes layer by layer on a
        copy of the layer weights (`engine.decoding.decodes_layer_by_layer`); on XLA:CPU
        (virtual devices) a pipeline copies each stage's weights.
      topology: the devices as XLA's compiler knows them, so that `plan --compile` compiles
        every call for them from any host; their devices must be `hosts` × `devices_per_host`.
        On TPU, libtpu's topology name ("v5p:4x4x4", chips along each torus axis); on GPU,
        XLA's "PARTITIONSxHOSTSxDEVICES": NVLink domains × hosts in each × GPUs per host
        ("16x1x8": 16 HGX hosts, each its own NVLink domain of 8). "" where the cluster has none.
      target_config: on GPU, the file under `meshes/gpu_targets/` that describes one GPU to
        XLA's compiler ("h100_sxm.txtpb": SMs, compute capability, memory, caches, clocks;
        `calibration/targets.py` reads it); "" where the cluster has none.
      whole_slice: a program of several devices must span all of them: libtpu compiles a
        v5e slice's programs (its "limited ICI routing") for one chip or for the whole slice,
        never for part of it ("device assignment should include all slice devices").
    """

    name: str
    hosts: int
    devices_per_host: int
    hbm_bytes: int
    peak_bf16_flops: float
    hbm_bandwidth: float
    intra_host_bandwidth: float
    inter_host_bandwidth: float
    host_link_bandwidth: float
    intra_host_latency: float = 5e-6
    inter_host_latency: float = 20e-6
    layer_overhead: float = 0.0
    call_overhead: float = 0.0
    array_overhead: float = 0.0
    usable_hbm_fraction: float = 0.9
    matmul_efficiency: float = 0.5
    hbm_efficiency: float = 0.7
    comm_efficiency: float = 0.7
    calibration_source: str = ""
    platform: Platform = Platform.GPU
    topology: str = ""
    target_config: str = ""
    whole_slice: bool = False

    @property
    def cpu(self) -> bool:
        return self.platform is Platform.CPU

    def __post_init__(self):
        if self.hosts < 1 or self.devices_per_host < 1:
            raise ValueError(f"cluster {self.name}: needs at least one host and one device")
        for field in _POSITIVE_FIGURES:
            if not getattr(self, field) > 0:  # `not >` also refuses NaN
                raise ValueError(f"cluster {self.name}: {field} must be positive, "
                                 f"got {getattr(self, field)}")
        if not 0 < self.usable_hbm_fraction <= 1:
            raise ValueError(f"cluster {self.name}: usable_hbm_fraction must be in (0, 1], "
                             f"got {self.usable_hbm_fraction}")
        if self.target_config and self.platform is not Platform.GPU:
            raise ValueError(f"cluster {self.name}: target_config describes a GPU, but the "
                             f"platform is {self.platform.value}")
        self.calibration()  # validates the efficiencies and overheads

    @property
    def num_devices(self) -> int:
        return self.hosts * self.devices_per_host

    @property
    def shape(self) -> ClusterShape:
        return ClusterShape(num_hosts=self.hosts, devices_per_host=self.devices_per_host)

    @property
    def usable_hbm_bytes(self) -> int:
        return int(self.hbm_bytes * self.usable_hbm_fraction)

    def check_devices(self, devices: DeviceRange) -> None:
        """Raises ValueError unless a call can run on `devices`: a legal sub-mesh
        (`parallel.submesh.check_submesh`), and on a `whole_slice` cluster one device or all."""
        check_submesh(self.shape, devices)
        if self.whole_slice and devices.size not in (1, self.num_devices):
            raise ValueError(f"{self.name} compiles a program of several devices only over "
                             f"all {self.num_devices} (whole_slice); {devices} is part of it")

    def device_ranges(self) -> list[DeviceRange]:
        """Every device range a call can run on (`check_devices`)."""
        return [r for r in legal_submeshes(self.shape)
                if not self.whole_slice or r.size in (1, self.num_devices)]

    def host_of(self, device: int) -> int:
        return device // self.devices_per_host

    def hosts_of(self, devices: DeviceRange) -> range:
        return range(self.host_of(devices.first), self.host_of(devices.last) + 1)

    def calibration(self) -> Calibration:
        return Calibration(self.matmul_efficiency, self.hbm_efficiency, self.comm_efficiency,
                           self.calibration_source,
                           **{name: getattr(self, name) for name in OVERHEADS})

    def calibrated(self, calibration: Calibration) -> "Cluster":
        c = calibration
        overheads = {name: getattr(c, name) for name in OVERHEADS if getattr(c, name) is not None}
        return dataclasses.replace(
            self, matmul_efficiency=c.matmul_efficiency, hbm_efficiency=c.hbm_efficiency,
            comm_efficiency=c.comm_efficiency, calibration_source=c.source, **overheads)


def _import_file(path: pathlib.Path):
    spec = importlib.util.spec_from_file_location(f"_cluster_{path.stem}", path)
    if spec is None or spec.loader is None:
        raise ValueError(f"cannot import cluster file {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def calibration_candidates(cluster_file: pathlib.Path, name: str,
                           workdir: str | None = None) -> list[pathlib.Path]:
    """Where a cluster's calibration may live, most specific first."""
    found = []
    if workdir:
        found.append(pathlib.Path(workdir) / "calibration" / f"{name}.json")
    found.append(cluster_file.parent / "calibration" / f"{name}.json")
    return found


def load_cluster(path: str, *, workdir: str | None = None,
                 calibration: str | None = None) -> Cluster:
    """Imports a cluster file and applies its calibration, if one exists.

    Args:
      path: a cluster file such as "meshes/a100_16x8.py" (a shipped one where the working
        directory holds no such file, `shipped.resolve`).
      workdir: a run directory whose `calibration/NAME.json` wins over the shipped one.
      calibration: an explicit calibration JSON file (must exist).
    """
    cluster_file = pathlib.Path(shipped.resolve(path))
    if not cluster_file.is_file():
        raise FileNotFoundError(f"cluster file {path!r} does not exist")
    module = _import_file(cluster_file)
    if not hasattr(module, "get_cluster"):
        raise ValueError(f"cluster file {path!r} defines no get_cluster()")
    cluster = module.get_cluster()
    if not isinstance(cluster, Cluster):
        raise TypeError(f"{path}: get_cluster() returned {type(cluster).__name__}, not Cluster")
    if calibration is not None:
        return cluster.calibrated(Calibration.from_json(pathlib.Path(calibration).read_text()))
    for candidate in calibration_candidates(cluster_file, cluster.name, workdir):
        if candidate.is_file():
            return cluster.calibrated(Calibration.from_json(candidate.read_text()))
    return cluster


def save_calibration(path: str | pathlib.Path, calibration: Calibration) -> pathlib.Path:
    """Writes a calibration JSON file (creating its folder)."""
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(calibration.to_json() + "\n")
    return path
