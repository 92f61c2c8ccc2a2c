"""A local GSM8K-style JSONL reader: `{"question": ..., "answer": "...reasoning...\\n#### 18"}`.

Each line becomes a `PromptRow` whose prompt is the question and whose answer is the final
answer after `####` (thousands commas removed), ready for the `math` reward.
"""

from __future__ import annotations

import pathlib
import re

from jaxrlhf.data.datasets import DataError, PromptRow, jsonl_records

_FINAL = re.compile(r"####\s*(.+?)\s*$", re.DOTALL)


def gsm8k_final_answer(solution: str) -> str | None:
    """The text after the last `####` of a GSM8K solution (commas dropped), or None."""
    tail = solution.rsplit("####", 1)
    if len(tail) < 2:
        return None
    match = _FINAL.match("####" + tail[1])
    return match.group(1).replace(",", "") if match else None


def read_gsm8k(path: str | pathlib.Path) -> list[PromptRow]:
    """Rows of a GSM8K-style JSONL file; blank lines are skipped.

    Raises:
      DataError: a line is not JSON, lacks a string `question`/`answer`, or the answer has no
        `#### N` final answer.
    """
    path = pathlib.Path(path)
    rows = []
    for location, record in jsonl_records(path):
        if not isinstance(record, dict):
            raise DataError(path, location, None, "is not an object")
        for key in ("question", "answer"):
            if not isinstance(record.get(key), str) or not record[key].strip():
                raise DataError(path, location, key, "is missing or not a non-empty string")
        final = gsm8k_final_answer(record["answer"])
        if not final:
            raise DataError(path, location, "answer", "has no '#### N' final answer")
        rows.append(PromptRow(prompt=record["question"], answer=final))
    if not rows:
        raise DataError(path, "", None, "holds no rows")
    return rows
