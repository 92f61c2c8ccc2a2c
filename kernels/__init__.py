"""Attention kernels: Pallas kernels for GPU and TPU, each beside a pure-jnp reference
(kernels/reference.py), and a C++ kernel for XLA:CPU.

  * flash_attention: prefill/training attention (causal, segment ids, GQA, fwd + bwd);
  * decode_attention: decode against a KV cache reading only each row's valid prefix;
  * paged_decode_attention: the same against a paged KV cache (a page table per row);
  * cpu_decode_attention: a decode step on XLA:CPU against the token loop's tiled cache, on
    every core (XLA FFI; tested against XLA's products), built by `native`.
"""
