"""GSM8K-style JSONL reader feeding the math reward."""

import json

import pytest

from jaxrlhf.data.datasets import DataError, PromptRow
from jaxrlhf.data.gsm8k import gsm8k_final_answer, read_gsm8k
from jaxrlhf.data.math_reward import math_reward


def test_read_gsm8k_and_score(tmp_path):
    path = tmp_path / "gsm.jsonl"
    rows = [{"question": "Janet has 16 eggs, eats 3. How many?", "answer": "16-3=13\n#### 13"},
            {"question": "Big?", "answer": "1000+234 = 1,234\n#### 1,234"}]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    got = read_gsm8k(path)
    assert got == [PromptRow("Janet has 16 eggs, eats 3. How many?", "13"), PromptRow("Big?", "1234")]
    assert math_reward(got[1].prompt, "so \\boxed{1,234}", got[1].answer) == 1.0
    assert math_reward(got[0].prompt, "#### 12", got[0].answer) == 0.0
    assert gsm8k_final_answer("no marker") is None


@pytest.mark.parametrize("line,match", [
    ("{not json", "line 1: is not valid JSON"),
    ('{"question": "q"}', "line 1: field 'answer' is missing"),
    ('{"question": "q", "answer": "13"}', "field 'answer' has no '#### N'"),
    ("[1]", "line 1: is not an object"),
])
def test_read_gsm8k_errors(tmp_path, line, match):
    path = tmp_path / "bad.jsonl"
    path.write_text(line + "\n")
    with pytest.raises(DataError, match=match):
        read_gsm8k(path)
