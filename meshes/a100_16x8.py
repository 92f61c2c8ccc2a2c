"""ReaL's A100 cluster: 16 hosts × 8 A100-SXM4-80GB, NVLink 3 inside a host, 8 × 200 Gb/s
HDR InfiniBand per host (25 GB/s per GPU) between hosts, PCIe 4 to host memory."""

from jaxrlhf.plan.cluster import Cluster


def get_cluster() -> Cluster:
    return Cluster(
        name="a100_16x8",
        hosts=16,
        devices_per_host=8,
        hbm_bytes=80 * 10**9,
        peak_bf16_flops=312e12,
        hbm_bandwidth=2.039e12,
        intra_host_bandwidth=300e9,  # NVLink 3: 600 GB/s bidirectional
        inter_host_bandwidth=25e9,
        host_link_bandwidth=25e9,  # PCIe 4.0 x16: 32 GB/s each way peak, ~25 achieved
        intra_host_latency=5e-6,
        inter_host_latency=20e-6,
        layer_overhead=40e-6,  # ~10 kernel launches per layer without CUDA graphs
        matmul_efficiency=0.5,
        hbm_efficiency=0.7,
        comm_efficiency=0.7,
    )
