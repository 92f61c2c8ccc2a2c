"""The training loop's own parts (`jaxrlhf/run/loop.py`, `jaxrlhf/run/guards.py`): metrics
trimming on resume and Ctrl-C handling. The loop itself runs under every batch source in
tests/test_resume.py (synchronous and asynchronous in one process), test_offline_resume.py
(offline) and test_async_rl.py (asynchronous across processes)."""

import json
import os
import signal

import pytest

from jaxrlhf.run.guards import StopRequest
from jaxrlhf.run.loop import trim_metrics


def test_trim_metrics_keeps_warm_start_and_steps_before_the_checkpoint(tmp_path):
    path = tmp_path / "metrics.jsonl"
    rows = [{"step": 0, "sft/actor/loss": 1.0}, {"step": 5, "sft/actor/loss": 0.5},
            {"step": 0, "reward": 0.1}, {"step": 1, "reward": 0.2}, {"step": 2, "reward": 0.3}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 3, "rew')
    trim_metrics(path, 2)
    assert [json.loads(line) for line in path.read_text().splitlines()] == rows[:4]
    trim_metrics(tmp_path / "absent.jsonl", 2)  # a fresh workdir has none


def test_ctrl_c_requests_a_stop_and_a_second_one_interrupts():
    # Python's own Ctrl-C handler before the request, whatever this test process had (a pytest
    # worker's handler depends on what ran in it before).
    worker_handler = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with StopRequest() as stop:
            assert not stop.requested
            os.kill(os.getpid(), signal.SIGINT)
            assert stop.requested  # and no KeyboardInterrupt: the step goes on
            with pytest.raises(KeyboardInterrupt):
                os.kill(os.getpid(), signal.SIGINT)
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    finally:
        signal.signal(signal.SIGINT, worker_handler)
