"""The prompt-row shapes users bring (GSM8K's question/answer, MATH's problem/solution) read by
the run's readers, JSONL and parquet alike, and scored by the `math` reward from their full
solutions."""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from jaxrlhf.data.datasets import DataError, PromptRow, RowKind, read_rows
from jaxrlhf.data.math_reward import math_reward

GSM8K = [{"question": "Janet has 16 eggs, eats 3. How many?", "answer": "16-3=13\n#### 13"},
         {"question": "Big?", "answer": "1000+234 = 1,234\n#### 1,234"}]
MATH = [{"problem": "What is $\\frac{1}{2}+\\frac{1}{4}$?", "level": "Level 1",
         "solution": "Add: $\\frac{2}{4}+\\frac{1}{4}=\\boxed{\\frac{3}{4}}$."}]


def _write(path, records):
    if path.suffix == ".jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in records) + "\n")
    else:
        pq.write_table(pa.Table.from_pylist(records), path)
    return path


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
def test_gsm8k_rows_keep_the_solution_that_the_math_reward_reduces(tmp_path, suffix):
    rows = read_rows(_write(tmp_path / f"gsm{suffix}", GSM8K), RowKind.PROMPT)
    assert rows == [PromptRow(r["question"], r["answer"]) for r in GSM8K]
    assert math_reward(rows[0].prompt, "so #### 13", rows[0].answer) == 1.0
    assert math_reward(rows[0].prompt, "#### 12", rows[0].answer) == 0.0
    assert math_reward(rows[1].prompt, "so \\boxed{1,234}", rows[1].answer) == 1.0


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
def test_math_rows_read_problem_and_solution(tmp_path, suffix):
    rows = read_rows(_write(tmp_path / f"math{suffix}", MATH), RowKind.PROMPT)
    assert rows == [PromptRow(MATH[0]["problem"], MATH[0]["solution"])]
    assert math_reward(rows[0].prompt, "It is \\boxed{0.75}", rows[0].answer) == 1.0
    assert math_reward(rows[0].prompt, "It is \\boxed{1/2}", rows[0].answer) == 0.0


def test_a_row_without_any_prompt_shape_names_them(tmp_path):
    path = _write(tmp_path / "bad.jsonl", [{"text": "q", "answer": "1"}])
    with pytest.raises(DataError, match="'prompt' is missing .*'question' or 'problem'"):
        read_rows(path, RowKind.PROMPT)
