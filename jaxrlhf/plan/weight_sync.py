"""The price of one weight sync trainer -> generator, per version, from bytes and links.

When the actor's generation runs on devices of its own (disaggregated: trainer and generator
on disjoint hosts), every new version crosses the network to the generator, shard to shard
(`parallel/shard_transfer.py`): each generator host receives every distinct box its devices
hold once, in the generator's storage dtype, and its other devices holding the same box copy
it locally. The planner has no asynchronous timeline (the sync overlaps decoding there), so
this prices the sync's seconds on their own, printed per version beside the plan.

Bytes per generator host: the model in the generator's dtype, times the share of it a host's
devices hold. With the data axis outermost (the mesh order of `parallel/layout.py`), a host's
k devices hold k distinct shards of a model split m = fsdp x tensor x pipeline ways when
m >= k, and the whole model otherwise.

Seconds: the larger of the receivers' and the senders' time at the hosts' network bandwidth
(`devices_per_host` x the per-device inter-host share, `Cluster.inter_host_bandwidth`), times
the cluster's communication efficiency, plus one inter-host latency: every host pair streams
at once, and the trainer's hosts send what they hold (its model sharded over them).
"""

from __future__ import annotations

import dataclasses

from jaxrlhf.plan.choice import CallChoice
from jaxrlhf.plan.cluster import Cluster


@dataclasses.dataclass(frozen=True)
class SyncPrice:
    """One version's sync.

    Attributes:
      bytes_per_host: what each generator host receives.
      gen_hosts, train_hosts: hosts the generator's and the trainer's devices span.
      host_bandwidth: bytes/s one host's network moves each way (the link assumed).
      seconds: the sync's time at that bandwidth and the cluster's efficiency.
    """

    bytes_per_host: int
    gen_hosts: int
    train_hosts: int
    host_bandwidth: float
    seconds: float

    @property
    def total_bytes(self) -> int:
        return self.bytes_per_host * self.gen_hosts

    def describe(self) -> str:
        return (f"{self.bytes_per_host / 1e9:.2f} GB to each of {self.gen_hosts} generator "
                f"host(s) from {self.train_hosts} trainer host(s), {self.seconds:.3f} s at "
                f"{self.host_bandwidth / 1e9:.0f} GB/s per host")


def sync_price(model_bytes: int, train: CallChoice, gen: CallChoice,
               cluster: Cluster) -> SyncPrice | None:
    """The price of syncing `model_bytes` (the generator's copy, its dtype) from the trainer's
    devices to the generator's; None when they share devices (colocated: the plan's parameter
    reallocation prices that move)."""
    if train.overlaps(gen):
        return None
    gen_hosts = len(cluster.hosts_of(gen.devices))
    train_hosts = len(cluster.hosts_of(train.devices))
    per_host_devices = min(gen.devices.size, cluster.devices_per_host)
    split = gen.fsdp * gen.tensor * gen.pipeline
    bytes_per_host = model_bytes * min(split, per_host_devices) // split
    bandwidth = cluster.devices_per_host * cluster.inter_host_bandwidth
    effective = bandwidth * cluster.comm_efficiency
    receive = bytes_per_host / effective
    send = bytes_per_host * gen_hosts / (train_hosts * effective)
    seconds = max(receive, send) + cluster.inter_host_latency
    return SyncPrice(bytes_per_host, gen_hosts, train_hosts, bandwidth, seconds)
