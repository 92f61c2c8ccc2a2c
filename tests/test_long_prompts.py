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


def test_truncated_rows_reach_the_prompt_batch_with_their_kept_ids(capsys):
    from jaxrlhf.data.encode import prompt_batch
    from jaxrlhf.data.long_prompts import fit_rows
    from jaxrlhf.data.tokenizer import ByteTokenizer

    tokenizer = ByteTokenizer()
    rows = [PromptRow("12>", "21"), PromptRow("123456789>", "x")]
    kept = fit_rows(rows, tokenizer, 6, LongPrompts.TRUNCATE_LEFT, "train.jsonl")
    assert "1 of 2 prompts of train.jsonl truncated on the left" in capsys.readouterr().out
    batch = prompt_batch(kept, tokenizer, 6)
    assert batch["prompt_tokens_bp"][1].tolist() == list(b"56789>")  # the last 6 ids
    assert batch["prompt_mask_bp"][0].tolist() == [False] * 2 + [True] * 4  # BOS + "12>"
    dropped = fit_rows(rows, tokenizer, 6, LongPrompts.DROP, "train.jsonl")
    assert dropped == rows[:1]
