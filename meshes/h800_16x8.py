"""ReaL's H800 cluster: 16 hosts × 8 H800-SXM5-80GB, NVLink 4 at 400 GB/s bidirectional (the
export-limited H100), 8 × 400 Gb/s NDR InfiniBand per host (50 GB/s per GPU), PCIe 5."""

from jaxrlhf.plan.cluster import Cluster


def get_cluster() -> Cluster:
    return Cluster(
        name="h800_16x8",
        hosts=16,
        devices_per_host=8,
        hbm_bytes=80 * 10**9,
        peak_bf16_flops=989e12,
        hbm_bandwidth=3.35e12,
        intra_host_bandwidth=200e9,
        inter_host_bandwidth=50e9,
        host_link_bandwidth=50e9,  # PCIe Gen5 x16: 64 GB/s each way peak, ~50 achieved
        intra_host_latency=5e-6,
        inter_host_latency=20e-6,
        layer_overhead=30e-6,
        matmul_efficiency=0.45,
        hbm_efficiency=0.7,
        comm_efficiency=0.7,
    )
