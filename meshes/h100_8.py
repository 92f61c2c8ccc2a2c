"""One host of 8 H100-SXM5-80GB on NVLink 4 (an HGX/DGX H100 box).

The figures are `h100_16x8.py`'s (NVIDIA's H100 datasheet and HGX H100 description): 989
TFLOP/s dense bf16 per GPU, 80 GB HBM3 at 3.35 TB/s, NVLink 4 at 450 GB/s each way through
NVSwitch (every GPU pair at full rate), PCIe Gen5 x16 to the host at 64 GB/s each way. With one
host nothing crosses InfiniBand. The efficiencies and overheads are the same uncalibrated
defaults; `--calibrate` on the machine replaces them.
"""

from jaxrlhf.plan.cluster import Cluster


def get_cluster() -> Cluster:
    return Cluster(
        name="h100_8",
        hosts=1,
        devices_per_host=8,
        hbm_bytes=80 * 10**9,
        peak_bf16_flops=989e12,
        hbm_bandwidth=3.35e12,
        intra_host_bandwidth=450e9,  # NVLink 4: 900 GB/s bidirectional
        inter_host_bandwidth=50e9,  # unused with one host
        host_link_bandwidth=64e9,  # PCIe Gen5 x16
        intra_host_latency=5e-6,
        inter_host_latency=20e-6,
        layer_overhead=30e-6,  # a few kernel launches per layer per pass, no CUDA graphs
        matmul_efficiency=0.45,
        hbm_efficiency=0.7,
        comm_efficiency=0.7,
        topology="1x1x8",  # one host, one NVLink domain of 8 GPUs
        target_config="h100_sxm.txtpb",  # `plan --compile`: XLA's description of the GPU
    )
