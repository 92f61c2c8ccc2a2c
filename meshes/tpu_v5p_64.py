"""A TPU v5p-64 slice: 32 chips (JAX sees one device per chip, megacore) on a 2×4×4 piece of
the 3D ICI torus, 8 hosts × 4 chips, 96 GiB HBM per chip (libtpu lets a program use 95.74
GiB). Figures as `tpu_v5p_128.py`: 459 TFLOP/s dense bf16, 2.765 TB/s HBM, 6 ICI links of
100 GB/s each way, so a ring along one torus axis uses two (200 GB/s); every chip sits on the
torus, so crossing a host costs no extra bandwidth. The efficiencies are the same uncalibrated
defaults."""

from jaxrlhf.plan.cluster import Cluster, Platform


def get_cluster() -> Cluster:
    return Cluster(
        name="tpu_v5p_64",
        hosts=8,
        devices_per_host=4,
        hbm_bytes=96 * 2**30,  # 96 GiB; libtpu lets a program use 95.74 GiB
        peak_bf16_flops=459e12,
        hbm_bandwidth=2.765e12,
        intra_host_bandwidth=200e9,
        inter_host_bandwidth=200e9,
        host_link_bandwidth=25e9,
        intra_host_latency=5e-6,
        inter_host_latency=5e-6,
        layer_overhead=0.0,  # the decode loop is one compiled program on TPU
        matmul_efficiency=0.55,
        hbm_efficiency=0.75,
        comm_efficiency=0.7,
        platform=Platform.TPU,
        topology="v5p:2x4x4",
    )
