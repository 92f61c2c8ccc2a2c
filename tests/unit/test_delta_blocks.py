"""benchmarks/delta_blocks.py counts what a delta sync sends at each granularity exactly: whole
tensors, blocks of a tensor's bytes (the last one its remainder), and single elements."""

import pathlib
import sys

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "benchmarks"))
from delta_blocks import sent_bytes  # noqa: E402


def test_bytes_sent_per_granularity():
    rng = np.random.default_rng(0)
    # 5000 fp32 elements = 20000 bytes: four 4 KiB blocks and a 3616-byte remainder.
    old = [rng.standard_normal(5000).astype(np.float32),
           rng.standard_normal((3, 7)).astype(np.float32)]
    new = [old[0].copy(), old[1].copy()]
    new[0][0] = np.nextafter(new[0][0], np.float32(np.inf))  # block 0, by one ulp
    new[0][4999] += 1  # the remainder block
    got = sent_bytes(new, old)
    assert got == {"full": 20000 + 84, "tensor": 20000, "block_1MiB": 20000,
                   "block_64KiB": 20000, "block_4KiB": 4096 + 3616, "element": 8}
    assert sent_bytes(old, old)["tensor"] == 0
