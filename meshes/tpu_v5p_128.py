"""A TPU v5p-128 slice: 128 TensorCores = 64 chips (JAX sees one device per chip, megacore),
16 hosts × 4 chips, 96 GiB HBM per chip (Google writes 95 GB; libtpu lets a program use 95.74
GiB). Every chip sits on the 3D-torus ICI, so crossing a host
boundary costs no extra bandwidth; a ring along one torus axis uses two 100 GB/s links."""

from jaxrlhf.plan.cluster import Cluster, Platform


def get_cluster() -> Cluster:
    return Cluster(
        name="tpu_v5p_128",
        hosts=16,
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
        topology="v5p:4x4x4",
    )
