"""Decode attention on XLA:CPU as a C++ kernel (`cpu_decode_attention.cc`, an XLA FFI handler):
one query per row against a layer's tiled KV cache (`jaxrlhf.models.decode_kv.DecodeKV`),
reading each row's keys and values once, only up to its query slot, on every core.

Why: XLA:CPU runs a decode step's two attention products (scores, then values) as batched
products on one thread, whatever their shape (its YNNPACK library reports concurrency 1 for
every batched product; `benchmarks/decode_step.py` lists what else was tried). Those products
read the whole cache, so a long response's decode steps cost in proportion to its length on a
single core while the other cores idle. Here each (row, kv head) pair is one task, with the
mask, an online softmax and both products fused, shared out over XLA's own intra-op thread
pool (as many threads as the process has cores per CPU device, `cores_per_device`). W-cpu's
shape (64 rows, 4 layers, 2 kv heads of dim 64, fp32) on 2 quiet cores, the four layers'
attention of a step, XLA's products -> the kernel: 1.26 -> 0.75 ms at 96 slots, 9.89 -> 5.18 ms
at 544, 16.09 -> 9.17 ms at 1,056 (`python benchmarks/decode_step.py --parts=attention`).

It takes fp32 queries, keys and values, 1-8 query heads per kv head, head dims 16, 32, 64 or
128 and key tiles of 32 or 64 slots (`takes`); `models.attention.cached_query_attention` runs
it for AttentionImpl.AUTO on a CPU backend where it takes the operands and could be built
(`kernels.native`; else XLA's products, with one logged warning). Its outputs equal the XLA
path's to float rounding (tests/test_cpu_decode_attention.py). A query that sees no key
(padding, segment id 0) gets zeros, never read.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import pathlib
import threading

import jax
import jax.numpy as jnp
import numpy as np

from jaxrlhf.kernels import native
from jaxrlhf.kernels.target import platform as traced_platform

_SOURCE = pathlib.Path(__file__).with_suffix(".cc")
_SYMBOL = "JaxrlhfCpuDecodeAttention"
_REGISTERING = threading.Lock()  # an async rollout worker may trace beside the main thread
MAX_GROUPS = 8
HEAD_DIMS = (16, 32, 64, 128)
TILES = (32, 64)


def target() -> str | None:
    """The registered FFI target's name; None where the kernel cannot be built here (logged
    once). The name carries the library's hash: a program compiled against one build of the
    kernel never runs another (JAX's persistent cache keys on it)."""
    with _REGISTERING:
        return _register()


@functools.cache
def _register() -> str | None:
    try:
        library = native.build(_SOURCE)
    except (native.BuildError, OSError) as e:
        logging.warning("the CPU decode-attention kernel is unavailable, decode steps run "
                        "XLA's products: %s", e)
        return None
    name = f"jaxrlhf_cpu_decode_attention_{library.stem.rsplit('-', 1)[1]}"
    handler = getattr(ctypes.cdll.LoadLibrary(str(library)), _SYMBOL)
    jax.ffi.register_ffi_target(name, jax.ffi.pycapsule(handler), platform="cpu")
    return name


def _unpartitioned() -> bool:
    """Whether the program being traced runs as written on each device: inside `shard_map`
    over every mesh axis that splits (the rollout engine), under a mesh of one device, or in a
    process with one device. XLA's partitioner would gather every operand of a custom call
    whole onto each device, so where it may partition (a mesh with automatic axes, or none in
    scope while the arrays may lie on several devices), XLA's products run instead."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return jax.device_count() == 1
    return all(size == 1 or name in mesh.manual_axes for name, size in mesh.shape.items())


def cores_per_device() -> int:
    """This process's cores over its CPU devices (at least 1): how many threads one device's
    call may use. Virtual CPU devices (`--xla_force_host_platform_device_count`) each run their
    own program at once: 8 of them on 2 cores keep both busy without splitting a call (W-cpu's
    default placement, 512 new tokens, one run each: 18.4 s with every call split against
    16.3 s for XLA's products; one thread a call: 15.1 and 16.3 s against 15.8 and 16.0)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, (cores or 1) // len(jax.local_devices(backend="cpu")))


def takes(q_b1hd: jax.Array, k_bkcdi: jax.Array, v_bksd: jax.Array) -> bool:
    """Whether the kernel runs these operands (shapes and dtypes as `decode_attention`) in the
    program being traced: one for the CPU (`kernels.target.platform`) that runs as written on each
    device (`_unpartitioned`); builds it on the first call that could."""
    heads, head_dim = q_b1hd.shape[2:]
    kv_heads, tile = k_bkcdi.shape[1], k_bkcdi.shape[-1]
    return (traced_platform() == "cpu"
            and all(x.dtype == jnp.float32 for x in (q_b1hd, k_bkcdi, v_bksd))
            and heads % kv_heads == 0 and heads // kv_heads <= MAX_GROUPS
            and head_dim in HEAD_DIMS and tile in TILES
            and _unpartitioned() and target() is not None)


def decode_attention(q_b1hd, k_bkcdi, v_bksd, q_seg_b1, kv_seg_bs, q_offset) -> jax.Array:
    """One query per row against its cache, masked as `models.attention.dot_product_attention`
    masks (causal over slots, same non-zero segment).

    Args:
      q_b1hd: fp32 [b, 1, heads, head_dim] one query per row (RoPE applied).
      k_bkcdi: fp32 [b, kv_heads, tiles, head_dim, tile] keys, slot s at tile s // tile.
      v_bksd: fp32 [b, kv_heads, S, head_dim] values.
      q_seg_b1: int [b, 1] the queries' segment ids; 0 = padding.
      kv_seg_bs: int [b, S] the keys' segment ids; 0 = padding/unused.
      q_offset: int scalar or [b]: each row's query slot; slots after it are not read.

    Returns:
      fp32 [b, 1, heads, head_dim].
    """
    batch, _, heads, head_dim = q_b1hd.shape
    kv_heads = k_bkcdi.shape[1]
    q_bkgd = q_b1hd.reshape(batch, kv_heads, heads // kv_heads, head_dim)
    q_slot_b = jnp.broadcast_to(jnp.asarray(q_offset, jnp.int32), (batch,))
    call = jax.ffi.ffi_call(target(), jax.ShapeDtypeStruct(q_bkgd.shape, jnp.float32),
                            vmap_method="sequential")
    out_bkgd = call(q_bkgd, k_bkcdi, v_bksd, q_seg_b1[:, 0].astype(jnp.int32),
                    kv_seg_bs.astype(jnp.int32), q_slot_b, threads=np.int64(cores_per_device()))
    return out_bkgd.reshape(batch, 1, heads, head_dim)
