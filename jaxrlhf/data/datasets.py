"""Dataset files: JSONL and parquet readers/writers for prompt, preference and SFT rows, and a
deterministic, resumable epoch iterator over them.

Every malformed row raises `DataError` naming the file, the place (1-based line for JSONL,
0-based row index for parquet) and the field, so a bad row in a million-line file is found at
once rather than as a shape error deep inside a jitted step.

A prompt row carries its prompt as `prompt` (text), as `messages` (a chat: role/content
objects, rendered with the model's chat template when the data loads, see `data/chat.py`), or
GSM8K-style as `question` (its `answer` then holds the solution ending in `#### N`, which the
`math` reward reduces to N), or MATH-style as `problem` with its answer as `solution` (a worked
solution whose `\\boxed{}` the `math` reward reduces to the answer).
"""

from __future__ import annotations

import dataclasses
import enum
import json
import pathlib
from collections.abc import Mapping
from typing import Any, Generic, Iterator, Sequence, TypeVar

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq


class DataError(ValueError):
    """A malformed dataset row.

    Attributes:
      path: the file.
      location: "line N" (JSONL, 1-based) or "row N" (parquet, 0-based), or "" for the file.
      field: the offending field name, or None when the whole row is bad.
    """

    def __init__(self, path: str | pathlib.Path, location: str, field: str | None, problem: str):
        self.path = str(path)
        self.location = location
        self.field = field
        where = f"{self.path}:{location}" if location else self.path
        what = f"field {field!r} {problem}" if field else problem
        super().__init__(f"{where}: {what}")


class RowKind(enum.Enum):
    """Which rows a file holds."""

    PROMPT = "prompt"  # RL prompts, optionally with a reference answer for verifiable rewards
    PREFERENCE = "preference"  # reward modelling and DPO
    SFT = "sft"  # supervised warm start


class FileFormat(enum.Enum):
    JSONL = "jsonl"
    PARQUET = "parquet"

    @classmethod
    def of(cls, path: str | pathlib.Path) -> "FileFormat":
        match pathlib.Path(path).suffix.lower():
            case ".jsonl":
                return cls.JSONL
            case ".parquet" | ".pq":
                return cls.PARQUET
            case suffix:
                raise ValueError(f"{path}: unknown dataset format {suffix!r} (.jsonl or .parquet)")


Message = Mapping[str, Any]  # {"role": "system" | "user" | "assistant", "content": str, ...}


@dataclasses.dataclass(frozen=True)
class PromptRow:
    prompt: str
    answer: str | None = None
    # The prompt's token ids when they are not simply its encoding (a chat-templated prompt, or
    # data.long_prompts=truncate_left's last rollout.max_prompt_len ids); None: encode `prompt`.
    prompt_ids: tuple[int, ...] | None = None
    # A chat to render with the chat template instead of `prompt` (which is "" until then).
    messages: tuple[Message, ...] | None = None


@dataclasses.dataclass(frozen=True)
class PreferenceRow:
    prompt: str
    chosen: str
    rejected: str


@dataclasses.dataclass(frozen=True)
class SFTRow:
    prompt: str
    response: str
    # A multi-turn demonstration instead of `response` (which is "" then): the turns after
    # the prompt, the policy's (`assistant`, trained) and its environment's (`tool`, `user`:
    # context only), as `data/transcript.py` renders a rollout's trajectory.
    messages: tuple[Message, ...] | None = None


Row = PromptRow | PreferenceRow | SFTRow


@dataclasses.dataclass(frozen=True)
class FieldNames:
    """Column/key names in the file for each row attribute (defaults: the attribute names)."""

    prompt: str = "prompt"
    answer: str = "answer"
    messages: str = "messages"
    question: str = "question"  # GSM8K's name of the prompt
    problem: str = "problem"  # MATH's name of the prompt
    solution: str = "solution"  # MATH's name of the answer (a solution with a \\boxed{} one)
    chosen: str = "chosen"
    rejected: str = "rejected"
    response: str = "response"


def _row_schema(kind: RowKind) -> tuple[type, tuple[str, ...], tuple[str, ...]]:
    """(row class, required attributes, optional attributes) of a row kind."""
    match kind:
        case RowKind.PROMPT:
            return PromptRow, ("prompt",), ("answer",)
        case RowKind.PREFERENCE:
            return PreferenceRow, ("prompt", "chosen", "rejected"), ()
        case RowKind.SFT:
            return SFTRow, ("prompt", "response"), ()


def row_kind_of(row: Row) -> RowKind:
    match row:
        case PromptRow():
            return RowKind.PROMPT
        case PreferenceRow():
            return RowKind.PREFERENCE
        case SFTRow():
            return RowKind.SFT
    raise TypeError(f"not a dataset row: {row!r}")


def _messages(value: Any, path, location: str, key: str) -> tuple[Message, ...]:
    """A validated chat: a non-empty list of objects with string `role` and `content`."""
    if not isinstance(value, (list, tuple)) or not value:
        raise DataError(path, location, key, "is not a non-empty list of messages")
    for i, message in enumerate(value):
        if not isinstance(message, Mapping) or not all(
                isinstance(message.get(k), str) for k in ("role", "content")):
            raise DataError(path, location, key,
                            f"message {i} is not an object with string 'role' and 'content'")
    return tuple(dict(m) for m in value)


def _make_row(record: Any, kind: RowKind, names: FieldNames, path, location: str) -> Row:
    """Validates one decoded record and builds its row."""
    if not isinstance(record, dict):
        raise DataError(path, location, None, f"is a {type(record).__name__}, not an object")
    cls, required, optional = _row_schema(kind)
    values = {}
    if kind is RowKind.SFT and record.get(names.response) is None and (
            record.get(names.messages) is not None):  # a multi-turn demonstration
        values = {"response": "", "messages": _messages(record[names.messages], path, location,
                                                        names.messages)}
        required = ("prompt",)
    if kind is RowKind.PROMPT and record.get(names.prompt) is None:
        if record.get(names.messages) is not None:  # a chat, templated when the data loads
            values = {"prompt": "", "messages": _messages(record[names.messages], path,
                                                          location, names.messages)}
            required = ()
        elif record.get(names.question) is not None:  # GSM8K
            record = {**record, names.prompt: record[names.question]}
        elif record.get(names.problem) is not None:  # MATH
            record = {**record, names.prompt: record[names.problem]}
        else:
            raise DataError(path, location, names.prompt,
                            f"is missing (and there is no {names.messages!r}, "
                            f"{names.question!r} or {names.problem!r})")
    if kind is RowKind.PROMPT and record.get(names.answer) is None and (
            record.get(names.solution) is not None):  # MATH
        record = {**record, names.answer: record[names.solution]}
    for attr in required + optional:
        key = getattr(names, attr)
        value = record.get(key)
        if value is None:
            if attr in optional:
                continue
            raise DataError(path, location, key, "is missing")
        if not isinstance(value, str):
            raise DataError(path, location, key, f"is a {type(value).__name__}, not a string")
        if not value.strip():
            raise DataError(path, location, key, "is empty")
        values[attr] = value
    return cls(**values)


def jsonl_records(path: pathlib.Path):
    """Yields ("line N", parsed record) for each non-blank line of a JSONL file.

    Raises:
      DataError: a line is not UTF-8 or not valid JSON, naming the file and line.
    """
    with path.open("rb") as f:  # bytes: a bad byte is named by its line, not its file offset
        for line_no, raw in enumerate(f, start=1):
            location = f"line {line_no}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise DataError(path, location, None, f"is not UTF-8 (byte 0x{raw[e.start]:02x} "
                                f"at column {e.start + 1})") from None
            if not line.strip():  # tolerate blank lines, e.g. a trailing newline
                continue
            try:
                yield location, json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(path, location, None, f"is not valid JSON ({e.msg})") from e


def _read_jsonl(path: pathlib.Path, kind: RowKind, names: FieldNames) -> list[Row]:
    return [_make_row(record, kind, names, path, location)
            for location, record in jsonl_records(path)]


def _read_parquet(path: pathlib.Path, kind: RowKind, names: FieldNames) -> list[Row]:
    parquet = pq.ParquetFile(path)
    _, required, optional = _row_schema(kind)
    present = set(parquet.schema_arrow.names)
    if kind is RowKind.PROMPT:  # the prompt may come as messages, GSM8K's question or MATH's
        alternatives = [n for n in (names.messages, names.question, names.problem)
                        if n in present]
        optional = optional + tuple(a for a in ("messages", "question", "problem", "solution")
                                    if getattr(names, a) in present)
        required = () if alternatives else required
    for attr in required:
        if getattr(names, attr) not in present:
            raise DataError(path, "", getattr(names, attr), "is missing (no such column)")
    columns = [getattr(names, a) for a in required + optional if getattr(names, a) in present]
    rows = []
    for batch in parquet.iter_batches(columns=columns):
        for record in batch.to_pylist():
            rows.append(_make_row(record, kind, names, path, f"row {len(rows)}"))
    return rows


def read_rows(
    path: str | pathlib.Path, kind: RowKind, names: FieldNames = FieldNames()
) -> list[Row]:
    """All rows of a .jsonl or .parquet file, validated.

    Raises:
      DataError: a row is not an object, or a field is missing, empty or not a string.
    """
    path = pathlib.Path(path)
    match FileFormat.of(path):
        case FileFormat.JSONL:
            rows = _read_jsonl(path, kind, names)
        case FileFormat.PARQUET:
            rows = _read_parquet(path, kind, names)
    if not rows:
        raise DataError(path, "", None, "holds no rows")
    return rows


def _to_record(row: Row, names: FieldNames) -> dict[str, Any]:
    """The file record of `row`; a chat row is written as its messages (no `prompt`)."""
    record = {
        getattr(names, f.name): getattr(row, f.name)
        for f in dataclasses.fields(row)
        if getattr(row, f.name) is not None and f.name not in ("prompt_ids", "messages")
    }
    if isinstance(row, PromptRow) and row.messages is not None:
        del record[names.prompt]
        record[names.messages] = [dict(m) for m in row.messages]
    if isinstance(row, SFTRow) and row.messages is not None:  # its turns, not a response
        del record[names.response]
        record[names.messages] = [dict(m) for m in row.messages]
    return record


def write_rows(
    path: str | pathlib.Path, rows: Sequence[Row], names: FieldNames = FieldNames()
) -> pathlib.Path:
    """Writes rows (all of one kind) as .jsonl or .parquet, by the path's suffix."""
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    records = [_to_record(r, names) for r in rows]
    match FileFormat.of(path):
        case FileFormat.JSONL:
            with path.open("w", encoding="utf-8") as f:
                for record in records:
                    f.write(json.dumps(record, ensure_ascii=False) + "\n")
        case FileFormat.PARQUET:
            # An explicit schema keeps an all-None optional column typed as string.
            cls, required, optional = _row_schema(row_kind_of(rows[0]))
            if any(getattr(r, "messages", None) is not None for r in rows):
                raise ValueError(f"{path}: chat (messages) rows are written as .jsonl")
            schema = pa.schema([(getattr(names, a), pa.string()) for a in required + optional])
            columns = {n: [rec.get(n) for rec in records] for n in schema.names}
            pq.write_table(pa.table(columns, schema=schema), path)
    return path


RowT = TypeVar("RowT")


@dataclasses.dataclass(frozen=True)
class IteratorState:
    """Where an EpochIterator is: `epoch` and the number of batches already taken from it."""

    epoch: int
    batch: int

    def to_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, int]) -> "IteratorState":
        return cls(epoch=int(d["epoch"]), batch=int(d["batch"]))


class EpochIterator(Generic[RowT]):
    """An endless iterator of fixed-size batches, reshuffled every epoch.

    The order of epoch e is a pure function of (seed, e), so the whole sequence can be resumed
    from `state()` in a fresh process. Each epoch yields `len(rows) // batch_size` batches; the
    remainder is dropped (shapes stay static) but differs per epoch, so no row is lost for good.
    """

    def __init__(
        self, rows: Sequence[RowT], batch_size: int, *, seed: int = 0, shuffle: bool = True
    ):
        if batch_size < 1:
            raise ValueError(f"batch_size must be positive, got {batch_size}")
        if len(rows) < batch_size:
            raise ValueError(f"{len(rows)} rows cannot fill one batch of {batch_size}")
        self._rows = list(rows)
        self._batch_size = batch_size
        self._seed = seed
        self._shuffle = shuffle
        self._state = IteratorState(epoch=0, batch=0)
        self._order = self._epoch_order(0)

    @property
    def batches_per_epoch(self) -> int:
        return len(self._rows) // self._batch_size

    def _epoch_order(self, epoch: int) -> np.ndarray:
        if not self._shuffle:
            return np.arange(len(self._rows))
        return np.random.default_rng([self._seed, epoch]).permutation(len(self._rows))

    def state(self) -> IteratorState:
        return self._state

    def restore(self, state: IteratorState | dict[str, int]) -> None:
        if isinstance(state, dict):
            state = IteratorState.from_dict(state)
        if not 0 <= state.batch <= self.batches_per_epoch:
            raise ValueError(f"{state} is outside an epoch of {self.batches_per_epoch} batches")
        self._state = state
        self._order = self._epoch_order(state.epoch)

    def __iter__(self) -> Iterator[list[RowT]]:
        return self

    def _next_at(self, state: IteratorState) -> tuple[IteratorState, int]:
        """(the state after the batch drawn at `state`, that batch's epoch)."""
        if state.batch == self.batches_per_epoch:
            return IteratorState(epoch=state.epoch + 1, batch=1), state.epoch + 1
        return IteratorState(epoch=state.epoch, batch=state.batch + 1), state.epoch

    def indices(self, state: IteratorState) -> np.ndarray:
        """int [batch_size]: the rows' indices (in the rows given) of the batch drawn at
        `state` (the state before it), e.g. to log which rows an update trained on."""
        after, epoch = self._next_at(state)
        order = self._order if epoch == self._state.epoch else self._epoch_order(epoch)
        start = (after.batch - 1) * self._batch_size
        return order[start : start + self._batch_size].copy()

    def __next__(self) -> list[RowT]:
        indices = self.indices(self._state)
        after, epoch = self._next_at(self._state)
        if epoch != self._state.epoch:
            self._order = self._epoch_order(epoch)
        self._state = after
        return [self._rows[i] for i in indices]
