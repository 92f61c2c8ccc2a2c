"""data.long_prompts policies at dataset load."""

import pytest

from jaxrlhf.data.datasets import PromptRow
from jaxrlhf.data.long_prompts import LongPrompts, fit_prompts, parse_long_prompts
from jaxrlhf.data.tokenizer import ByteTokenizer, encode_prompt

TOK = ByteTokenizer()
ROWS = [PromptRow("ab"), PromptRow("abcdefgh", "1"), PromptRow("xyz")]


def encode(text):
    return encode_prompt(TOK, text)  # BOS + bytes


def test_policies():
    with pytest.raises(ValueError, match="row 1: prompt of 9 tokens exceeds rollout.max_prompt_len=4"):
        fit_prompts(ROWS, encode, 4, LongPrompts.ERROR)
    dropped = fit_prompts(ROWS, encode, 4, LongPrompts.DROP)
    assert dropped.rows == [ROWS[0], ROWS[2]] and dropped.affected == 1
    assert dropped.ids == [encode("ab"), encode("xyz")]
    cut = fit_prompts(ROWS, encode, 4, LongPrompts.TRUNCATE_LEFT)
    assert cut.rows == ROWS and cut.affected == 1
    assert cut.ids[1] == list(b"efgh")  # the end of the prompt is kept
    assert fit_prompts(ROWS, encode, 9, LongPrompts.ERROR).affected == 0
    with pytest.raises(ValueError, match="removed all 3 rows"):
        fit_prompts(ROWS, encode, 2, LongPrompts.DROP)


def test_parse():
    assert parse_long_prompts("truncate_left") is LongPrompts.TRUNCATE_LEFT
    with pytest.raises(ValueError, match=r"data.long_prompts='cut': use one of error \| drop"):
        parse_long_prompts("cut")
