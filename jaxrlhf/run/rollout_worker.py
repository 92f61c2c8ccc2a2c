"""The generation side of asynchronous RL: batches decoded in continuously refilled slots,
newest weights, by the rollout engine's scheduler (`engine.rollout.scheduler`).

Used by the one-process loop (jaxrlhf/run/async_loop.py, generation in the main thread) and by
each generation replica process of the multi-process loop (jaxrlhf/run/async_procs.py).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxrlhf.algorithms.routing import is_routes_key
from jaxrlhf.dataflow.executors import cut_responses
from jaxrlhf.dataflow.trajectories import (
    Environment, Trajectories, TurnRequests, trajectory_arrays,
)
from jaxrlhf.engine.rollout import NO_VERSION, Rollout, Rows
from jaxrlhf.engine.rollout.scheduler import Finished, OnNewVersion, Request, Scheduler
from jaxrlhf.mfc import MFC
from jaxrlhf.models.sizes import abstract_params
from jaxrlhf.parallel import delta
from jaxrlhf.parallel.delta import WeightSync
from jaxrlhf.parallel.layout import Layout
from jaxrlhf.parallel.reshard import reshard


@dataclasses.dataclass
class Generated:
    """A finished batch waiting for the trainer.

    Attributes:
      index: the RL step that trains it (batch k is drawn k-th from the prompt iterator).
      buffer: the trainer graph's dataset keys (prompts, generated sequences, log-probs).
      versions_bn: int32 [b, n] on the host: policy version of every token (NO_VERSION after
        the response).
      interruptions: weight swaps while any of its rows was being decoded (their caches
        recomputed: `async_rl.on_new_version=continue`).
      iterator_before: the prompt iterator's state before the batch was drawn.
      seconds: (start, end) of its generation on the loop's clock.
      slots_idle: the share of decode slot-steps without a row to decode, since the previous
        batch finished (the decode padding continuous batching leaves).
      restarts: its rows aborted and decoded again under new weights (`restart`).
      discarded_tokens: tokens of aborted rows thrown away since the previous batch finished.
    """

    index: int
    buffer: dict
    versions_bn: np.ndarray
    interruptions: int
    iterator_before: object
    seconds: tuple[float, float]
    slots_idle: float = 0.0
    restarts: int = 0
    discarded_tokens: int = 0

    def staleness_bn(self, version: int) -> np.ndarray:
        """Versions behind `version` of every token, -1 where there is none."""
        return np.where(self.versions_bn == NO_VERSION, -1, version - self.versions_bn)


@dataclasses.dataclass
class _Batch:
    """A batch being generated: its prompts and the rows finished so far (host arrays)."""

    batch: dict
    iterator_before: object
    started: float
    outputs: list  # Rows fields, [b, ...] each
    left: int
    interruptions: int = 0
    restarts: int = 0
    turns: TurnRequests | None = None  # a multi-turn batch's trajectories

    @property
    def done(self) -> bool:
        return self.left == 0 if self.turns is None else self.turns.done


class RolloutWorker:
    """The generation side: every admitted batch's rows decoded in `slots` rows on the device,
    with the newest weights it was given.

    A slot whose row finished takes the next waiting row, of the same batch or of the next
    admitted one, so generation never waits for a batch's longest response while the loop
    admits work (within the staleness bound). Rows are queued micro-batch by micro-batch:
    with `micro_batches` k > 1 (the allocation's `actor_gen@k`) there are b/k slots, rows j::k
    form micro-batch j, which samples with fold_in(the batch's key, j), as the synchronous
    generate call's.

    Args:
      mfc: the actor's generate MFC (its outputs name the generated keys).
      rollout: the continuous generator on the generation layout (`rollout.slots` rows).
      layout: the generation layout.
      model: the actor's ModelConfig.
      seed: batch k samples with fold_in(key(seed), k), as the synchronous runner's step k.
      chunk_tokens: tokens decoded between checks for finished rows and new weights.
      micro_batches: micro-batches of a batch.
      env: multi-turn rollouts' environment (`dataflow/trajectories.py`): a batch's rows are
        trajectories, their turns requests of the scheduler (the rollout's prompts are P + N
        ids) and the environment's replies their continuations, which never hold up the other
        rows' decoding; every policy token records the version that sampled it, so a
        trajectory may span versions. None: single turns.
      on_trajectories: called with each multi-turn batch's `Trajectories` as it finishes.
      on_new_version: what a row still decoding does when new weights come
        (`async_rl.on_new_version`).
      weight_sync: a publish sends every tensor, or only those that changed since the last
        (`async_rl.weight_sync`, `parallel/delta.py`).
    """

    def __init__(self, mfc: MFC, rollout: Rollout, layout: Layout, model, seed: int,
                 chunk_tokens: int, micro_batches: int = 1, env: Environment | None = None,
                 on_trajectories: Callable[[Trajectories], None] | None = None,
                 on_new_version: OnNewVersion = OnNewVersion.CONTINUE,
                 weight_sync: WeightSync = WeightSync.FULL):
        if env is not None and micro_batches != 1:
            raise ValueError(f"env.name: multi-turn rollouts take one micro-batch of "
                             f"generation, not actor_gen@{micro_batches}")
        self.mfc, self.rollout, self.layout = mfc, rollout, layout
        self.chunk_tokens, self.micro_batches = chunk_tokens, micro_batches
        self.env, self.on_trajectories = env, on_trajectories
        self._shardings = layout.param_shardings(abstract_params(model))
        self._rng = jax.random.key(seed)
        self.params, self.version = None, -1
        # Batches keep coming: the slots keep their number (no compaction).
        self._scheduler = Scheduler(rollout, chunk_tokens=chunk_tokens, compact=False,
                                    on_new_version=on_new_version)
        self._batches: dict[int, _Batch] = {}
        self._counts = np.zeros(3, np.int64)  # (slot-steps, tokens, discarded tokens) at the
        # last batch's end
        self.busy_seconds = 0.0
        self.published_bytes = 0
        self._tracker = delta.Tracker() if weight_sync is WeightSync.DELTA else None
        self._sent = None  # the last transfer's copy (what a delta is against)

    def install(self, params, version: int) -> None:
        """Weights already on this layout (a multi-process replica receives them itself)."""
        self.params, self.version = params, version

    def publish(self, params, version: int) -> None:
        """New weights for generation, copied before this returns (`transfer`, then
        `install`); the asynchronous loop publishes off the trainer's path instead
        (`run/publisher.py`)."""
        self.install(self.transfer(params), version)

    def transfer(self, params, owned: bool = False):
        """Generation's copy of the trainer's parameters: on this layout, in buffers of their
        own (the trainer's next update donates its own); with `weight_sync=delta`, the tensors
        that changed since the last transfer, the others kept from it. One caller at a time
        (the publisher's thread), in version order; `install` hands the copy to decoding.
        `owned`: `params` is a copy nobody donates (the publisher's snapshot), so a leaf
        already on this layout is kept as it is: a copy made now would queue behind the
        trainer's next update on devices they share."""
        if self._tracker is None:
            moved, stats = reshard(params, self._shardings)
        else:
            moved, stats = delta.apply(params, self._sent, self._shardings,
                                       self._tracker.changed(params))
        if not owned:
            moved = jax.tree.map(lambda new, old: jnp.copy(new) if new is old else new, moved,
                                 params)
        self._sent = moved
        self.published_bytes += stats.bytes_moved
        return moved

    @property
    def busy(self) -> bool:
        """A batch is being generated."""
        return bool(self._batches)

    @property
    def occupancy(self) -> float:
        """Rows with a slot or waiting for one, per slot."""
        scheduler = self._scheduler
        return (scheduler.in_slots + scheduler.queued) / self.rollout.slots

    def accepts(self) -> bool:
        """Whether to admit another batch now: every admitted row has a slot (so the next
        batch's rows are queued only as slots are about to free up)."""
        return not self._scheduler.queued

    def start(self, index: int, batch: dict, iterator_before, now: float) -> None:
        """Admits batch `index` (prompts [b, P]); its rows wait for free slots."""
        rng = jax.random.fold_in(self._rng, jax.device_put(np.uint32(index)))
        if self.env is not None:
            rows = [{"prompt": p, "answer": a}
                    for p, a in zip(batch["prompt_text"], batch["answer"])]
            turns = TurnRequests(self.env, rows, self.rollout.prompt_len, rng, tag=index,
                                 wait=False)  # the resets never hold up decoding
            self._scheduler.expect(turns.starting())
            self._batches[index] = _Batch(batch, iterator_before, now, [], len(rows),
                                          turns=turns)
            return
        k = self.micro_batches
        tokens_bp, mask_bp = (np.asarray(batch[name])
                              for name in ("prompt_tokens_bp", "prompt_mask_bp"))
        for j in range(k):
            key = rng if k == 1 else jax.random.fold_in(rng, j)
            self._scheduler.submit(
                Request(tokens_bp[row], mask_bp[row], key, r, tag=(index, row))
                for r, row in enumerate(range(j, len(tokens_bp), k)))
        outputs = [None] * len(Rows._fields)  # allocated from the first finished row
        self._batches[index] = _Batch(batch, iterator_before, now, outputs, len(tokens_bp))

    def step(self, now, stop: Callable[[], bool] | None = None) -> list[Generated]:
        """Fills free slots, decodes one chunk with the newest weights (after new ones, the
        busy rows go on, restart or finish as `on_new_version` says); the batches whose last
        row finished (possibly several, in any order). With nothing to decode but
        environment replies on their way, it waits for one, or until `stop()` says to stop
        (then nothing is decoded)."""
        t0 = time.perf_counter()
        try:
            finished, interrupted, restarted = self._scheduler.step(self.params, self.version,
                                                                    stop)
            for index in {request.tag[0] for request in interrupted}:
                self._batches[index].interruptions += 1
            for request in restarted:
                self._batches[request.tag[0]].restarts += 1
            return self._collect(finished, now)
        finally:
            self.busy_seconds += time.perf_counter() - t0

    def _collect(self, finished: Finished | None, now) -> list[Generated]:
        for i, request in enumerate(() if finished is None else finished.requests):
            index, row = request.tag
            out = self._batches[index]
            if out.turns is not None:  # a turn: its continuation took it
                continue
            for field, x in enumerate(finished.rows):
                if x is None:  # routes of a model without experts
                    continue
                if out.outputs[field] is None:
                    rows_b = len(out.batch["prompt_tokens_bp"])
                    out.outputs[field] = np.zeros((rows_b, *x.shape[1:]), x.dtype)
                out.outputs[field][row] = x[i]
            out.left -= 1
        done = []
        for index in sorted(i for i, b in self._batches.items() if b.done):
            counts = np.array([*self._scheduler.occupancy, self._scheduler.discarded.tokens],
                              np.int64)
            slot_steps, tokens, discarded = counts - self._counts
            idle = 1.0 - tokens / max(slot_steps, 1)
            self._counts = counts
            done.append(dataclasses.replace(
                self._finish(index, self._batches.pop(index), now, float(idle)),
                discarded_tokens=int(discarded)))
        return done

    def _finish(self, index: int, out: _Batch, now, idle: float) -> Generated:
        if out.turns is not None:
            return self._finish_turns(index, out, now, idle)
        sequences_bs, sequence_mask_bs, response_mask_bn, logprobs_bn, versions_bn, routes = (
            out.outputs)
        # A model's experts go on with the rows where the graph reads them (routing replay,
        # `algorithms.routing`: the generate MFC then outputs them, last); each token's were
        # recorded when it was fed, under the weights whose logits sampled the next one.
        recorded = (routes,) if any(is_routes_key(k) for k in self.mfc.outputs) else ()
        if recorded and routes is None:
            raise ValueError(f"MFC {self.mfc.name}: its layout ({self.layout}) records no "
                             "expert routes (a pipeline), which routing replay reads: the "
                             "checks refuse this (run/check.py); give it a layout without "
                             "pipeline stages")
        # Cut after the longest response, as the synchronous generate executor does.
        arrays = cut_responses((sequences_bs, sequence_mask_bs, response_mask_bn, logprobs_bn,
                                *recorded), response_mask_bn.shape[1])
        buffer = {**out.batch, **dict(zip(self.mfc.outputs, arrays, strict=True))}
        return Generated(index, buffer, versions_bn[:, :arrays[2].shape[1]], out.interruptions,
                         out.iterator_before, (out.started, now()), idle, out.restarts)

    def _finish_turns(self, index: int, out: _Batch, now, idle: float) -> Generated:
        """A multi-turn batch's trajectories as the generate MFC's outputs (the synchronous
        `trajectory_executor`'s keys), with every token's version."""
        result = out.turns.result()
        if self.on_trajectories is not None:
            self.on_trajectories(result)
        arrays = trajectory_arrays(result)
        buffer = {**out.batch, **{name: arrays[name] for name in self.mfc.outputs}}
        return Generated(index, buffer, result.versions_bn, out.interruptions,
                         out.iterator_before, (out.started, now()), idle, out.restarts)

    def drop(self):
        """Abandons the batches in flight (a stop: they are generated again after resuming;
        a multi-turn batch's environment calls are cancelled); returns (index, prompt
        iterator state before it was drawn) of the first, or None."""
        first = min(self._batches, default=None)
        out = None if first is None else (first, self._batches[first].iterator_before)
        for batch in self._batches.values():
            if batch.turns is not None:
                batch.turns.cancel()
        self._batches.clear()
        self._scheduler.drop()
        self._counts[:] = 0  # the scheduler's counts start again
        return out
