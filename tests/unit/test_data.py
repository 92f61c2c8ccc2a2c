"""Tokenizers, dataset files, the epoch iterator and the arithmetic task."""

import dataclasses
import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import tokenizers
from tokenizers import decoders, models, pre_tokenizers, trainers

from jaxrlhf.data.datasets import (
    DataError,
    EpochIterator,
    FieldNames,
    IteratorState,
    PreferenceRow,
    PromptRow,
    RowKind,
    SFTRow,
    read_rows,
    write_rows,
)
from jaxrlhf.data.rewards import exact_match
from jaxrlhf.data.tasks import ArithmeticTask, Op, corrupt_answer, make_task, write_task
from jaxrlhf.data.tokenizer import (
    ByteTokenizer,
    HFTokenizer,
    Tokenizer,
    VocabMismatchError,
    check_vocab,
    decode_response,
    encode_prompt,
    load_tokenizer,
)

TEXTS = ["12+345=357", "héllo wörld ✓ 🙂", "  leading and trailing  \n tabs\t", ""]

# --- tokenizers ---


def test_byte_tokenizer_round_trip_and_specials():
    tok = ByteTokenizer()
    assert isinstance(tok, Tokenizer)
    assert (tok.vocab_size, tok.pad_id, tok.bos_id, tok.eos_id) == (272, 256, 257, 258)
    for text in TEXTS:
        ids = tok.encode(text)
        assert ids == list(text.encode("utf-8")) and all(0 <= i < 256 for i in ids)
        assert tok.decode(ids) == text
    ids = encode_prompt(tok, "1+1=")
    assert ids == [257, ord("1"), ord("+"), ord("1"), ord("=")]
    assert tok.decode(ids + [258, 256]) == "1+1="  # specials are dropped
    assert decode_response(tok, [ord("2"), 258, ord("9")]) == "2"  # stops at EOS
    assert decode_response(tok, [ord("2"), ord("9")]) == "29"
    assert load_tokenizer("byte") == tok
    check_vocab(tok, 272)
    with pytest.raises(VocabMismatchError, match="272 ids .* only 256 rows"):
        check_vocab(tok, 256)


def _write_hf_tokenizer(directory, *, eos_in_config: bool):
    """A byte-level BPE trained on a few lines, saved like an HF model directory."""
    backend = tokenizers.Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    specials = ["<pad>", "<s>", "</s>", "<eot>"]
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    backend.train_from_iterator(TEXTS * 3 + ["the quick brown fox", "1+2=3 4+5=9"], trainer)
    backend.save(str(directory / "tokenizer.json"))
    tok_config = {"bos_token": "<s>", "eos_token": {"content": "</s>"}}
    model_config = {"eos_token_id": [2, 3]} if eos_in_config else {}
    (directory / "tokenizer_config.json").write_text(json.dumps(tok_config))
    (directory / "config.json").write_text(json.dumps(model_config))
    return backend


def test_hf_tokenizer_round_trip_matches_transformers(tmp_path):
    backend = _write_hf_tokenizer(tmp_path, eos_in_config=True)
    tok = load_tokenizer(str(tmp_path))
    assert isinstance(tok, HFTokenizer) and isinstance(tok, Tokenizer)
    assert (tok.bos_id, tok.eos_id, tok.pad_id) == (1, 2, 2)  # no pad token: pad falls back to eos
    assert tok.stop_ids == (2, 3)  # config.json's extra end-of-turn id is also a stop
    assert tok.vocab_size == backend.get_vocab_size()

    from transformers import PreTrainedTokenizerFast

    reference = PreTrainedTokenizerFast(tokenizer_file=str(tmp_path / "tokenizer.json"))
    for text in TEXTS:
        ids = tok.encode(text)
        assert ids == reference.encode(text, add_special_tokens=False)
        assert tok.decode(ids) == text
        assert tok.decode([1, *ids, 3]) == text
        assert decode_response(tok, ids + [3] + ids) == text
    check_vocab(tok, tok.vocab_size)
    with pytest.raises(VocabMismatchError, match="embedding has only"):
        check_vocab(tok, tok.vocab_size - 1)


def test_hf_tokenizer_special_token_sources(tmp_path):
    _write_hf_tokenizer(tmp_path, eos_in_config=False)
    config = {"eos_token": "</s>", "pad_token": "<pad>"}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    tok = HFTokenizer.from_dir(tmp_path)
    assert (tok.bos_id, tok.eos_id, tok.pad_id, tok.stop_ids) == (None, 2, 0, (2,))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<nope>"}))
    with pytest.raises(ValueError, match="'<nope>' is not in the vocabulary"):
        HFTokenizer.from_dir(tmp_path)
    (tmp_path / "tokenizer_config.json").unlink()
    with pytest.raises(ValueError, match="no eos_token"):
        HFTokenizer.from_dir(tmp_path)
    with pytest.raises(FileNotFoundError):
        HFTokenizer.from_dir(tmp_path / "absent")


# --- dataset files ---

ROWS = {
    RowKind.PROMPT: [PromptRow("1+1=", "2"), PromptRow("say hi", None), PromptRow("ü?", "ü")],
    RowKind.PREFERENCE: [PreferenceRow("q", "good", "bad"), PreferenceRow("r", "yes", "no")],
    RowKind.SFT: [SFTRow("1+1=", "2"), SFTRow("multi\nline", "resp\n")],
}


@pytest.mark.parametrize("kind", list(RowKind))
def test_parquet_and_jsonl_give_identical_rows(tmp_path, kind):
    names = FieldNames(prompt="question", response="output")
    from_jsonl = read_rows(write_rows(tmp_path / "d.jsonl", ROWS[kind], names), kind, names)
    from_parquet = read_rows(write_rows(tmp_path / "d.parquet", ROWS[kind], names), kind, names)
    assert from_jsonl == from_parquet == ROWS[kind]
    first = json.loads((tmp_path / "d.jsonl").read_text().splitlines()[0])
    assert "question" in first and "prompt" not in first


@pytest.mark.parametrize(
    "line, field, problem",
    [
        ('{"prompt": "a", "response": ', None, "not valid JSON"),
        ('["a", "b"]', None, "is a list, not an object"),
        ('{"response": "b"}', "prompt", "is missing"),
        ('{"prompt": "a", "response": null}', "response", "is missing"),
        ('{"prompt": "  ", "response": "b"}', "prompt", "is empty"),
        ('{"prompt": 3, "response": "b"}', "prompt", "is a int, not a string"),
    ],
)
def test_malformed_jsonl_row_names_file_line_and_field(tmp_path, line, field, problem):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "ok", "response": "fine"}\n\n' + line + "\n")
    with pytest.raises(DataError, match=problem) as info:
        read_rows(path, RowKind.SFT)
    assert (info.value.path, info.value.location, info.value.field) == (str(path), "line 3", field)
    assert str(info.value).startswith(f"{path}:line 3: ")


def test_malformed_parquet_rows_name_row_and_field(tmp_path):
    path = tmp_path / "bad.parquet"
    pq.write_table(pa.table({"prompt": ["a", "b", None], "answer": ["1", "", "3"]}), path)
    with pytest.raises(DataError, match="'answer' is empty") as info:
        read_rows(path, RowKind.PROMPT)
    assert (info.value.location, info.value.field) == ("row 1", "answer")
    pq.write_table(pa.table({"prompt": ["a", None]}), path)
    with pytest.raises(DataError, match=r"bad.parquet:row 1: field 'prompt' is missing"):
        read_rows(path, RowKind.PROMPT)
    pq.write_table(pa.table({"prompt": [1, 2]}), path)
    with pytest.raises(DataError, match=r"row 0: field 'prompt' is a int"):
        read_rows(path, RowKind.PROMPT)
    with pytest.raises(DataError, match=r"field 'chosen' is missing \(no such column\)"):
        read_rows(path, RowKind.PREFERENCE)
    with pytest.raises(ValueError, match="unknown dataset format"):
        read_rows(tmp_path / "x.csv", RowKind.PROMPT)


# --- epoch iterator ---


def test_iterator_covers_each_epoch_and_resumes_exactly():
    rows = list(range(10))
    it = EpochIterator(rows, batch_size=3, seed=7)
    assert it.batches_per_epoch == 3
    first = [next(it) for _ in range(5)]
    state = json.loads(json.dumps(it.state().to_dict()))  # as a checkpoint would store it
    assert state == {"epoch": 1, "batch": 2}
    rest = [next(it) for _ in range(6)]

    resumed = EpochIterator(rows, batch_size=3, seed=7)
    resumed.restore(state)
    assert [next(resumed) for _ in range(6)] == rest
    again = EpochIterator(rows, batch_size=3, seed=7)
    assert [next(again) for _ in range(11)] == first + rest  # same seed, same sequence

    epoch0, epoch1 = sum(first[:3], []), sum(first[3:5] + rest[:1], [])
    assert len(set(epoch0)) == len(set(epoch1)) == 9  # no repeats within an epoch
    assert epoch0 != epoch1  # reshuffled
    other_seed = EpochIterator(rows, batch_size=3, seed=8)
    assert [next(other_seed) for _ in range(3)] != first[:3]
    ordered = EpochIterator(rows, batch_size=5, shuffle=False)
    assert [next(ordered) for _ in range(3)] == [rows[:5], rows[5:], rows[:5]]
    with pytest.raises(ValueError, match="outside an epoch"):
        it.restore(IteratorState(epoch=0, batch=4))
    with pytest.raises(ValueError, match="cannot fill one batch"):
        EpochIterator(rows, batch_size=11)


def test_iterator_names_the_rows_of_the_batch_drawn_at_a_state():
    rows = [f"row {i}" for i in range(10)]
    it, states = EpochIterator(rows, batch_size=3, seed=7), [IteratorState(1, 2)]
    for _ in range(8):  # across epochs, and at an epoch's end (the next epoch's first batch)
        states.append(it.state())
        indices = it.indices(it.state())
        assert [rows[i] for i in indices] == next(it)
    resumed = EpochIterator(rows, batch_size=3, seed=7)
    for state in states:  # from any state, restored or not
        resumed.restore(state)
        assert [rows[i] for i in resumed.indices(state)] == next(resumed)


# --- arithmetic task ---


def test_task_is_deterministic_disjoint_and_correct(tmp_path):
    task = ArithmeticTask(
        num_digits=2, num_operands=3, ops=(Op.ADD, Op.SUB, Op.MUL), num_train=300, num_eval=50,
        num_sft=100, sft_noise=0.25, seed=3,
    )
    data = make_task(task)
    assert data == make_task(task)
    assert make_task(dataclasses.replace(task, seed=4)).train != data.train
    train_prompts = {r.prompt for r in data.train}
    assert len(train_prompts) == 300 and len({r.prompt for r in data.eval}) == 50
    assert not train_prompts & {r.prompt for r in data.eval}
    for row in data.train + data.eval:
        # Python's own precedence rules are the reference for the answers.
        assert row.prompt.endswith("=") and row.answer == str(eval(row.prompt[:-1]))  # noqa: S307
        assert exact_match(row.prompt, row.answer + "\n", row.answer) == 1.0
    ops_seen = {c for r in data.train for c in r.prompt if c in "+-*"}
    assert ops_seen == {"+", "-", "*"}

    wrong = [s for s, r in zip(data.sft, data.train) if s.response != r.answer]
    assert [s.prompt for s in data.sft] == [r.prompt for r in data.train[:100]]
    assert len(wrong) == 25
    for sft in wrong:
        truth = str(eval(sft.prompt[:-1]))  # noqa: S307
        assert len(sft.response) == len(truth)
        assert sum(a != b for a, b in zip(sft.response, truth)) == 1
    assert all(p.chosen == r.answer != p.rejected for p, r in zip(data.preference, data.train))

    files = write_task(task, tmp_path)
    assert read_rows(files.train, RowKind.PROMPT) == data.train
    assert read_rows(files.eval, RowKind.PROMPT) == data.eval
    assert read_rows(files.sft, RowKind.SFT) == data.sft
    assert read_rows(files.preference, RowKind.PREFERENCE) == data.preference


def test_task_limits_and_corruption():
    with pytest.raises(ValueError, match="more than half of the 100 that exist"):
        ArithmeticTask(num_digits=1, num_train=40, num_eval=20, num_sft=10)
    with pytest.raises(ValueError, match="num_sft"):
        ArithmeticTask(num_train=10, num_sft=11)
    rng = np.random.default_rng(0)
    for answer in ["0", "7", "10", "-305", "99999"]:
        for _ in range(20):
            bad = corrupt_answer(answer, rng)
            assert bad != answer and len(bad) == len(answer)
            assert not (len(bad.lstrip("-")) > 1 and bad.lstrip("-")[0] == "0")
