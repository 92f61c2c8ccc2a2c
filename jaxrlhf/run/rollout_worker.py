"""The generation side of asynchronous RL: a batch decoded chunk by chunk, newest weights.

Used by the one-process loop (jaxrlhf/run/async_loop.py, generation in the main thread) and by
each generation replica process of the multi-process loop (jaxrlhf/run/async_procs.py).
"""

from __future__ import annotations

import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxrlhf.engine.rollout import NO_VERSION, InFlight, Rollout
from jaxrlhf.mfc import MFC
from jaxrlhf.models.sizes import abstract_params
from jaxrlhf.parallel.layout import Layout
from jaxrlhf.parallel.reshard import fetch, reshard


@dataclasses.dataclass
class Generated:
    """A finished batch waiting for the trainer.

    Attributes:
      index: the RL step that trains it (batch k is drawn k-th from the prompt iterator).
      buffer: the trainer graph's dataset keys (prompts, generated sequences, log-probs).
      versions_bn: int32 [b, n] on the host: policy version of every token (NO_VERSION after
        the response).
      interruptions: weight swaps during its generation.
      iterator_before: the prompt iterator's state before the batch was drawn.
      seconds: (start, end) of its generation on the loop's clock.
    """

    index: int
    buffer: dict
    versions_bn: np.ndarray
    interruptions: int
    iterator_before: object
    seconds: tuple[float, float]

    def staleness_bn(self, version: int) -> np.ndarray:
        """Versions behind `version` of every token, -1 where there is none."""
        return np.where(self.versions_bn == NO_VERSION, -1, version - self.versions_bn)

class RolloutWorker:
    """The generation side: one batch in flight, the newest weights it was given.

    A batch of `micro_batches` k > 1 (the allocation's `actor_gen@k`) is decoded one
    micro-batch after the other, each to its end, so only one micro-batch's KV cache is alive;
    micro-batch j samples with fold_in(the batch's key, j), as the synchronous generate call.

    Args:
      mfc: the actor's generate MFC (its outputs name the generated keys).
      rollout: the interruptible generator on the generation layout.
      layout: the generation layout.
      model: the actor's ModelConfig.
      seed: batch k samples with fold_in(key(seed), k), as the synchronous runner's step k.
      chunk_tokens: tokens decoded between checks for new weights.
      micro_batches: micro-batches of a batch, decoded in turn.
    """

    def __init__(self, mfc: MFC, rollout: Rollout, layout: Layout, model, seed: int,
                 chunk_tokens: int, micro_batches: int = 1):
        self.mfc, self.rollout, self.layout = mfc, rollout, layout
        self.chunk_tokens, self.micro_batches = chunk_tokens, micro_batches
        self._shardings = layout.param_shardings(abstract_params(model))
        self._rng = jax.random.key(seed)
        self.params, self.version = None, -1
        self.inflight: InFlight | None = None
        self._current: tuple | None = None  # (index, batch dict, iterator state, start time)
        self._parts: list = []  # micro-batches not started yet: (prompts, mask, rng)
        self._done_parts: list = []  # finished micro-batches: (arrays, versions_bn, swaps)
        self.busy_seconds = 0.0
        self.published_bytes = 0

    def install(self, params, version: int) -> None:
        """Weights already on this layout (a multi-process replica receives them itself)."""
        self.params, self.version = params, version

    def publish(self, params, version: int) -> None:
        """New weights for generation: a copy of the trainer's parameters on this layout in
        buffers of their own (the trainer's next update donates its own)."""
        moved, stats = reshard(params, self._shardings)
        self.params = jax.tree.map(lambda new, old: jnp.copy(new) if new is old else new, moved,
                                   params)
        self.version = version
        self.published_bytes += stats.bytes_moved

    def start(self, index: int, batch: dict, iterator_before, now: float) -> None:
        t0 = time.perf_counter()
        rng = jax.random.fold_in(self._rng, jax.device_put(np.uint32(index)))
        k = self.micro_batches
        tokens_bp, mask_bp = batch["prompt_tokens_bp"], batch["prompt_mask_bp"]
        # Strided micro-batches (rows j::k), as the synchronous generate call's.
        self._parts = [(tokens_bp[j::k], mask_bp[j::k],
                        rng if k == 1 else jax.random.fold_in(rng, j)) for j in range(k)]
        self._done_parts = []
        self._current = (index, batch, iterator_before, now)
        self._start_part()
        self.busy_seconds += time.perf_counter() - t0

    def _start_part(self) -> None:
        tokens_bp, mask_bp, rng = self._parts.pop(0)
        self.inflight = self.rollout.start(self.params, self.version, tokens_bp, mask_bp, rng)

    def step(self, now) -> Generated | None:
        """Decodes one chunk with the newest weights; the batch once it is finished."""
        t0 = time.perf_counter()
        try:
            if not self.rollout.poll(self.inflight):
                self.inflight = self.rollout.advance(self.inflight, self.params, self.version,
                                                     self.chunk_tokens)
                if not self.rollout.poll(self.inflight):
                    return None
            out, versions_bn = self.rollout.finish(self.inflight)
            arrays = (out.sequences_bs, out.sequence_mask_bs, out.response_mask_bn,
                      out.logprobs_bn)
            self._done_parts.append((arrays, versions_bn, self.inflight.interruptions))
            if self._parts:
                self._start_part()
                return None
            return self._finish(now)
        finally:
            self.busy_seconds += time.perf_counter() - t0

    def _finish(self, now) -> Generated:
        index, batch, iterator_before, started = self._current
        parts = self._done_parts
        if len(parts) == 1:
            (arrays, versions_bn, swaps), = parts
        else:
            arrays = tuple(_merge_rows(xs) for xs in zip(*(p[0] for p in parts)))
            versions_bn = _merge_rows([p[1] for p in parts])
            swaps = sum(p[2] for p in parts)
        buffer = {**batch, **dict(zip(self.mfc.outputs, arrays, strict=True))}
        done = Generated(index, buffer, fetch(versions_bn), swaps, iterator_before,
                         (started, now()))
        self.inflight, self._current, self._done_parts = None, None, []
        return done

    def drop(self):
        """Abandons the batch in flight (a stop: it is generated again after resuming);
        returns the prompt iterator's state before it was drawn, or None."""
        before = None if self._current is None else self._current[2]
        self.inflight, self._current, self._parts, self._done_parts = None, None, [], []
        return before

def _merge_rows(parts_kb):
    """Micro-batch j's row r back at row r·k + j (the inverse of rows j::k)."""
    return jnp.stack(parts_kb, 1).reshape(-1, *parts_kb[0].shape[1:])
