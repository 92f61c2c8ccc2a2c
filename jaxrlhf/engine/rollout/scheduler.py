"""The one scheduler of the rollout engine's slots: every caller's rows (the synchronous
`generate` call, the asynchronous rollout workers, multi-turn trajectories) are `Request`s it
serves, and it alone drives a `Rollout`'s fill, advance, poll, compact, reload and abort.

A round: the continuations whose results arrived queue their next requests; new weights take
effect as `OnNewVersion` says (by default the busy rows' caches are recomputed under them,
`Rollout.reload`, an interruption; or the rows are aborted and queued again, `Rollout.abort`;
or they finish first); queued requests take the free slots (`Rollout.fill`, taking turns over
the devices); every busy slot decodes a chunk of tokens (`Rollout.advance`), ending it early
once enough slots are free for the queue, the live rows fit the next smaller state, or a row
whose request has a continuation ends its turn; a look at the slots (`Rollout.poll`) says which
rows are done. Finished rows are read out (harvested) when their slots are needed, when their
continuation waits for them, when the caller steps the scheduler itself (`step`), or when
nothing is left; with the queue empty the live rows are compacted into the next smaller state
(`run` only: a state is never grown back).

A request's continuation receives its finished turn and returns the next request (its prompt
ids, stream and limit), None (done), or a `Later` whose result comes when it is ready (an
environment's reply): decoding goes on for the other rows meanwhile.

Nothing here runs per token: the host looks at the slots once per chunk.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import time
from collections.abc import Callable, Iterable
from typing import NamedTuple, Protocol

import jax
import numpy as np

from jaxrlhf.engine.rollout.engine import Rollout
from jaxrlhf.engine.rollout.state import Rows
from jaxrlhf.parallel.reshard import fetch

# Tokens decoded between looks at which rows finished (a sync point on a few scalars).
CHUNK_TOKENS = 32

# Fewer slots are not worth their compiles (every slot bucket compiles its own decode loop per
# capacity): below a few rows a step costs what reading the weights costs. W-cpu d1, CPU ms per
# decode step at capacity 48 / 384: 4 slots 1.9 / 2.9, 8 slots 2.7 / 4.4, 16 slots 3.7 / 5.8
# (process time of `Rollout.advance` on a filled state, median of 5).
MIN_SLOTS = 4


def smaller_sizes(slots: int, dp: int) -> list[int]:
    """The states a state of `slots` compacts into, largest first: 4, 6, 8, 12, 16, 24, ...
    (two per octave, so a state shrinks by a quarter or a third at a time, never by more than
    needed) below `slots`, multiples of the data-parallel size, at least MIN_SLOTS."""
    sizes, low = set(), MIN_SLOTS
    while low < slots:
        sizes |= {low, low * 3 // 2}
        low *= 2
    return sorted((n for n in sizes if n < slots and n % dp == 0), reverse=True)


def compacted_size(live: int, slots: int, dp: int) -> int:
    """Slots to compact `live` rows into: the smallest of `smaller_sizes` that holds them, or
    `slots` if none does."""
    return min((n for n in smaller_sizes(slots, dp) if n >= live), default=slots)


def stop_busy(slots: int, queued: int, dp: int, beyond_chunk: bool) -> int:
    """How few busy slots end a chunk early (`Rollout.advance`'s stop_busy), the slots all
    busy or the queue empty (a round fills before its chunk): with rows queued, once an eighth
    of the slots (at least one per device, at most the queue) are free to take them; with
    none, once the busy rows fit the next smaller state (`smaller_sizes`), if rows may go on
    past this chunk and be compacted (`beyond_chunk`: else a compaction cannot pay for its
    dispatch and compile); 0 (every row done, or the chunk's end) otherwise.

    Why: a finished row's slot decodes padding to the end of its chunk. On the long-tailed
    rollout row (W-cpu d1, 64 rows, median 64 tokens) 40% of the slot-steps did so.
    """
    if queued:
        return slots - min(queued, max(dp, slots // 8))
    return next(iter(smaller_sizes(slots, dp)), 0) if beyond_chunk else 0


class OnNewVersion(enum.Enum):
    """What a row still decoding when the weights change does (`async_rl.on_new_version`).

    CONTINUE (AReaL's interruptible generation): it goes on under the new weights, its cache
      recomputed with them (a prefill of its prompt and response so far, `Rollout.reload`);
      its earlier tokens keep their versions and behaviour log-probs.
    RESTART: it is aborted (`Rollout.abort`) and its request queued again, first: decoded anew
      under the new weights (same key and stream), the tokens it had are discarded.
    FINISH: it finishes under the weights it started with; the new ones take effect once no
      row decodes (queued requests wait for them, the free slots idle meanwhile).

    Every token a row has was sampled no earlier than its fill, under the newest weights then
    (CONTINUE's and FINISH's rows keep their oldest tokens; RESTART's start again): the
    staleness bound on a batch's oldest token holds in every mode.
    """

    CONTINUE = "continue"
    RESTART = "restart"
    FINISH = "finish"


class Occupancy(NamedTuple):
    """Decode work so far: slot_steps (slots times decode steps run over them, busy or not)
    and tokens (tokens sampled in them); tokens / slot_steps is the share of the decoded rows
    that were live."""

    slot_steps: int
    tokens: int


class Turn(NamedTuple):
    """A request's finished row: the request and its `Rows` fields, one row each
    (sequences_bs [P + N], ..., versions_bn [N])."""

    request: Request
    row: Rows


class Later(Protocol):
    """A continuation's result that comes later (an environment's reply)."""

    def done(self) -> bool:
        """Whether `result` returns without waiting."""

    def result(self) -> Request | list[Request] | None:
        """The next request (or requests), or None: the request's rows are done."""


@dataclasses.dataclass(eq=False)
class Request:
    """One row to decode.

    Attributes:
      tokens_p: int [P] the prompt ids, left-padded to the engine's P.
      mask_p: bool [P] True on them.
      key: a PRNG key on the engine's devices (replicated); token i samples with
        fold_in(fold_in(key, i), stream). Requests of one batch share the key object (the
        engine uploads each distinct key once).
      stream: the row's sampling stream (its index in its (micro-)batch).
      limit: the most response tokens (None: the engine's N).
      then: the continuation: called with the finished `Turn`, it returns the next request,
        None (done) or a `Later`.
      tag: the caller's.
    """

    tokens_p: np.ndarray
    mask_p: np.ndarray
    key: jax.Array
    stream: int
    limit: int | None = None
    then: Callable[[Turn], Request | Later | None] | None = None
    tag: object = None


class Finished(NamedTuple):
    """Rows read out in one look: the requests and their `Rows` fields, [k, ...] each, in
    the same order."""

    requests: list[Request]
    rows: Rows

    def turns(self) -> list[Turn]:
        return [Turn(r, self.rows.map(lambda x, i=i: x[i])) for i, r in enumerate(self.requests)]


class Stepped(NamedTuple):
    """One round of `Scheduler.step`: the rows finished (None: none), the requests whose rows
    had their caches recomputed under new weights before it (an interruption: CONTINUE), and
    those whose rows were aborted and queued again (RESTART)."""

    finished: Finished | None
    interrupted: list[Request]
    restarted: list[Request] = []


class Discarded(NamedTuple):
    """Work thrown away by RESTART so far: rows aborted, and the tokens they had sampled."""

    rows: int
    tokens: int


class Abandoned(RuntimeError):
    """`Scheduler.run` was told to stop with requests still pending (a stop signal during a
    multi-turn rollout whose environment is slow): it forgot them all (`Scheduler.drop`)."""


def wait_any(laters: Iterable[Later], stop: Callable[[], bool] | None = None) -> None:
    """Blocks until one of `laters` is done, or `stop()` says to stop (they share no event:
    short sleeps between looks; whoever makes them bounds the wait, e.g. the environment
    pool's timeout)."""
    laters = list(laters)
    while not any(later.done() for later in laters):
        if stop is not None and stop():
            return
        time.sleep(0.001)


def _joined(a: Finished | None, b: Finished | None) -> Finished | None:
    """Two read-outs as one (either may be None)."""
    if a is None or b is None:
        return b if a is None else a
    return Finished(a.requests + b.requests, Rows(*(
        None if x is None else np.concatenate([x, y]) for x, y in zip(a.rows, b.rows))))


class Scheduler:
    """Requests served in the slots of one rollout engine (module docstring).

    Args:
      engine: the rollout engine (its prompt length P, its layout).
      slots: rows decoded at once (a multiple of the data-parallel size; default the
        engine's).
      chunk_tokens: the most tokens decoded between looks at the slots.
      compact: whether `run` compacts the live rows into a smaller state when the queue is
        empty and no continuation may bring more (a scheduler that takes requests for ever,
        `step`, keeps its size).
      on_new_version: what a busy row does when `step` is given weights of a new version.
    """

    def __init__(self, engine: Rollout, slots: int | None = None,
                 chunk_tokens: int = CHUNK_TOKENS, compact: bool = True,
                 on_new_version: OnNewVersion = OnNewVersion.CONTINUE):
        self.engine, self.chunk_tokens, self.compact = engine, chunk_tokens, compact
        self.on_new_version = on_new_version
        self.size = engine.slots if slots is None else slots
        self._queue: collections.deque[Request] = collections.deque()
        self._later: list[tuple[Later, Request | None]] = []  # results on their way
        self.drop()

    def drop(self) -> None:
        """Forgets every request (queued, decoding or waiting): a fresh, vacant state."""
        self._queue.clear()
        self._later.clear()
        self._state = self.engine.vacant(self.size)  # built by the first fill
        self._in: list[Request | None] = [None] * self.size  # each slot's request
        self._done = np.zeros(self.size, bool)  # its row finished (at the last look)
        self._longest = 0  # at least every busy slot's response length so far
        self._counts = np.zeros(2, np.int64)  # the state's decode counts at the last look
        self._compacted = np.zeros(2, np.int64)  # those of the states compacted away
        self._lockstep = False  # every busy row was filled at once: all at one step
        self._version = None  # the weights the cache was computed with
        self._params = None  # FINISH: those weights (the busy rows may need them after)
        self._held = None  # FINISH: (params, version) the busy rows finish under
        self._discarded = [0, 0]  # RESTART: rows aborted, tokens of theirs (host ints)
        self._dropped: list[jax.Array] = []  # ...tokens not fetched yet (device scalars)

    def submit(self, requests: Iterable[Request]) -> None:
        """Queues requests, in order; they take slots as slots free up."""
        self._queue.extend(requests)

    def expect(self, later: Later) -> None:
        """Requests on their way (an environment's resets): `later`'s result, a request or a
        list of them, is queued once it is done."""
        self._later.append((later, None))

    @property
    def queued(self) -> int:
        return len(self._queue)

    @property
    def in_slots(self) -> int:
        """Slots holding a request's row (decoding, or finished and not read out yet)."""
        return sum(r is not None for r in self._in)

    @property
    def pending(self) -> bool:
        """Anything queued, decoding or waiting for its continuation."""
        return bool(self._queue or self._later or self._live())

    @property
    def occupancy(self) -> Occupancy:
        """Decode work so far (at the last look at the slots)."""
        return Occupancy(*(int(x) for x in self._compacted + self._counts))

    @property
    def discarded(self) -> Discarded:
        """The rows RESTART aborted so far and the tokens they had (a fetch of a few
        scalars, where there are new ones)."""
        if self._dropped:
            self._discarded[1] += int(sum(np.asarray(x) for x in fetch(self._dropped)))
            self._dropped = []
        return Discarded(*self._discarded)

    def step(self, params, version: int, stop: Callable[[], bool] | None = None) -> Stepped:
        """One round under `params` (of policy `version`, taking effect as `on_new_version`
        says); every finished row is read out. With nothing to decode but continuations on
        their way, it first waits for one, or until `stop()` says to stop."""
        if self._later and not self._queue and not self._live():
            wait_any((later for later, _ in self._later), stop)
        params, version, interrupted, restarted = self._weights(params, version)
        return Stepped(self._round(params, version, hold=False), interrupted, restarted)

    def run(self, params, version: int = 0,
            stop: Callable[[], bool] | None = None) -> list[Finished]:
        """Rounds until nothing is queued, decoding or waiting; the rows read out, in the
        order they were.

        Raises:
          Abandoned: `stop()` said to stop (asked before every round and while waiting for a
            continuation) with requests pending; they are forgotten.
        """
        out = []
        while self.pending:
            if stop is not None and stop():
                self.drop()
                raise Abandoned("stopped with requests pending")
            params, version, *_ = self._weights(params, version)
            finished = self._round(params, version, hold=True)
            if finished is not None:
                out.append(finished)
            elif not self._live() and not self._queue and self._later:
                wait_any((later for later, _ in self._later), stop)
        return out

    def _live(self) -> list[int]:
        return [s for s, r in enumerate(self._in) if r is not None and not self._done[s]]

    def _weights(self, params, version: int) -> tuple[object, int, list[Request], list[Request]]:
        """The weights a round decodes with, new ones taking effect as `on_new_version` says:
        (params, version, the requests whose caches were recomputed (CONTINUE), those aborted
        and queued again (RESTART))."""
        mode = self.on_new_version
        if self._held is not None:  # FINISH: the rows busy at the switch drain first
            if self._live():
                return (*self._held, [], [])
            self._held = None
        live = self._live() if version != self._version else []
        interrupted, restarted = [], []
        if live:
            match mode:
                case OnNewVersion.CONTINUE:
                    self._state = self.engine.reload(self._state, params, self._longest)
                    interrupted = [self._in[s] for s in live]
                case OnNewVersion.RESTART:
                    restarted = self._restart(live)
                case OnNewVersion.FINISH:
                    self._held = (self._params, self._version)
                    return (*self._held, [], [])
        self._version = version
        if mode is OnNewVersion.FINISH:  # kept only where they may be needed after
            self._params = params
        return params, version, interrupted, restarted

    def _restart(self, live: list[int]) -> list[Request]:
        """The rows of `live` (every busy slot) aborted and their requests queued again,
        first, in slot order; the requests."""
        requests = [self._in[s] for s in live]
        self._state, tokens = self.engine.abort(self._state, live)
        self._dropped.append(tokens)
        self._discarded[0] += len(live)
        for s in live:
            self._in[s], self._done[s] = None, False
        self._queue.extendleft(reversed(requests))
        self._longest = 0  # no busy row is left
        return requests

    def _round(self, params, version: int, hold: bool) -> Finished | None:
        """Continuations' results queued, a fill, a chunk, a look; the rows read out (`hold`:
        only those whose slots are needed or that nothing else waits behind)."""
        self._take_later()
        held = [s for s, r in enumerate(self._in) if r is not None and self._done[s]]
        early = None
        if held and self._queue and len(self._in) - self.in_slots < len(self._queue):
            early, held = self._harvest(held), []  # their slots take queued requests
        self._fill(params, version)
        live = self._live()
        if not live:
            return _joined(early, self._harvest(held))
        steps = self.engine.chunk_steps(self._state, self._longest, self.chunk_tokens)
        reach = max(self._limit(self._in[s]) for s in live)
        stop = self._stop_busy(live, steps, reach, hold)
        self._state = self.engine.advance(self._state, params, version, steps, self._longest,
                                          self._lockstep, stop)
        rows = None
        if self._lockstep and self._longest + steps >= reach:
            done_b, counts, rows = self.engine.collect(self._state)
        else:
            done_b, counts = self.engine.poll(self._state)
        self._longest, self._counts = int(counts[2]), counts[:2].astype(np.int64)
        occupied = [s for s, r in enumerate(self._in) if r is not None]
        self._done[occupied] = done_b[occupied]
        finished = [s for s in occupied if self._done[s]]
        live = [s for s in occupied if not self._done[s]]
        waited = any(self._in[s].then is not None for s in finished)
        if not hold or not live or self._queue or waited:
            return _joined(early, self._harvest(finished, rows))
        size = compacted_size(len(live), len(self._in), self.engine.layout.dp_size)
        if size >= len(self._in) or not self._may_compact(live):
            return early
        out = self._harvest(finished, rows)
        self._shrink(live, size)
        return _joined(early, out)

    def _may_compact(self, live: list[int]) -> bool:
        """Whether to compact: the scheduler compacts, and no continuation may bring more
        requests (a state is never grown back)."""
        return self.compact and not self._later and all(self._in[s].then is None for s in live)

    def _limit(self, request: Request) -> int:
        n_max = self.engine.cfg.max_new_tokens
        return n_max if request.limit is None else min(int(request.limit), n_max)

    def _stop_busy(self, live: list[int], steps: int, reach: int, hold: bool) -> int:
        """How few busy slots end the chunk (`stop_busy`; a compaction only where `run`
        compacts); as soon as a row ends its turn where a continuation waits for it (its
        environment call then starts at once)."""
        dp = self.engine.layout.dp_size
        beyond = hold and self._may_compact(live) and reach - self._longest > steps
        queued = 0 if self._held is not None else len(self._queue)  # FINISH: none fills yet
        stop = stop_busy(len(self._in), queued, dp, beyond)
        if any(self._in[s].then is not None for s in live):
            stop = max(stop, len(live) - 1)
        return stop

    def _fill(self, params, version: int) -> None:
        """Queued requests into free slots, taking turns over the devices (none while FINISH
        drains the rows of older weights)."""
        if not self._queue or self._held is not None:
            return
        free = [s for s, r in enumerate(self._in) if r is None]
        if not free:
            return
        busy_before = bool(self._live())
        take = [self._queue.popleft() for _ in range(min(len(free), len(self._queue)))]
        targets = self.engine.spread(free, len(self._in))[:len(take)]
        n_max = self.engine.cfg.max_new_tokens
        limits = None if all(r.limit is None for r in take) else np.array(
            [n_max if r.limit is None else r.limit for r in take], np.int32)
        self._state = self.engine.fill(
            self._state, params, version, targets, np.stack([r.tokens_p for r in take]),
            np.stack([r.mask_p for r in take]), [r.key for r in take],
            np.array([r.stream for r in take], np.int32), limits)
        for s, r in zip(targets, take):
            self._in[s], self._done[s] = r, False
        self._longest = max(self._longest, 1)
        # Rows filled together into a state with no busy row decode one step in lockstep
        # until another fill joins them.
        self._lockstep = not busy_before and not self._queue

    def _harvest(self, slot_list: list[int], rows: Rows | None = None) -> Finished | None:
        """The rows of `slot_list` read out and their slots freed; their continuations
        called."""
        if not slot_list:
            return None
        rows = self.engine.rows(self._state) if rows is None else rows
        requests = [self._in[s] for s in slot_list]
        out = Finished(requests, rows.map(lambda x: x[slot_list]))
        for s in slot_list:
            self._in[s], self._done[s] = None, False
        if any(r.then is not None for r in requests):
            for turn in out.turns():
                if turn.request.then is not None:
                    self._then(turn.request.then(turn), turn.request)
        return out

    def _then(self, nxt, request: Request | None) -> None:
        """A continuation's result: queued (a request, a list of them), done (None) or
        awaited (a `Later`)."""
        if isinstance(nxt, Request):
            self._queue.append(nxt)
        elif isinstance(nxt, list):
            self._queue.extend(nxt)
        elif nxt is not None:
            self._later.append((nxt, request))

    def _take_later(self) -> None:
        """Every continuation's result that arrived, queued (in the order they started)."""
        ready, waiting = [], []
        for item in self._later:
            (ready if item[0].done() else waiting).append(item)
        self._later = waiting
        for later, request in ready:
            self._then(later.result(), request)

    def _shrink(self, live: list[int], size: int) -> None:
        """The live rows compacted into a state of `size` slots, taking turns over the
        devices (each decodes its own slots), the free slots after them."""
        rest = sorted(set(range(len(self._in))) - set(live))
        keep = [0] * size
        for new, old in zip(self.engine.spread(list(range(size)), size), live + rest):
            keep[new] = old
        self._state = self.engine.compact(self._state, keep)
        # Devices that each stopped their chunk on their own left rows at different steps,
        # which compaction mixes on one device.
        engine = self.engine
        self._lockstep = self._lockstep and not (engine.per_device and engine.layout.dp_size > 1)
        self._compacted += self._counts
        self._counts = np.zeros(2, np.int64)
        self._in = [self._in[s] for s in keep]
        self._done = self._done[keep]
