"""Zero-redundancy reallocation: per-device parameter bytes live while generation's copy lives.

`python benchmarks/realloc_memory.py [--size=small] [--json]`

For each pair of layouts (training, generation) over the same 8 CPU devices, a trained actor's
`ModelRuntime` (TrainState on the training layout, ZeRO-1 optimizer state) builds its
generation copy with `params_on`, and the live buffers on every device are summed
(`jax.live_arrays()`, each shard on the device it sits on) while the copy lives. Parameter
bytes = live bytes less the optimizer state and step (measured on the same device). Beside it:
the generation shard alone (the target), the training shard, and today's figure before
zero-redundancy reallocation, the same reshard keeping the home parameters
(`reshard(params, shardings)` without `free_source`, what `params_on` did). All figures are
exact byte counts (deterministic), the worst device reported.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import pathlib
import sys

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=8")
ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from jaxrlhf.dataflow.runtime import ModelRuntime  # noqa: E402
from jaxrlhf.engine.optimizer import OptimizerConfig  # noqa: E402
from jaxrlhf.engine.train_step import init_train_state  # noqa: E402
from jaxrlhf.mfc import Role  # noqa: E402
from jaxrlhf.models.sizes import abstract_params, get_size  # noqa: E402
from jaxrlhf.parallel.layout import make_layout  # noqa: E402
from jaxrlhf.parallel.reshard import reshard  # noqa: E402

# (training, generation): generation's shards contain training's on every device.
PAIRS = (("0-7:f4t2", "0-7:d4t2"), ("0-7:f8", "0-7:d8"), ("0-7:p2f2t2", "0-7:p2d2t2"))


def _add_shards(out: dict[int, int], x) -> None:
    """Adds the bytes of each of `x`'s shards to its device's entry; from the sharding, not
    `shard.data` (which makes an array per shard, itself live from then on)."""
    nbytes = math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize
    for device in x.sharding.device_set:
        out[device.id] = out.get(device.id, 0) + nbytes


def live_bytes_per_device() -> dict[int, int]:
    """Device id -> bytes of every live array's shards on it."""
    gc.collect()
    out: dict[int, int] = {}
    for x in jax.live_arrays():
        _add_shards(out, x)
    return out


def _bytes_per_device(tree) -> dict[int, int]:
    out: dict[int, int] = {}
    for x in jax.tree.leaves(tree):
        _add_shards(out, x)
    return out


def shard_bytes_per_device(model, layout) -> dict[int, int]:
    """Device id -> bytes of its shards of the model's parameters on `layout` (no arrays)."""
    out: dict[int, int] = {}
    boxed = abstract_params(model)
    shardings = jax.tree.leaves(layout.param_shardings(boxed))
    leaves = jax.tree.leaves(nn.unbox(boxed))
    for leaf, sharding in zip(leaves, shardings, strict=True):
        shape, itemsize = leaf.shape, jnp.dtype(leaf.dtype).itemsize
        for device, index in sharding.devices_indices_map(shape).items():
            n = 1
            for sl, dim in zip(index, shape):
                start, stop, _ = sl.indices(dim)
                n *= stop - start
            out[device.id] = out.get(device.id, 0) + n * itemsize
    return out


def measure_pair(model, train_spec: str, gen_spec: str) -> dict:
    """Live parameter bytes per device while the generation copy lives, with and without
    zero-redundancy reallocation (module docstring); bytes of the worst device."""
    train = make_layout(train_spec, model=model)
    gen = make_layout(gen_spec, model=model)
    gen_shard = shard_bytes_per_device(model, gen)
    train_shard = shard_bytes_per_device(model, train)
    result = {"train": train_spec, "generate": gen_spec,
              "generation_shard": max(gen_shard.values()),
              "training_shard": max(train_shard.values())}
    for kind in ("zero_redundancy", "before"):
        # Arrays that were live before (a test suite's earlier tests keep some) are not ours.
        already = live_bytes_per_device()
        state = init_train_state(model, train, OptimizerConfig(), jax.random.key(0))
        runtime = ModelRuntime(Role.ACTOR, model, train, state=state)
        del state
        other = _bytes_per_device((runtime.state.opt_state, runtime.state.step))
        if kind == "zero_redundancy":
            copy = runtime.params_on(gen)
        else:  # what params_on did before: the copy beside the home parameters
            copy, _ = reshard(runtime.params, gen.param_shardings(abstract_params(model)))
        jax.block_until_ready(copy)
        live = live_bytes_per_device()
        params = {d: live[d] - already.get(d, 0) - other.get(d, 0) for d in live}
        result[kind] = max(params.values())
        if kind == "zero_redundancy":
            runtime.done_reading(gen)  # the home parameters come back out of the copy
            result["restored_equal"] = bool(all(jax.tree.leaves(jax.tree.map(
                lambda a, b: bool(jnp.array_equal(a, b)), runtime.params,
                reshard(copy, train.param_shardings(abstract_params(model)))[0]))))
        del copy, runtime, params
    result["ratio_to_generation_shard"] = result["zero_redundancy"] / result["generation_shard"]
    result["before_ratio"] = result["before"] / result["generation_shard"]
    return result


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", default="small")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    model = get_size(args.size, num_kv_heads=4, dtype=jnp.float32)
    rows = [measure_pair(model, train, gen) for train, gen in PAIRS]
    if args.json:
        print(json.dumps(rows, indent=1))
        return rows
    print(f"model {args.size}: parameter bytes per device (worst device) while generation's "
          "copy lives")
    print(f"{'train':>12} {'generate':>12} {'gen shard':>12} {'train shard':>12} "
          f"{'now':>12} {'before':>12} {'now/gen':>8} {'before/gen':>10}")
    for r in rows:
        print(f"{r['train']:>12} {r['generate']:>12} {r['generation_shard']:>12} "
              f"{r['training_shard']:>12} {r['zero_redundancy']:>12} {r['before']:>12} "
              f"{r['ratio_to_generation_shard']:>8.3f} {r['before_ratio']:>10.3f}")
    return rows


if __name__ == "__main__":
    main()
