"""The search space: every choice the runtime can execute for one MFC.

A choice is a device range the cluster allows (`Cluster.device_ranges`: ReaL's legal
sub-meshes, `parallel.submesh.legal_submeshes`; one device or all on a `whole_slice` cluster),
degrees d × f × t × p × e equal to its size, and a micro-batch count, such that
  * t divides the devices per host (tensor groups never leave a host) and both head counts;
  * e (expert parallelism) is 1 for a dense model and divides a mixture's expert count;
  * p (pipeline stages) divides the number of layers (stages hold equal slices of the stack),
    and is 1 for a mixture of experts' train step;
  * the rows of one jit call (the batch, or one PPO mini-batch when training) split evenly into
    micro-batches and each micro-batch over d × e × f;
  * the MFC alone fits in device memory (its own parameters, state and activations).

`Menu` holds, per sub-mesh size, the configurations worth trying. A configuration's time and
memory do not depend on where its sub-mesh sits (sub-meshes are host-aligned), only its
reallocation costs do, and those depend only on (devices, f, t, p, e). So among configurations
with the same size, f, t, p and e, one that is no faster and no smaller than another is never
needed: `Menu` keeps the Pareto front of (seconds, bytes) in each (size, f, t, p, e) group. The pruning is
exact, since a plan's step time never grows when one MFC gets faster at equal memory.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

from jaxrlhf.mfc import MFC, Call
from jaxrlhf.models.config import ModelConfig
from jaxrlhf.parallel.layout import Platform
from jaxrlhf.parallel.strategy import DeviceRange
from jaxrlhf.plan.choice import CallChoice
from jaxrlhf.plan.cluster import Cluster
from jaxrlhf.plan.evaluate import Evaluator
from jaxrlhf.plan.profile import profile_of


@dataclasses.dataclass(frozen=True)
class SpaceOptions:
    """Knobs of the space: micro-batch counts to try (a pipeline of p stages needs about 2p and
    more to keep its bubble small), the largest pipeline degree, and whether to keep only
    Pareto configs (exact, see the module docstring; off only to check that claim)."""

    micro_batches: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)
    max_pipeline: int = 16
    prune: bool = True


@dataclasses.dataclass(frozen=True)
class Config:
    """A position-free choice: degrees and micro-batches."""

    data: int
    fsdp: int
    tensor: int
    micro_batches: int
    pipeline: int = 1
    expert: int = 1

    def at(self, devices: DeviceRange) -> CallChoice:
        return CallChoice(devices, self.data, self.fsdp, self.tensor, self.micro_batches,
                          self.pipeline, self.expert)

    @property
    def degrees(self) -> tuple[int, int, int, int, int]:
        return self.data, self.fsdp, self.tensor, self.pipeline, self.expert


def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def degrees(num_devices: int, cluster: Cluster, model: ModelConfig,
            max_pipeline: int = 1) -> Iterator[tuple[int, ...]]:
    """(d, f, t, p, e) with d·f·t·p·e = num_devices, a tensor degree the runtime accepts, a
    pipeline degree that divides the layers and an expert degree that divides the experts (1
    for a dense model)."""
    experts = model.moe.num_experts if model.moe is not None else 1
    for p in _divisors(num_devices):
        if p > max_pipeline or model.num_layers % p:
            continue
        for t in _divisors(num_devices // p):
            if (cluster.devices_per_host % t or model.num_heads % t or model.num_kv_heads % t):
                continue
            for e in _divisors(num_devices // (t * p)):
                if experts % e:
                    continue
                for f in _divisors(num_devices // (t * p * e)):
                    yield num_devices // (t * f * p * e), f, t, p, e


def configs(mfc: MFC, rows: int, num_devices: int, cluster: Cluster, model: ModelConfig,
            options: SpaceOptions) -> Iterator[Config]:
    """Degrees the runtime runs as priced (`runs_as_priced`) × micro-batches that split `rows`
    evenly."""
    for d, f, t, p, e in degrees(num_devices, cluster, model, options.max_pipeline):
        if not runs_as_priced(mfc, cluster, model, Config(d, f, t, 1, p, e)):
            continue
        for k in options.micro_batches:
            if rows % k == 0 and (rows // k) % (d * e * f) == 0:
                yield Config(d, f, t, k, p, e)


def runs_as_priced(mfc: MFC, cluster: Cluster, model: ModelConfig, config: Config) -> bool:
    """Whether the runtime takes `config`'s degrees for `mfc` and runs them as the cost and
    memory models price them: a mixture of experts trains without a pipeline
    (`engine.train_step`: its stages would not collect the router's losses), and its sparse
    blocks are partitioned (`_experts_partitioned`). Every plan the planner proposes, searched
    or a baseline's, asks this."""
    if model.moe is not None and mfc.call is Call.TRAIN_STEP and config.pipeline > 1:
        return False
    return _experts_partitioned(mfc, cluster, model, config)


def _experts_partitioned(mfc: MFC, cluster: Cluster, model: ModelConfig, config: Config) -> bool:
    """Whether a train step's or inference's sparse blocks run as priced: on an accelerator,
    under expert or tensor parallelism of the experts (`models.expert_parallel`, a shard_map:
    each device its own rows; t counts where it cuts the experts' width) or without data
    parallelism. Otherwise the block is left to XLA's SPMD partitioner, which does not split a
    grouped matmul's rows over the batch axes: Qwen3-30B-A3B's inference on f32 of a v5p-64
    took 54.6 GiB by XLA where its rows take 6.2, its train step on d8f4 202 GB (generation
    decodes in a shard_map of its own, `engine.rollout`)."""
    if model.moe is None or mfc.call is Call.GENERATE or cluster.platform is Platform.CPU:
        return True
    return (config.expert > 1 or config.data * config.fsdp == 1
            or profile_of(model).expert_tensor_ways(config.tensor) > 1)


def _pareto(entries: list[tuple[float, int, Config]]) -> list[Config]:
    """Configs not dominated in (seconds, bytes), fastest first."""
    kept, smallest = [], None
    for seconds, nbytes, config in sorted(entries, key=lambda e: (e[0], e[1])):
        if smallest is None or nbytes < smallest:
            kept.append(config)
            smallest = nbytes
    return kept


class Menu:
    """Per MFC: the legal sub-meshes by size, and the useful configs of each size."""

    def __init__(self, evaluator: Evaluator, options: SpaceOptions = SpaceOptions()):
        self.evaluator = evaluator
        experiment, cluster = evaluator.experiment, evaluator.cluster
        by_size: dict[int, list[DeviceRange]] = {}
        for devices in cluster.device_ranges():
            by_size.setdefault(devices.size, []).append(devices)
        self.ranges: dict[str, dict[int, list[DeviceRange]]] = {}
        self.configs: dict[str, dict[int, list[Config]]] = {}
        for mfc in experiment.model_mfcs():
            self.configs[mfc.name] = self._mfc_configs(mfc, by_size, options)
            self.ranges[mfc.name] = {n: by_size[n] for n in self.configs[mfc.name]}

    def _mfc_configs(self, mfc: MFC, by_size: dict[int, list[DeviceRange]],
                     options: SpaceOptions) -> dict[int, list[Config]]:
        experiment, cluster = self.evaluator.experiment, self.evaluator.cluster
        rows = experiment.workload.rows(mfc.call)
        found: dict[int, list[Config]] = {}
        for size, ranges in by_size.items():
            groups: dict[tuple[int, int], list] = {}
            for config in configs(mfc, rows, size, cluster, experiment.model(mfc.role), options):
                choice = config.at(ranges[0])
                nbytes = self.evaluator.own_memory(mfc, choice).total
                if nbytes > cluster.usable_hbm_bytes:
                    continue
                seconds = self.evaluator.mfc_seconds(mfc.name, choice)
                groups.setdefault(config.degrees[1:], []).append(
                    (seconds, nbytes, config))
            kept = [c for entries in groups.values()
                    for c in (_pareto(entries) if options.prune else [e[2] for e in entries])]
            if kept:
                found[size] = sorted(kept, key=lambda c: self.evaluator.mfc_seconds(
                    mfc.name, c.at(ranges[0])))
        return found

    def sizes(self, name: str) -> list[int]:
        return sorted(self.configs[name])

    def choices(self, name: str) -> Iterator[CallChoice]:
        """Every (range, config) of one MFC."""
        for size, configs_of_size in self.configs[name].items():
            for devices in self.ranges[name][size]:
                for config in configs_of_size:
                    yield config.at(devices)

    def count(self, name: str) -> int:
        return sum(len(self.ranges[name][n]) * len(c) for n, c in self.configs[name].items())

    def best(self, name: str, devices: DeviceRange) -> CallChoice | None:
        """The fastest config of `name` on `devices`, or None if none is legal there."""
        options = self.configs[name].get(devices.size)
        return options[0].at(devices) if options else None
