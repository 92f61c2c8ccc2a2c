"""This development machine: one host whose CPU is split into 8 virtual JAX devices
(`--xla_force_host_platform_device_count=8`). The figures are rough; calibrate with
`--calibrate` before trusting absolute times."""

from jaxrlhf.plan.cluster import Cluster, Platform


def get_cluster() -> Cluster:
    return Cluster(
        name="cpu_8",
        hosts=1,
        devices_per_host=8,
        hbm_bytes=2 * 10**9,  # a share of host RAM per virtual device
        peak_bf16_flops=20e9,
        hbm_bandwidth=5e9,
        intra_host_bandwidth=2e9,
        inter_host_bandwidth=2e9,  # unused with one host
        host_link_bandwidth=5e9,
        intra_host_latency=20e-6,
        inter_host_latency=20e-6,
        layer_overhead=100e-6,
        matmul_efficiency=0.5,
        hbm_efficiency=0.5,
        comm_efficiency=0.5,
        platform=Platform.CPU,
    )
