"""A TPU v6e (Trillium) 256-chip pod: a 16×16 2D ICI torus, 64 hosts × 4 chips.

Google's published v6e figures per chip: 918 TFLOP/s dense bf16, 32 GB HBM at 1,640 GB/s, ICI
3,584 Gb/s over 4 links (112 GB/s each way per link), so a ring along one torus axis uses two:
224 GB/s. libtpu reports 31.25 GiB a program may use. Host link and efficiencies are the same
uncalibrated defaults as the v5p files."""

from jaxrlhf.plan.cluster import Cluster, Platform


def get_cluster() -> Cluster:
    return Cluster(
        name="tpu_v6e_256",
        hosts=64,
        devices_per_host=4,
        hbm_bytes=32 * 2**30,  # 32 GiB; libtpu lets a program use 31.25 GiB
        peak_bf16_flops=918e12,
        hbm_bandwidth=1.64e12,
        intra_host_bandwidth=224e9,
        inter_host_bandwidth=224e9,
        host_link_bandwidth=25e9,
        intra_host_latency=5e-6,
        inter_host_latency=5e-6,
        layer_overhead=0.0,  # the decode loop is one compiled program on TPU
        matmul_efficiency=0.55,
        hbm_efficiency=0.75,
        comm_efficiency=0.7,
        platform=Platform.TPU,
        topology="v6e:16x16",
    )
