"""One H100-SXM5-80GB (a single-device development box).

Published NVIDIA figures: 989 TFLOP/s dense bf16 (the 1,979 on the datasheet assumes 2:4
sparsity), 3.35 TB/s HBM3, 80 GB.
"""

from jaxrlhf.plan.cluster import Cluster


def get_cluster() -> Cluster:
    return Cluster(
        name="h100_1",
        hosts=1,
        devices_per_host=1,
        hbm_bytes=80 * 10**9,
        peak_bf16_flops=989e12,
        hbm_bandwidth=3.35e12,
        intra_host_bandwidth=450e9,  # unused with one device
        inter_host_bandwidth=50e9,  # unused with one host
        host_link_bandwidth=50e9,  # PCIe Gen5 x16: 64 GB/s each way peak, ~50 achieved
        layer_overhead=30e-6,
        matmul_efficiency=0.45,
        hbm_efficiency=0.7,
        comm_efficiency=0.7,
        topology="1x1x1",  # one GPU
        target_config="h100_sxm.txtpb",  # `plan --compile`: XLA's description of the GPU
    )
