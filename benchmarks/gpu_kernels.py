"""Accelerator figures of one model on one device: train-step MFU, prefill MFU, decode vs the HBM
roofline, for each attention implementation asked for.

`python benchmarks/gpu_kernels.py --size=llama-3.2-1b --cluster=meshes/h100_1.py
[--attention=auto,pallas] [--batches=64,256] [--prompt=512] [--new=512] [--train_rows=8]
[--train_len=2048] [--repeats=5] [--dtype=bfloat16] [--stack=scan,layers,layers_kv]
[--skip=mismatch] [--json_out=PATH]`

Denominators are the cluster file's *published* peak bf16 FLOP/s and HBM bandwidth (not a
probe), as in the papers:
  * train MFU = model FLOPs of one optimizer step (3 forward passes, `jaxrlhf.perf.flops`) /
    (seconds x peak); parameters fp32, compute in `--dtype`;
  * prefill MFU = forward FLOPs of `batch` prompts writing a KV cache / (seconds x peak);
  * mismatch: mean |log p_train - log p_rollout| on sampled tokens and the largest token
    probability ratio, rollout weights in `--dtype` vs fp32 training weights;
  * decode: `--new` greedy steps of one token against the cache (a `fori_loop` of the model, no
    sampling work), as a fraction of the roofline = bytes that must be read per step (weights
    in `--dtype` + each row's valid KV prefix, all layers) / HBM bandwidth; once per
    `--stack` (the layer stack the decode runs on: `engine.decode_layers` or the scan);
  * attention (stacks layers and layers_kv): one layer's decode attention alone over a full
    cache, against the time of reading its keys and values once from HBM.
Weights of prefill/decode are stored in `--dtype` (a rollout engine's copy). Inputs are random
tokens at full length (no padding), as ReaL measures. On CPU it runs end to end at a tiny
size (`--size=tiny --dtype=float32 --cluster=meshes/cpu_8.py`): the figures then mean
nothing, the point is that the script stays alive (tests/unit/test_attention_backends.py).

It prints one line per measurement; `--json_out` also writes them as rows (`phase` = train,
prefill, decode, attention or mismatch, with the attention asked for and what it ran as) beside the
device, the cluster's denominators and the versions, for `benchmarks/gpu_suite.sh`.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import time


def _args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--size", default="llama-3.2-1b", help="a name in jaxrlhf.models.sizes")
    p.add_argument("--cluster", default="meshes/h100_1.py", help="cluster file (peak, HBM)")
    p.add_argument("--attention", default="auto", help="comma list of auto|xla|cudnn|pallas")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--batches", default="64,256", help="decode/prefill batch sizes")
    p.add_argument("--prompt", type=int, default=512)
    p.add_argument("--new", type=int, default=512, help="decode steps timed")
    p.add_argument("--train_rows", type=int, default=8)
    p.add_argument("--train_len", type=int, default=2048)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--stack", default="scan",
                   help="comma list of the decode's layer stacks: scan (the stacked layers, "
                        "one nn.scan), unrolled (scan_layers=False), layers (engine.decode_layers"
                        ".LayerByLayer: weights split once, one tiled DecodeKV per layer, read by "
                        "XLA's products), layers_kv (the same on one [b, S, k, d] cache per "
                        "layer, read by --attention's implementation)")
    p.add_argument("--skip", default="",
                   help="comma list of train,prefill,decode,attention,mismatch to skip")
    p.add_argument("--json_out", default="", help="also write every row as JSON here")
    return p.parse_args(argv)


def _cluster(path: str):
    spec = importlib.util.spec_from_file_location("cluster_file", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_cluster()


def _median_seconds(fn, repeats: int) -> float:
    import jax
    jax.block_until_ready(fn())  # compile + warm up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _kv_bytes_per_slot(cfg) -> int:
    """Bytes of keys + values one token occupies in the cache, all layers."""
    return 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * cfg.dtype(0).itemsize


def _train(cfg, layout, args, peak) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxrlhf.engine.optimizer import OptimizerConfig
    from jaxrlhf.engine.train_step import init_train_state, make_train_step
    from jaxrlhf.perf.flops import call_flops

    cfg = cfg.replace(param_dtype=jnp.float32)

    def loss_fn(out, b):  # next-token cross-entropy of the train step's log-probs
        return -jnp.sum(out.logprobs_bt), jnp.sum(b["segment_ids_bt"][:, 1:] != 0, dtype=jnp.float32), {}

    opt = OptimizerConfig(lr=1e-5)
    step = make_train_step(cfg, layout, loss_fn, opt)
    state = {"s": init_train_state(cfg, layout, opt, jax.random.key(0))}
    rows, length = args.train_rows, args.train_len
    tokens = np.random.default_rng(0).integers(1, cfg.vocab_size, (rows, length), np.int32)
    batch = {"tokens_bt": tokens, "positions_bt": np.broadcast_to(np.arange(length), tokens.shape),
             "segment_ids_bt": np.ones_like(tokens)}

    def run():
        state["s"], metrics = step(state["s"], batch)
        return metrics

    seconds = _median_seconds(run, args.repeats)
    mfu = call_flops(cfg, "train_step", rows, length) / (seconds * peak)
    return {"phase": "train", "rows": rows, "len": length, "seconds": seconds, "mfu": mfu}


def _prefill_and_decode(cfg, batch, args, peak, bandwidth, skip, stack="scan") -> list[dict]:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxrlhf.engine import decode_layers
    from jaxrlhf.models.sizes import param_count
    from jaxrlhf.models.transformer import KVCache, Transformer
    from jaxrlhf.parallel.layout import init_params, make_layout
    from jaxrlhf.perf.flops import forward_flops_per_token

    cfg = cfg.replace(param_dtype=cfg.dtype)  # the rollout copy of the weights
    model = Transformer(cfg)
    split_cache = {"layers": decode_layers.split_cache,
                   "layers_kv": decode_layers.layer_caches}.get(stack)
    by_layer = split_cache is not None
    decoder = (Transformer(cfg, decode_layers.LayerByLayer()) if by_layer
               else Transformer(cfg.replace(scan_layers=stack == "scan")))
    params = init_params(cfg, make_layout("0:d1", model=cfg), jax.random.key(0))
    prompt, new = args.prompt, args.new
    tokens_bp = jnp.asarray(
        np.random.default_rng(1).integers(1, cfg.vocab_size, (batch, prompt), np.int32))
    positions_bp = jnp.broadcast_to(jnp.arange(prompt), tokens_bp.shape)
    kv_seg_bs = jnp.ones((batch, prompt + new), jnp.int32)

    @jax.jit
    def prefill(params):
        cache = KVCache.zeros(cfg, batch, prompt + new)
        logits_b1v, cache = model.apply({"params": params}, tokens_bp, positions_bp,
                                        jnp.ones_like(tokens_bp), cache, 0, kv_seg_bs,
                                        last_only=True)
        return jnp.argmax(logits_b1v[:, 0], -1).astype(jnp.int32), cache

    @jax.jit
    def decode(params, token_b, cache):
        def one(i, carry):
            token_b, cache = carry
            slot = prompt + i
            logits_b1v, cache = decoder.apply(
                {"params": params}, token_b[:, None], jnp.full((batch, 1), slot),
                jnp.ones((batch, 1), jnp.int32), cache, slot, kv_seg_bs)
            return jnp.argmax(logits_b1v[:, 0], -1).astype(jnp.int32), cache
        return jax.lax.fori_loop(0, new, one, (token_b, cache))

    rows = []
    if "prefill" not in skip:
        seconds = _median_seconds(lambda: prefill(params), args.repeats)
        flops = batch * prompt * forward_flops_per_token(cfg, prompt)
        rows.append({"phase": "prefill", "batch": batch, "prompt": prompt, "seconds": seconds,
                     "mfu": flops / (seconds * peak)})
    if "decode" not in skip:
        token_b, cache = prefill(params)
        decode_params = params
        if by_layer:  # as the engine does, once before its token loop
            decode_params = jax.jit(decode_layers.split_params)(params)
            cache = jax.jit(split_cache)(cache)
        seconds = _median_seconds(lambda: decode(decode_params, token_b, cache), args.repeats)
        # Untied: the input embedding is only gathered (batch rows), not read whole.
        gathered_only = 0 if cfg.tie_word_embeddings else cfg.vocab_size * cfg.hidden_size
        weight_bytes = (param_count(cfg) - gathered_only) * cfg.dtype(0).itemsize
        # Step i reads every weight once and each row's prefix of prompt + i + 1 slots.
        valid_slots = batch * sum(prompt + i + 1 for i in range(new))
        roofline = (new * weight_bytes + valid_slots * _kv_bytes_per_slot(cfg)) / bandwidth
        rows.append({"phase": "decode", "stack": stack, "batch": batch, "prompt": prompt, "new": new,
                     "seconds": seconds, "tokens_per_second": batch * new / seconds,
                     "ms_per_step": seconds / new * 1e3, "roofline_seconds": roofline,
                     "fraction_of_roofline": roofline / seconds})
    return rows


def _attention(cfg, batch, args, bandwidth, stack: str) -> dict:
    """One layer's decode attention alone: `--new` chained one-query calls (each query is the
    last output, so none is hoisted out of the loop) over a full cache of prompt + new slots,
    against the HBM time of reading its keys and values once. `stack` picks the cache's layout
    as the decode's: layers (a tiled `DecodeKV`, XLA's products) or layers_kv ([b, S, k, d],
    the attention implementation asked for)."""
    import jax
    import jax.numpy as jnp

    from jaxrlhf.models import attention
    from jaxrlhf.models.decode_kv import DecodeKV

    slots, heads, kv_heads, dim = args.prompt + args.new, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    keys = jax.random.split(jax.random.key(0), 3)
    q_b1hd = jax.random.normal(keys[0], (batch, 1, heads, dim), cfg.dtype)
    k_bskd, v_bskd = (jax.random.normal(k, (batch, slots, kv_heads, dim), cfg.dtype)
                      for k in keys[1:])
    cache = (DecodeKV.from_stacked(k_bskd, v_bskd) if stack == "layers" else (k_bskd, v_bskd))
    seg_b1, seg_bs = jnp.ones((batch, 1), jnp.int32), jnp.ones((batch, slots), jnp.int32)
    slot = slots - 1

    def one(q_b1hd, cache):
        if stack == "layers":
            return attention.cached_query_attention(q_b1hd, cache.k_bkcdi, cache.v_bksd, seg_b1,
                                                    seg_bs, slot, impl=cfg.attention)
        return attention.dot_product_attention(q_b1hd, *cache, seg_b1, seg_bs, q_offset=slot,
                                               impl=cfg.attention)

    @jax.jit
    def chain(q_b1hd, cache):
        return jax.lax.fori_loop(0, args.new, lambda i, q: one(q, cache), q_b1hd)

    seconds = _median_seconds(lambda: chain(q_b1hd, cache), args.repeats) / args.new
    kv_bytes = batch * slots * _kv_bytes_per_slot(cfg) // cfg.num_layers  # one layer's
    return {"phase": "attention", "stack": stack, "batch": batch, "slots": slots,
            "seconds": seconds, "fraction_of_bandwidth": kv_bytes / bandwidth / seconds}


def _mismatch(cfg, batch, args) -> dict:
    """bf16 train-vs-rollout log-prob mismatch on sampled responses (temperature 1).

    The rollout samples with weights stored in `--dtype`; the trainer recomputes the same
    tokens' log-probs from fp32 weights (compute in `--dtype`), as PPO's ratio does. Reports
    mean |delta log p| and the largest token probability ratio exp(max |delta log p|). Random
    weights give flat distributions: a real checkpoint is the meaningful measurement.
    """
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxrlhf.engine.generate import GenerateConfig, make_generate_fn
    from jaxrlhf.engine.inference import (InferenceBatch, InferenceConfig, InferenceKind,
                                          make_inference_fn)
    from jaxrlhf.parallel.layout import init_params, make_layout

    train_cfg = cfg.replace(param_dtype=jnp.float32)
    rollout_cfg = cfg.replace(param_dtype=cfg.dtype)
    layout = make_layout("0:d1", model=train_cfg)
    params32 = init_params(train_cfg, layout, jax.random.key(0))
    params_rollout = jax.tree.map(lambda x: x.astype(cfg.dtype), params32)
    gen = make_generate_fn(rollout_cfg, GenerateConfig(args.new, 0, 0, 1.0,
                                                       force_max_length=True), layout)
    tokens_bp = np.random.default_rng(2).integers(1, cfg.vocab_size, (batch, args.prompt),
                                                  np.int32)
    out = gen(params_rollout, tokens_bp, np.ones_like(tokens_bp, bool), jax.random.key(1))
    infer = make_inference_fn(train_cfg, InferenceConfig(InferenceKind.LOGPROBS, 1.0), layout)
    seqs = InferenceBatch.padded(np.asarray(out.sequences_bs), np.asarray(out.sequence_mask_bs))
    # Both calls may pad to length buckets: the response starts after the bucketed prompt.
    start = out.sequences_bs.shape[1] - args.new
    train_logp_bn = np.asarray(infer(params32, seqs).logprobs_bt)[:, start:start + args.new]
    mask_bn = np.asarray(out.response_mask_bn)
    delta = np.abs(train_logp_bn - np.asarray(out.logprobs_bn))[mask_bn]
    return {"phase": "mismatch", "batch": batch, "new": args.new,
            "mean_abs_dlogp": float(delta.mean()),
            "max_token_prob_ratio": float(np.exp(delta.max()))}


def _line(row: dict) -> str:
    """One row as the line printed for it."""
    match row["phase"]:
        case "train":
            return (f"train   rows={row['rows']} len={row['len']}: "
                    f"{row['seconds'] * 1e3:9.2f} ms/step  MFU {row['mfu']:6.1%}")
        case "prefill":
            return (f"prefill batch={row['batch']} prompt={row['prompt']}: "
                    f"{row['seconds'] * 1e3:9.2f} ms  MFU {row['mfu']:6.1%}")
        case "decode":
            return (f"decode  {row.get('stack', 'scan')} batch={row['batch']} "
                    f"cache={row['prompt']}+{row['new']}: "
                    f"{row['tokens_per_second']:11.0f} tok/s  {row['ms_per_step']:7.3f} ms/step  "
                    f"{row['fraction_of_roofline']:6.1%} of HBM roofline")
        case "attention":
            return (f"attention {row['stack']} batch={row['batch']} slots={row['slots']}: "
                    f"{row['seconds'] * 1e6:9.1f} us/layer  {row['fraction_of_bandwidth']:6.1%} "
                    f"of HBM bandwidth")
        case "mismatch":
            return (f"mismatch batch={row['batch']} new={row['new']}: mean |dlogp| "
                    f"{row['mean_abs_dlogp']:.2e}, max token prob ratio "
                    f"{row['max_token_prob_ratio']:.4f}")


def main(argv=None):
    args = _args(argv)
    import jax
    import jax.numpy as jnp

    from jaxrlhf.models.attention import AttentionImpl, resolve_impl
    from jaxrlhf.models.sizes import get_size
    from jaxrlhf.parallel.layout import make_layout

    cluster = _cluster(args.cluster)
    peak, bandwidth = cluster.peak_bf16_flops, cluster.hbm_bandwidth
    skip = set(filter(None, args.skip.split(",")))
    report = {"device_kind": jax.devices()[0].device_kind, "backend": jax.default_backend(),
              "jax_version": jax.__version__, "cluster": cluster.name, "peak_flops": peak,
              "hbm_bandwidth": bandwidth, "size": args.size, "dtype": args.dtype,
              "args": vars(args), "rows": []}
    print(f"{report['device_kind']} ({report['backend']}); {cluster.name}: peak "
          f"{peak / 1e12:.0f} TFLOP/s, HBM {bandwidth / 1e12:.2f} TB/s; size {args.size}, "
          f"{args.dtype}")

    def write():  # after every row: a run cut short keeps what it measured
        if args.json_out:
            with open(args.json_out, "w", encoding="utf-8") as f:
                json.dump(report, f, indent=1)

    def emit(row, impl):
        row = {"attention": impl.value, "runs_as": resolve_impl(impl).value, **row}
        report["rows"].append(row)
        print(_line(row), flush=True)
        write()

    write()

    for name in args.attention.split(","):
        impl = AttentionImpl(name)
        cfg = get_size(args.size, dtype=jnp.dtype(args.dtype).type, attention=impl)
        print(f"-- attention={name} (runs as {resolve_impl(impl).value})")
        if "train" not in skip:
            emit(_train(cfg, make_layout("0:d1", model=cfg), args, peak), impl)
        for batch in map(int, args.batches.split(",")):
            for i, stack in enumerate(args.stack.split(",")):
                # The prefill (and its MFU) is the same whatever the decode's stack.
                phases = skip | ({"prefill"} if i else set())
                for row in _prefill_and_decode(cfg, batch, args, peak, bandwidth, phases, stack):
                    emit(row, impl)
                if "attention" not in skip and stack in ("layers", "layers_kv"):
                    emit(_attention(cfg, batch, args, bandwidth, stack), impl)
            if "mismatch" not in skip:
                emit(_mismatch(cfg, batch, args), impl)


if __name__ == "__main__":
    main()
