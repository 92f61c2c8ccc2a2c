"""16 hosts × 8 H100-SXM5-80GB: NVLink 4 inside a host, 8 × 400 Gb/s InfiniBand per host.

The published figures behind each number (NVIDIA H100 Tensor Core GPU datasheet and the
DGX H100 / HGX H100 system descriptions):
  * 989 TFLOP/s dense bf16 per GPU (the datasheet's 1,979 counts 2:4 structured sparsity);
  * 80 GB HBM3 at 3.35 TB/s;
  * NVLink 4: 18 links, 900 GB/s per GPU in both directions together, so 450 GB/s each way
    (through NVSwitch, every GPU pair of a host at full rate);
  * 8 ConnectX-7 NICs at 400 Gb/s (NDR InfiniBand) per host, one per GPU: 50 GB/s per GPU
    each way between hosts;
  * PCIe Gen5 x16 to the host: 64 GB/s each way (offload and staging).
Latencies are the NCCL-order alpha terms of an NVLink hop and an InfiniBand hop. The efficiency
factors and overheads are the same uncalibrated defaults as the other Hopper file
(`h800_16x8.py`); they were not fitted to ReaL's measurements (`benchmarks/real_check.py`
compares against those), and `--calibrate` on the machine replaces them.
"""

from jaxrlhf.plan.cluster import Cluster


def get_cluster() -> Cluster:
    return Cluster(
        name="h100_16x8",
        hosts=16,
        devices_per_host=8,
        hbm_bytes=80 * 10**9,
        peak_bf16_flops=989e12,
        hbm_bandwidth=3.35e12,
        intra_host_bandwidth=450e9,  # NVLink 4: 900 GB/s bidirectional
        inter_host_bandwidth=50e9,  # 400 Gb/s NDR per GPU
        host_link_bandwidth=64e9,  # PCIe Gen5 x16
        intra_host_latency=5e-6,
        inter_host_latency=20e-6,
        layer_overhead=30e-6,  # a few kernel launches per layer per pass, no CUDA graphs
        matmul_efficiency=0.45,
        hbm_efficiency=0.7,
        comm_efficiency=0.7,
        topology="16x1x8",  # 16 hosts, each its own NVLink domain of 8 GPUs
        target_config="h100_sxm.txtpb",  # `plan --compile`: XLA's description of the GPU
    )
