"""Pallas kernels, each beside a pure-jnp reference (kernels/reference.py).

  * flash_attention: prefill/training attention (causal, segment ids, GQA, fwd + bwd);
  * decode_attention: decode against a KV cache reading only each row's valid prefix;
  * paged_decode_attention: the same against a paged KV cache (a page table per row).
"""
