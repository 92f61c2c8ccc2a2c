"""Rule-based reward functions and the process pool that evaluates them beside training.

A reward function is `fn(prompt: str, completion: str, answer: str | None) -> float`, named in a
config by a built-in name (`"exact_match"`), a module path (`"my_pkg.rewards:score"`) or a file
(`"/path/to/rewards.py:score"`).

User code is untrusted in the ways that matter to a long run: it may raise, hang or return junk.
`RewardPool` runs it in worker processes (forkserver or spawn, never fork: the trainer's JAX
runtime is multi-threaded) and turns every such failure into reward 0 plus a counted error, so a
bad sample can neither crash nor stall the step. A worker that overruns the per-call timeout is
killed and replaced. Batches are evaluated asynchronously: `submit` returns at once and the
caller collects with `.result()` after dispatching device work.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import enum
import importlib
import importlib.util
import inspect
import math
import multiprocessing
import multiprocessing.connection
import multiprocessing.resource_tracker
import numbers
import pathlib
import signal
import threading
import time
import traceback
from typing import Callable, Sequence

import numpy as np
from absl import logging

from jaxrlhf.data import sandbox
from jaxrlhf.data.code_reward import code_reward
from jaxrlhf.data.math_reward import math_reward

RewardFn = Callable[[str, str, "str | None"], float]


def extract_answer(completion: str) -> str:
    """The answer part of a completion: its text up to the first newline, stripped.

    The completion is expected to be decoded only up to its first stop token (EOS), see
    `tokenizer.decode_response`.
    """
    return completion.split("\n", 1)[0].strip()


def exact_match(prompt: str, completion: str, answer: str | None) -> float:
    """1.0 if the extracted answer equals the reference answer exactly, else 0.0."""
    del prompt  # the reference answer already says everything the prompt would
    if answer is None:
        raise ValueError("exact_match needs a reference answer; the prompt row has none")
    return float(extract_answer(completion) == answer.strip())


def zero(prompt: str, completion: str, answer: str | None) -> float:
    """Scores nothing: for benchmarks, which measure the system and not the policy."""
    return 0.0


# `math` (data/math_reward.py): \boxed{} / #### / last number, judged by math-verify;
# `code` (data/code_reward.py): the program run against the row's tests in a sandbox.
BUILTIN_REWARDS: dict[str, RewardFn] = {"exact_match": exact_match, "zero": zero,
                                         "math": math_reward, "code": code_reward}


# The built-in rewards that score against the row's reference `answer` (the tests, for code):
# every prompt row of a run with one of them must have one (`run/check.py`).
NEEDS_ANSWER = frozenset({"exact_match", "math", "code"})
# A failure's message is kept to this many characters: a function that raises with its
# completion in the message (a 1 MB one) would otherwise echo it into every log and error line.
MAX_MESSAGE_CHARS = 300


def resolve_reward(spec: str) -> RewardFn:
    """The reward function named by `spec` (built-in name, `module:fn` or `file.py:fn`).

    Raises:
      ValueError: (or FileNotFoundError) naming `spec`: an unknown name, a module that does not
        import (a syntax error, an exception at import), no such function, or one that cannot
        be called as fn(prompt, completion, answer); `code` on a machine without a working
        bubblewrap (`sandbox.SandboxUnavailable`, naming the package).
    """
    target, sep, name = spec.rpartition(":")
    if not sep:
        if spec not in BUILTIN_REWARDS:
            raise ValueError(
                f"unknown reward {spec!r}: use one of {sorted(BUILTIN_REWARDS)}, "
                "'module.path:function' or '/path/file.py:function'"
            )
        if spec == "code":  # refused here, before anything compiles, on a machine without it
            sandbox.require("the code reward")
        return BUILTIN_REWARDS[spec]
    module = _import(spec, target)
    fn = getattr(module, name, None)
    if not callable(fn):
        raise ValueError(f"reward {spec!r}: {target} has no function {name!r}")
    try:  # the pool calls fn(prompt, completion, answer)
        inspect.signature(fn).bind("prompt", "completion", "answer")
    except TypeError as e:
        raise ValueError(f"reward {spec!r}: {name}{inspect.signature(fn)} cannot be called as "
                         f"{name}(prompt, completion, answer) ({e})") from None
    except ValueError:  # a callable without a signature (a builtin): called as it is
        pass
    return fn


def _import(spec: str, target: str):
    """The module of a `module:fn` or `file.py:fn` reward; its import errors name the file and
    line (a reward module is user code: a syntax error or a failing import is their input)."""
    try:
        if not target.endswith(".py"):
            return importlib.import_module(target)
        path = pathlib.Path(target)
        if not path.is_file():
            raise FileNotFoundError(f"reward {spec!r}: no file {path}")
        module_spec = importlib.util.spec_from_file_location(f"_reward_{path.stem}", path)
        module = importlib.util.module_from_spec(module_spec)
        module_spec.loader.exec_module(module)
        return module
    except FileNotFoundError:
        raise
    except ModuleNotFoundError:
        raise  # "No module named ..." says it
    except SyntaxError as e:
        raise ValueError(f"reward {spec!r}: {e.filename}:{e.lineno}: SyntaxError: "
                         f"{e.msg}") from None
    except Exception as e:  # noqa: BLE001 - user code: whatever its import raises
        where = traceback.extract_tb(e.__traceback__)[-1]
        raise ValueError(f"reward {spec!r}: importing {target} failed at {where.filename}:"
                         f"{where.lineno}: {type(e).__name__}: {e}") from None


_FLOAT32_MAX = float(np.finfo(np.float32).max)


class ErrorKind(enum.Enum):
    EXCEPTION = "exception"  # the function raised, or its worker process died
    TIMEOUT = "timeout"  # the call overran the pool's timeout; its worker was killed
    BAD_VALUE = "bad_value"  # a non-number or a non-finite number came back


@dataclasses.dataclass(frozen=True)
class ErrorCounts:
    exception: int = 0
    timeout: int = 0
    bad_value: int = 0

    @property
    def total(self) -> int:
        return self.exception + self.timeout + self.bad_value

    @classmethod
    def of(cls, counter: collections.Counter) -> "ErrorCounts":
        return cls(**{kind.value: counter[kind] for kind in ErrorKind})

    def as_dict(self, prefix: str = "reward_errors/") -> dict[str, int]:
        return {f"{prefix}{k}": v for k, v in dataclasses.asdict(self).items()}


def _check_value(value) -> tuple[ErrorKind | None, float | str]:
    """(None, reward) for a finite real number, else (BAD_VALUE, description)."""
    if isinstance(value, np.ndarray) and value.shape == ():
        value = value.item()
    if not isinstance(value, numbers.Real):
        return ErrorKind.BAD_VALUE, f"returned a {type(value).__name__}, not a number"
    if not math.isfinite(float(value)):
        return ErrorKind.BAD_VALUE, f"returned {float(value)}"
    if abs(float(value)) > _FLOAT32_MAX:  # rewards travel as float32: this would become inf
        return ErrorKind.BAD_VALUE, f"returned {float(value)}, outside the float32 range"
    return None, float(value)


# Ctrl-C in a terminal, and SIGTERM from `timeout`, Slurm or Kubernetes, reach the whole process
# group; the trainer handles them (it finishes its step, saves a checkpoint and closes the
# pool), so a worker must not die mid-call and zero a reward, or break the pool under the step.
_STOP_SIGNALS = {signal.SIGINT, signal.SIGTERM}


@contextlib.contextmanager
def _stop_signals_blocked():
    """Blocks SIGINT and SIGTERM in the calling thread while it starts a worker: the child (and
    a forkserver started now) inherits the blocked mask from its first instruction, so that no
    stop signal sent to the group can kill it before `_worker_main` ignores them. A signal that
    comes meanwhile waits, and reaches the trainer once they are unblocked.

    The resource tracker starts first, outside the block: starting it unblocks both signals in
    the calling thread (multiprocessing blocks and then unblocks them around its launch), and a
    forkserver launched after that would pass the unblocked mask to every worker it forks."""
    multiprocessing.resource_tracker.ensure_running()
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, _STOP_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)


def _worker_main(spec: str, conn: multiprocessing.connection.Connection,
                 resolve: Callable = resolve_reward, check: Callable = _check_value) -> None:
    """Worker loop: resolve the function (`resolve(spec)`), then answer (id, *args) requests
    with `check(fn(*args))`. It ignores stop signals (`_STOP_SIGNALS`): the trainer closes the
    pool when it is done."""
    for sig in _STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    try:
        fn = resolve(spec)
    except Exception as e:  # noqa: BLE001 - reported to the parent, which stops the pool
        conn.send(("init_error", None, f"{type(e).__name__}: {e}"))
        return
    conn.send(("ready", None, None))
    while True:
        try:
            request = conn.recv()
        except EOFError:
            return
        if request is None:
            return
        item_id, *args = request
        try:
            kind, payload = check(fn(*args))
        except Exception as e:  # noqa: BLE001 - user code: any failure is a counted error
            kind, payload = ErrorKind.EXCEPTION, f"{type(e).__name__}: {e}"
        conn.send((item_id, None if kind is None else kind.value, payload))


@dataclasses.dataclass(frozen=True)
class RewardBatch:
    """Rewards of one submitted batch.

    Attributes:
      rewards_b: float32 [B]; 0 where the call failed.
      valid_b: bool [B]; False where the call failed.
      errors: failures of this batch by kind.
      messages: "index: kind: message" for each failure, for logs.
    """

    rewards_b: np.ndarray
    valid_b: np.ndarray
    errors: ErrorCounts
    messages: tuple[str, ...]


def clipped(text: str, limit: int = MAX_MESSAGE_CHARS) -> str:
    """`text` cut to `limit` characters, saying how long it was."""
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text):,} characters)"


class RewardPoolError(RuntimeError):
    """The pool cannot evaluate anything (workers fail to start, or it was closed)."""


class RewardHandle:
    """The future result of `RewardPool.submit`."""

    def __init__(self, size: int):
        self._rewards_b = np.zeros(size, np.float32)
        self._valid_b = np.zeros(size, bool)
        self._errors: collections.Counter = collections.Counter()
        self._messages: list[str] = []
        self._remaining = size
        self._failure: str | None = None
        self._done = threading.Event()
        if size == 0:
            self._done.set()

    def _record(self, index: int, kind: ErrorKind | None, payload) -> None:
        if kind is None:
            self._rewards_b[index], self._valid_b[index] = payload, True
        else:
            self._errors[kind] += 1
            self._messages.append(f"{index}: {kind.value}: {clipped(str(payload))}")
        self._remaining -= 1
        if self._remaining == 0:
            self._done.set()

    def _fail(self, reason: str) -> None:
        self._failure = reason
        self._done.set()

    def done(self) -> bool:
        return self._done.is_set()

    def result(self, timeout: float | None = None) -> RewardBatch:
        """Blocks until every reward of the batch is known.

        Raises:
          TimeoutError: not done within `timeout` seconds.
          RewardPoolError: the pool broke or was closed before finishing the batch.
        """
        if not self._done.wait(timeout):
            raise TimeoutError(f"reward batch not done after {timeout} s")
        if self._failure is not None:
            raise RewardPoolError(self._failure)
        return RewardBatch(
            rewards_b=self._rewards_b.copy(),
            valid_b=self._valid_b.copy(),
            errors=ErrorCounts.of(self._errors),
            messages=tuple(self._messages),
        )


class StartMethod(enum.Enum):
    """How worker processes start. Never fork: forking a multi-threaded JAX process can deadlock."""

    FORKSERVER = "forkserver"  # fast restarts: children fork from a clean single-threaded server
    SPAWN = "spawn"  # a fresh interpreter per worker; portable


class _State(enum.Enum):
    STARTING = "starting"  # resolving the reward function; not yet given work
    IDLE = "idle"
    BUSY = "busy"


@dataclasses.dataclass(frozen=True)
class _Item:
    handle: RewardHandle
    index: int
    request: tuple  # fn's arguments


@dataclasses.dataclass
class _Worker:
    process: multiprocessing.process.BaseProcess
    conn: multiprocessing.connection.Connection
    state: _State
    since: float  # monotonic time it entered `state`
    item: _Item | None = None
    item_id: int = -1


class RewardPool:
    """Evaluates a reward function over batches in worker processes, asynchronously.

    Use as a context manager (or call `close`). One background thread hands single calls to idle
    workers, collects replies and enforces the per-call timeout; the calling thread only
    enqueues (`submit`) and collects (`RewardHandle.result`).
    """

    def __init__(
        self,
        spec: str,
        *,
        num_workers: int = 2,
        timeout_s: float = 10.0,
        startup_timeout_s: float = 120.0,
        start_method: StartMethod = StartMethod.FORKSERVER,
        resolve: Callable = resolve_reward,
        check: Callable = _check_value,
        what: str = "reward",
    ):
        """`resolve(spec)` gives the function the workers call, `check(value)` turns what it
        returns into (None, payload) or (ErrorKind, message); both module-level (they travel
        to the workers): a reward function and `_check_value` unless told otherwise. `what`
        names the workers in errors."""
        if num_workers < 1:
            raise ValueError(f"num_workers must be positive, got {num_workers}")
        resolve(spec)  # a bad spec fails here, in the caller, not in a worker
        self._spec, self._resolve, self._check, self._what = spec, resolve, check, what
        self._timeout_s = timeout_s
        self._startup_timeout_s = startup_timeout_s
        self._ctx = multiprocessing.get_context(start_method.value)
        if start_method is StartMethod.FORKSERVER:
            # Children then fork with this module imported, instead of each importing it anew.
            self._ctx.set_forkserver_preload([__name__])
        self._lock = threading.Lock()
        self._pending: collections.deque[_Item] = collections.deque()
        self._closing = False
        self._broken: str | None = None
        self._cancelled: set[int] = set()  # ids of cancelled handles (`cancel`)
        self._errors: collections.Counter = collections.Counter()
        self._warned: set[ErrorKind] = set()  # `_warn_once`
        self._next_item_id = 0
        self._wake_r, self._wake_w = self._ctx.Pipe(duplex=False)
        self._workers = [self._start_worker() for _ in range(num_workers)]
        self._thread = threading.Thread(target=self._run, name="reward-pool", daemon=True)
        self._thread.start()

    def __enter__(self) -> "RewardPool":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def submit(
        self,
        prompts: Sequence[str],
        completions: Sequence[str],
        answers: Sequence[str | None] | None = None,
    ) -> RewardHandle:
        """Queues one call per sample and returns at once.

        Raises:
          ValueError: the sequences differ in length.
          RewardPoolError: the pool is closed or broken.
        """
        answers = [None] * len(prompts) if answers is None else answers
        if not len(prompts) == len(completions) == len(answers):
            raise ValueError(
                f"{len(prompts)} prompts, {len(completions)} completions, {len(answers)} answers"
            )
        return self.submit_calls(list(zip(prompts, completions, answers)),
                                 RewardHandle(len(prompts)))

    def submit_calls(self, requests: Sequence[tuple], handle: RewardHandle) -> RewardHandle:
        """Queues fn(*request) for every request (result i goes to `handle`'s entry i) and
        returns `handle` at once.

        Raises:
          RewardPoolError: the pool is closed or broken.
        """
        with self._lock:
            if self._closing or self._broken:
                raise RewardPoolError(self._broken or "reward pool is closed")
            self._pending.extend(_Item(handle, i, tuple(r)) for i, r in enumerate(requests))
        self._wake_w.send_bytes(b"x")
        return handle

    def cancel(self, handles: Sequence[RewardHandle]) -> None:
        """Drops the calls of `handles` not answered yet: the queued ones never start, the
        workers running one are killed and replaced (as after a timeout, uncounted), and each
        handle fails ("cancelled"). For work abandoned by a stop: closing the pool would
        otherwise finish it first."""
        ids = {id(h) for h in handles}
        with self._lock:
            self._pending = collections.deque(i for i in self._pending
                                               if id(i.handle) not in ids)
            self._cancelled |= ids
        for handle in handles:
            if not handle.done():
                handle._fail("cancelled")
        self._wake_w.send_bytes(b"x")

    def error_counts(self) -> ErrorCounts:
        """Failures of every call so far, by kind."""
        with self._lock:
            return ErrorCounts.of(self._errors)

    def close(self) -> None:
        """Finishes queued work (bounded by the timeouts), then stops every worker."""
        with self._lock:
            if self._closing:
                return
            self._closing = True
        self._wake_w.send_bytes(b"x")
        self._thread.join()
        for worker in self._workers:
            try:
                worker.conn.send(None)
            except OSError:
                pass  # already dead
        for worker in self._workers:
            worker.process.join(timeout=2.0)
            self._stop(worker)
        self._wake_r.close()
        self._wake_w.close()

    # --- everything below runs on the dispatcher thread ---

    def _start_worker(self) -> _Worker:
        parent_conn, child_conn = self._ctx.Pipe()
        process = self._ctx.Process(
            target=_worker_main, args=(self._spec, child_conn, self._resolve, self._check),
            name="reward-worker", daemon=True
        )
        with _stop_signals_blocked():
            process.start()
        child_conn.close()  # so the worker sees EOF if this process goes away
        return _Worker(process, parent_conn, _State.STARTING, time.monotonic())

    def _stop(self, worker: _Worker) -> None:
        if worker.process.is_alive():
            worker.process.kill()
            worker.process.join(timeout=5.0)
        worker.conn.close()

    def _replace(self, worker: _Worker) -> None:
        self._stop(worker)
        self._workers[self._workers.index(worker)] = self._start_worker()

    def _run(self) -> None:
        try:
            while not self._finished():
                self._dispatch()
                ready = multiprocessing.connection.wait(
                    [self._wake_r] + [w.conn for w in self._workers], self._wait_timeout()
                )
                by_conn = {w.conn: w for w in self._workers}
                for conn in ready:
                    if conn is self._wake_r:
                        while self._wake_r.poll():
                            self._wake_r.recv_bytes()
                    else:
                        self._receive(by_conn[conn])
                self._expire(time.monotonic())
                self._kill_cancelled()
        except Exception as e:  # a dispatcher bug must fail the callers, not strand them
            logging.exception("reward pool dispatcher failed")
            self._break(f"reward pool dispatcher failed: {e!r}")

    def _finished(self) -> bool:
        with self._lock:
            if self._broken:
                return True
            idle = not self._pending and all(w.state is not _State.BUSY for w in self._workers)
            return self._closing and idle

    def _dispatch(self) -> None:
        for worker in list(self._workers):
            if worker.state is not _State.IDLE:
                continue
            with self._lock:
                if not self._pending:
                    return
                item = self._pending.popleft()
            self._next_item_id += 1
            try:
                worker.conn.send((self._next_item_id, *item.request))
            except OSError:  # died while idle: retry the item on its replacement
                with self._lock:
                    self._pending.appendleft(item)
                self._replace(worker)
                continue
            worker.state, worker.since = _State.BUSY, time.monotonic()
            worker.item, worker.item_id = item, self._next_item_id

    def _wait_timeout(self) -> float | None:
        deadlines = [
            w.since + (self._timeout_s if w.state is _State.BUSY else self._startup_timeout_s)
            for w in self._workers
            if w.state is not _State.IDLE
        ]
        return max(0.0, min(deadlines) - time.monotonic()) if deadlines else None

    def _finish_item(self, worker: _Worker, kind: ErrorKind | None, payload) -> None:
        item = worker.item
        worker.state, worker.since, worker.item = _State.IDLE, time.monotonic(), None
        if kind is not None:
            with self._lock:
                self._errors[kind] += 1
        item.handle._record(item.index, kind, payload)

    def _receive(self, worker: _Worker) -> None:
        try:
            tag, kind, payload = worker.conn.recv()
        except (EOFError, OSError):
            worker.process.join(timeout=1.0)  # reap it, for the exit code in the message
            code = worker.process.exitcode
            if worker.state is _State.BUSY:
                self._warn_once(ErrorKind.EXCEPTION,
                                f"{self._what} worker died (exit code {code}); replacing it")
                self._finish_item(worker, ErrorKind.EXCEPTION, f"worker died (exit code {code})")
                self._replace(worker)
            elif worker.state is _State.STARTING:
                self._break(f"{self._what} worker for {self._spec!r} died while starting ({code})")
            else:
                self._replace(worker)
            return
        match tag:
            case "ready":
                worker.state, worker.since = _State.IDLE, time.monotonic()
            case "init_error":
                self._break(f"{self._what} worker cannot load {self._spec!r}: {payload}")
            case item_id if item_id == worker.item_id:
                self._finish_item(worker, None if kind is None else ErrorKind(kind), payload)
            case _:
                raise RuntimeError(f"reply {tag!r} for item {worker.item_id} from a worker")

    def _expire(self, now: float) -> None:
        for worker in list(self._workers):
            match worker.state:
                case _State.BUSY if now - worker.since > self._timeout_s:
                    self._warn_once(ErrorKind.TIMEOUT, f"{self._what} call overran "
                                    f"{self._timeout_s:.1f} s; killing its worker")
                    self._finish_item(worker, ErrorKind.TIMEOUT, f"no reply in {self._timeout_s} s")
                    self._replace(worker)
                case _State.STARTING if now - worker.since > self._startup_timeout_s:
                    self._break(f"{self._what} worker not ready after {self._startup_timeout_s} s")

    def _kill_cancelled(self) -> None:
        """Workers busy on a cancelled handle's call killed and replaced."""
        with self._lock:
            cancelled, self._cancelled = self._cancelled, set()
        for worker in list(self._workers):
            if worker.state is _State.BUSY and id(worker.item.handle) in cancelled:
                worker.state, worker.item = _State.IDLE, None
                self._replace(worker)

    def _warn_once(self, kind: ErrorKind, message: str) -> None:
        """Logs the pool's first failure of `kind`; the later ones are counted (the step's
        reward errors, and the error line if too many stop the run), not logged: a function
        that kills its worker on every call printed a warning per call."""
        if kind not in self._warned:
            self._warned.add(kind)
            logging.warning("%s (later ones are counted in the %s errors, not logged)",
                            message, self._what)

    def _break(self, reason: str) -> None:
        """Fails every unfinished batch: the pool can no longer make progress."""
        with self._lock:
            self._broken = reason
            handles = {id(i.handle): i.handle for i in self._pending}
            self._pending.clear()
        handles.update({id(w.item.handle): w.item.handle for w in self._workers if w.item})
        for handle in handles.values():
            handle._fail(reason)
