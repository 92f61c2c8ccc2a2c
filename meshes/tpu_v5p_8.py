"""One TPU v5p-8 host: 4 chips (JAX sees one device per chip, megacore) on a 2×2×1 piece of the
ICI torus, 96 GiB HBM per chip. The smallest v5p slice: the default suite compiles the tiny
configs for it (`plan --compile`), so a change that breaks TPU lowering fails on any host."""

from jaxrlhf.plan.cluster import Cluster, Platform


def get_cluster() -> Cluster:
    return Cluster(
        name="tpu_v5p_8",
        hosts=1,
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
        topology="v5p:2x2x1",
    )
