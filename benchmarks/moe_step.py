"""A mixture-of-experts train step against a dense model with the same active parameters, on
the local devices, timed interleaved in one process.

`python benchmarks/moe_step.py [--size=bench] [--experts=8] [--top_k=2] [--layout=0-0:d1]
[--batch=16] [--length=128] [--rounds=10]` (from the repository root or anywhere else)

The dense model is `--size`; the MoE model is the same shape with every MLP replaced by
`--experts` experts of width intermediate_size / top_k, `--top_k` a token: the same matmul
parameters per token (`sizes.matmul_params` differs by the router only), `experts / top_k`
times the MLP parameters. Each round runs one step of each, alternating which goes first; the
medians and their ratio are printed as one JSON line.

Measured on this 2-core CPU machine while other jobs loaded it, with the defaults
(`python benchmarks/moe_step.py --rounds=8`: bench, 8 experts of width 512, top-2, one device,
16 x 128 tokens; matmul parameters 4,001,792 dense, 4,009,984 MoE): median step 3.07 s dense,
4.79 s MoE, 1.56x. Before the experts' matmuls ran in blocks on XLA:CPU (ragged_dot, which JAX
lowers there to a product over all 8 experts): 7.95 s and 34.5 s, 4.34x.
"""

from __future__ import annotations

import json
import pathlib
import statistics
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from absl import app, flags  # noqa: E402

_SIZE = flags.DEFINE_string("size", "bench", "dense model size (jaxrlhf.models.sizes)")
_EXPERTS = flags.DEFINE_integer("experts", 8, "experts per sparse layer")
_TOP_K = flags.DEFINE_integer("top_k", 2, "experts a token")
_LAYOUT = flags.DEFINE_string("layout", "0-0:d1", "device range and strategy")
_BATCH = flags.DEFINE_integer("batch", 16, "rows a step")
_LENGTH = flags.DEFINE_integer("length", 128, "tokens a row")
_ROUNDS = flags.DEFINE_integer("rounds", 10, "timed rounds (after one warm-up)")


def main(argv) -> None:
    del argv
    import flax.linen as nn
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxrlhf.engine import optimizer as opt
    from jaxrlhf.engine import train_step as ts
    from jaxrlhf.models.moe import MoeConfig
    from jaxrlhf.models.sizes import abstract_params, get_size, matmul_params
    from jaxrlhf.parallel.layout import make_layout

    dense = get_size(_SIZE.value, dtype=jnp.float32)
    sparse = dense.replace(moe=MoeConfig(
        _EXPERTS.value, _TOP_K.value, dense.intermediate_size // _TOP_K.value))
    cfg = opt.OptimizerConfig(lr=1e-4, total_steps=10**6)
    rng = np.random.default_rng(0)
    b, t = _BATCH.value, _LENGTH.value
    batch = dict(tokens_bt=rng.integers(1, dense.vocab_size, (b, t)).astype(np.int32),
                 positions_bt=np.broadcast_to(np.arange(t, dtype=np.int32), (b, t)).copy(),
                 segment_ids_bt=np.ones((b, t), np.int32), loss_mask_bt=np.ones((b, t), np.int32))

    def nll(out, batch):
        mask = batch["loss_mask_bt"].astype(jnp.float32)
        return -jnp.sum(out.logprobs_bt * mask), jnp.sum(mask), {}

    runs = {}
    for name, model in (("dense", dense), ("moe", sparse)):
        layout = make_layout(_LAYOUT.value, model=model)
        params = jax.tree.map(
            lambda a: (0.02 * rng.standard_normal(a.shape)).astype(a.dtype),
            nn.meta.unbox(abstract_params(model)))
        state = ts.create_train_state(params, model, layout, cfg)
        runs[name] = [ts.make_train_step(model, layout, nll, cfg), state, []]

    def one(name) -> float:
        step, state, _ = runs[name]
        start = time.perf_counter()
        state, metrics = step(state, batch)
        jax.block_until_ready(metrics["loss"])
        runs[name][1] = state
        return time.perf_counter() - start

    for name in runs:  # warm-up: compiles
        one(name)
    for r in range(_ROUNDS.value):
        for name in (("dense", "moe") if r % 2 == 0 else ("moe", "dense")):
            runs[name][2].append(one(name))
    median = {name: statistics.median(times) for name, (_, _, times) in runs.items()}
    print(json.dumps({
        "size": _SIZE.value, "experts": _EXPERTS.value, "top_k": _TOP_K.value,
        "layout": _LAYOUT.value, "batch": b, "length": t, "rounds": _ROUNDS.value,
        "matmul_params": {"dense": matmul_params(dense), "moe": matmul_params(sparse)},
        "seconds": median, "moe_vs_dense": median["moe"] / median["dense"],
    }))


if __name__ == "__main__":
    app.run(main)
