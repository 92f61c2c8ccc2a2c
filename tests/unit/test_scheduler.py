"""Scheduler: deterministic dispatch order and host futures."""

import concurrent.futures
import jax.numpy as jnp
import numpy as np

from jaxrlhf.dataflow.graph import MFC, Call, Role, build_graph
from jaxrlhf.dataflow.scheduler import Scheduler

R, C = Role, Call
def test_dispatch_order_puts_device_calls_before_host_calls_and_resolves_futures():
    pool = concurrent.futures.ThreadPoolExecutor(1)
    graph = build_graph([
        MFC("gen", R.ACTOR, C.GENERATE, ("p",), ("seq",)),
        MFC("reward", R.REWARD, C.INFERENCE, ("seq",), ("r",), host=True),
        MFC("ref", R.REF, C.INFERENCE, ("seq",), ("ref",)),
        MFC("train", R.ACTOR, C.TRAIN_STEP, ("r", "ref"), ("loss",)),
    ])
    seen = []

    def record(name, fn):
        def run(buf):
            seen.append(name)
            return fn(buf)
        return run

    executors = {
        "gen": record("gen", lambda b: {"seq": jnp.arange(4) + b["p"]}),
        "reward": record("reward", lambda b: {"r": pool.submit(lambda: float(np.sum(b["seq"])))}),
        "ref": record("ref", lambda b: {"ref": b["seq"] * 2}),
        "train": record("train", lambda b: {"loss": b["ref"].sum() - b["r"]}),
    }
    devs = {n: frozenset({0}) for n in ("gen", "ref", "train")}
    buffer, timing = Scheduler(graph, executors, devs).run_step({"p": jnp.int32(1)})
    assert seen == ["gen", "ref", "reward", "train"]
    assert float(buffer["loss"]) == 2 * 10 - 10
    assert "train<-r" in timing.host_blocked


class _Failing:
    """An output whose device work failed the way XLA reports it (block_until_ready raises)."""

    def __init__(self, message: str):
        self.message = message

    def block_until_ready(self):
        raise RuntimeError(self.message)


def _one_mfc_step(output):
    graph = build_graph([MFC("gen", R.ACTOR, C.GENERATE, ("p",), ("seq",))])
    scheduler = Scheduler(graph, {"gen": lambda b: {"seq": output}}, {"gen": frozenset({0})})
    return scheduler.run_step({"p": jnp.int32(1)})


def test_a_device_error_in_an_mfc_is_raised_not_swallowed():
    import pytest

    with pytest.raises(RuntimeError, match="RESOURCE_EXHAUSTED"):
        _one_mfc_step(_Failing("RESOURCE_EXHAUSTED: Out of memory allocating 4096 bytes"))


def test_an_output_deleted_downstream_counts_as_ready():
    buffer, timing = _one_mfc_step(_Failing("Array has been deleted with shape=float32[4]."))
    assert timing.mfcs["gen"].ready >= timing.mfcs["gen"].dispatch_done


def test_generated_arrays_are_cut_after_the_longest_response():
    """The generate executor's outputs lose the response columns no row reached (to the next
    of `buckets.response_widths`), so every later call of the step computes fewer columns;
    a batch whose longest response needs every column keeps them all."""
    from jaxrlhf.dataflow.executors import cut_responses

    P, N = 3, 32  # widths (8, 16, 24, 32)
    lengths_b = np.array([2, 9, 0, 5])
    mask_bn = np.arange(N)[None, :] < lengths_b[:, None]
    seq_bs = np.arange(4 * (P + N), dtype=np.int32).reshape(4, P + N)
    seq_mask_bs = np.concatenate([np.ones((4, P), bool), mask_bn], axis=1)
    logp_bn = np.where(mask_bn, -1.5, 0.0).astype(np.float32)
    arrays = tuple(map(jnp.asarray, (seq_bs, seq_mask_bs, mask_bn, logp_bn)))
    cut = [np.asarray(x) for x in cut_responses(arrays, N)]
    np.testing.assert_array_equal(cut[0], seq_bs[:, :P + 16])
    np.testing.assert_array_equal(cut[1], seq_mask_bs[:, :P + 16])
    np.testing.assert_array_equal(cut[2], mask_bn[:, :16])
    np.testing.assert_array_equal(cut[3], logp_bn[:, :16])
    full = mask_bn | (np.arange(N)[None, :] < np.array([N, 0, 0, 0])[:, None])
    arrays = (arrays[0], arrays[1], jnp.asarray(full), arrays[3])
    assert all(a is b for a, b in zip(cut_responses(arrays, N), arrays))
