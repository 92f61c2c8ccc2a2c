"""The guards of the training loop (`run/loop.py`): non-finite steps (`NanGuard`) and Ctrl-C /
SIGTERM (`StopRequest`).

A checkpoint never holds a non-finite value: `checkpoint.Checkpointer.save` refuses one, and
`NanGuard` stops the run (the last checkpoint stays the last good state) or discards the bad
step, by `nan_policy`. A stop request ends the loop at a step boundary with a checkpoint, so that
rerunning the same command resumes there.
"""

from __future__ import annotations

import math
import os
import signal
import sys
import threading
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils

from jaxrlhf.checkpoint import Checkpointer, NonFiniteError, all_finite
from jaxrlhf.spec import NanPolicy


def _bad_metrics(metrics: dict[str, float]) -> list[str]:
    return [f"{k}={v}" for k, v in metrics.items()
            if k.endswith(("/loss", "/grad_norm")) and not math.isfinite(v)]


class NanGuard:
    """Checks every training step for NaN/inf and applies the NaN policy.

    With SKIP, the trained models' states and the controller are copied before each step (the
    train_step donates its input state), which costs one extra copy of every trained model's
    parameters and optimizer state in device memory.

    Args:
      policy: stop or skip.
      checkpoints: where the last good checkpoint is (for the message).
      what: the loop's name in messages ("RL", "warm-start", "dpo", ...).
    """

    def __init__(self, policy: NanPolicy, checkpoints: Checkpointer, what: str = "RL"):
        self.policy, self.checkpoints, self.what = policy, checkpoints, what
        self.skipped = 0

    def before_step(self, runner) -> tuple[dict, dict] | None:
        """The state to go back to if the step turns out bad (None under STOP)."""
        if self.policy is NanPolicy.STOP:
            return None
        states = {role: jax.tree.map(lambda x: jax.device_put(x, x.sharding, may_alias=False),
                                     rt.state)
                  for role, rt in runner.runtimes.items() if rt.trainable}
        return states, dict(runner.controller)

    def after_step(self, runner, metrics: dict[str, float], step: int, saved) -> bool:
        """True if step `step` was bad and discarded; raises NonFiniteError under STOP."""
        bad = _bad_metrics(metrics)
        trained = [rt.state for rt in runner.runtimes.values() if rt.trainable]
        if not bad and all_finite(trained):
            return False
        problem = ", ".join(bad) or "a non-finite parameter or optimizer state"
        match self.policy:
            case NanPolicy.STOP:
                latest = self.checkpoints.latest_step()
                kept = ("no checkpoint was saved before it (a rerun starts afresh)"
                        if latest is None else
                        f"the latest checkpoint (step {latest}) in {self.checkpoints.directory}"
                        " is the last good state and a rerun resumes from it")
                raise NonFiniteError(
                    f"{self.what} step {step}: {problem}. Stopped without saving; {kept}. "
                    "Lower the learning rate, or set --config.nan_policy=skip to discard such "
                    "steps.")
            case NanPolicy.SKIP:
                states, controller = saved
                for role, state in states.items():
                    runner.runtimes[role].update(state)
                runner.controller = controller
                self.skipped += 1
                print(f"{self.what} step {step}: {problem}; step discarded (nan_policy=skip, "
                      f"{self.skipped} so far)", flush=True)
                return True


class StopRequest:
    """Ctrl-C (SIGINT) or SIGTERM asks the loop to stop after the current step, save, return.

    SIGTERM is what SLURM sends at the time limit or on preemption (`launch/slurm.sbatch` asks
    for it early with `--signal`) and what Kubernetes sends on eviction; the loop finishes the
    step it is in (or abandons it, while its multi-turn rollout waits for an environment: a
    slow one never holds the stop; `rl.StepSource`), saves a checkpoint and exits, and
    rerunning the same command resumes there.
    (Multi-process, this handler replaces JAX's preemption notifier for SIGTERM: processes agree
    on the step through `agreed`, as for Ctrl-C.) A second signal of the same kind acts at once
    (the previous handler is back: Ctrl-C raises KeyboardInterrupt). Outside the main thread,
    where Python cannot install signal handlers, this does nothing.

    Entered inside another one (the job holds one from its start, the loop enters its own), it
    is that one: a signal that came before the loop (while restoring, compiling, evaluating)
    stops the loop at its first boundary.
    """

    SIGNALS = (signal.SIGINT, signal.SIGTERM)
    _installed: "StopRequest | None" = None  # the one whose handlers are in place

    def __init__(self):
        self._requested = False
        self._previous: dict[int, Any] = {}
        self._outer: StopRequest = self

    @property
    def requested(self) -> bool:
        return self._outer._requested

    def __enter__(self) -> "StopRequest":
        if StopRequest._installed is not None:
            self._outer = StopRequest._installed
        elif threading.current_thread() is threading.main_thread():
            self._previous = {sig: signal.signal(sig, self._handle) for sig in self.SIGNALS}
            StopRequest._installed = self
        return self

    def _handle(self, signum, frame) -> None:
        del frame
        self._requested = True
        signal.signal(signum, self._previous[signum])
        name = "interrupt" if signum == signal.SIGINT else "SIGTERM"
        text = (f"\n{name}: finishing this step, then saving a checkpoint (the same signal "
                "again stops at once)\n")
        try:  # not print: the signal may come in the middle of a print to stdout, and a
            # buffered stream refuses a reentrant write (RuntimeError)
            os.write(sys.stdout.fileno(), text.encode())
        except (AttributeError, OSError, ValueError):  # a stdout without a descriptor
            print(text, end="", flush=True)

    def agreed(self) -> bool:
        """Whether any process was asked to stop (every process must stop at the same step:
        the save is collective). One tiny all-gather per call when there are several."""
        if jax.process_count() == 1:
            return self.requested
        flags = multihost_utils.process_allgather(np.array(self.requested))
        return bool(np.any(flags))

    def __exit__(self, *exc) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        if StopRequest._installed is self:
            StopRequest._installed = None
        self._previous = {}
