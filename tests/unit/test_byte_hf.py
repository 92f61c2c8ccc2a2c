"""The byte tokenizer's Hugging Face form (data/byte_hf.py) encodes exactly as `ByteTokenizer`
does, on ASCII, non-ASCII, control characters and text that spells its special tokens, and
decodes what it encodes; read back through `HFTokenizer.from_dir` it is the same tokenizer."""

import random

import pytest

from jaxrlhf.data.byte_hf import byte_tokenizer, special_tokens, write_byte_tokenizer
from jaxrlhf.data.tokenizer import (BYTE_VOCAB_SIZE, ByteTokenizer, HFTokenizer,
                                    decode_response, encode_prompt)

FIXED = ["", " ", "hello world", "  two  spaces ", "line\nbreak\r\n\ttab", "héllo wörld ß",
         "日本語のテキスト", "emoji 🎉👩‍👩‍👧 flags 🇫🇷", "mixed ١٢٣ עברית ελληνικά",
         "</s>", "<s>hi</s>", "<pad><pad>", "<reserved_260>", "<0x41> is not A",
         "\x00\x01\x7f nul and del", "\u200b zero width \ufeff bom", "a" * 300,
         "4821>", "12+34=", "combining e\u0301 vs é", "surrogate-free 𝔘𝔫𝔦𝔠𝔬𝔡𝔢"]


def _random_strings(count: int, seed: int = 0) -> list[str]:
    """Strings drawn from every Unicode plane (no surrogates), with specials spliced in."""
    rng = random.Random(seed)
    pieces = special_tokens()[:5] + [" ", "\n"]

    def char() -> str:
        while True:
            code = rng.choice([rng.randrange(0x80), rng.randrange(0x800), rng.randrange(0x10000),
                               rng.randrange(0x110000)])
            if not 0xD800 <= code < 0xE000:
                return chr(code)

    return ["".join(rng.choice(pieces) if rng.random() < 0.1 else char()
                    for _ in range(rng.randrange(1, 40))) for _ in range(count)]


STRINGS = FIXED + _random_strings(300)


def test_encodes_as_the_byte_tokenizer():
    ours, theirs = ByteTokenizer(), byte_tokenizer()
    theirs.encode_special_tokens = True  # what tokenizer_config.json's split_special_tokens asks
    assert theirs.get_vocab_size() == BYTE_VOCAB_SIZE
    for text in STRINGS:
        assert theirs.encode(text, add_special_tokens=False).ids == ours.encode(text), text
        assert theirs.encode(text).ids == encode_prompt(ours, text), text


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    path = tmp_path_factory.mktemp("byte_hf")
    write_byte_tokenizer(path)
    return HFTokenizer.from_dir(path)


def test_read_back_it_is_the_same_tokenizer(written):
    ours = ByteTokenizer()
    assert (written.vocab_size, written.bos_id, written.eos_id, written.pad_id,
            written.stop_ids) == (ours.vocab_size, ours.bos_id, ours.eos_id, ours.pad_id,
                                  ours.stop_ids)
    for text in STRINGS:
        ids = encode_prompt(ours, text)
        assert encode_prompt(written, text) == ids and written.encode(text) == ours.encode(text)
        response = ours.encode(text) + [ours.eos_id, 65]  # what follows the stop is dropped
        assert decode_response(written, response) == decode_response(ours, response) == text
