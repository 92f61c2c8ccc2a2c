"""A TPU v5e-256 pod: 256 chips on a 16×16 2D ICI torus, 64 hosts × 4 chips.

Google's published v5e figures per chip: 197 TFLOP/s dense bf16, 16 GB HBM2 at 819 GB/s, ICI
1,600 Gb/s over 4 links (50 GB/s each way per link), so a ring along one torus axis uses two
links: 100 GB/s. libtpu reports 15.75 GiB a program may use, and compiles a program of several
chips only over the whole slice (its "limited ICI routing": `whole_slice`). Host link and
efficiencies are the same uncalibrated defaults as the v5p files."""

from jaxrlhf.plan.cluster import Cluster, Platform


def get_cluster() -> Cluster:
    return Cluster(
        name="tpu_v5e_256",
        hosts=64,
        devices_per_host=4,
        hbm_bytes=16 * 2**30,  # 16 GiB; libtpu lets a program use 15.75 GiB
        peak_bf16_flops=197e12,
        hbm_bandwidth=819e9,
        intra_host_bandwidth=100e9,
        inter_host_bandwidth=100e9,
        host_link_bandwidth=25e9,
        intra_host_latency=5e-6,
        inter_host_latency=5e-6,
        layer_overhead=0.0,  # the decode loop is one compiled program on TPU
        matmul_efficiency=0.55,
        hbm_efficiency=0.75,
        comm_efficiency=0.7,
        platform=Platform.TPU,
        topology="v5e:16x16",
        whole_slice=True,
    )
