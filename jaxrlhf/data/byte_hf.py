"""The built-in byte tokenizer (`data/tokenizer.py`'s `ByteTokenizer`) as Hugging Face files, so
that an export of a byte-tokenizer run loads in `transformers` and serves in vLLM as it is.

It is a `tokenizers` BPE model whose vocabulary holds only the 256 byte tokens `<0x00>`..`<0xFF>`
(ids 0..255) with byte fallback: no text piece is in the vocabulary, so every character falls
back to its UTF-8 bytes, which is exactly `ByteTokenizer.encode`. Ids 256, 257 and 258 are the
special `<pad>`, `<s>` and `</s>`, 259..271 `<reserved_N>`; a post-processor puts `<s>` before a
prompt as `encode_prompt` does. Text that spells a special token (`"</s>"`) is bytes to
`ByteTokenizer`, so tokenizer_config.json sets `split_special_tokens` (transformers honours it,
and so does `HFTokenizer.from_dir`). The decoder turns byte tokens back into text; only where ids
are not UTF-8 does it differ: `tokenizers`' byte fallback writes U+FFFD for every byte of a run
of consecutive byte tokens that is not UTF-8 as a whole (its valid characters too), where
`ByteTokenizer.decode` replaces only each invalid sequence (Python's `errors="replace"`).
"""

from __future__ import annotations

import json
import pathlib

from tokenizers import AddedToken, Tokenizer, decoders, models, processors

from jaxrlhf.data.tokenizer import (BYTE_BOS_ID, BYTE_EOS_ID, BYTE_PAD_ID, BYTE_VOCAB_SIZE,
                                    TOKENIZER_FILE)

_NUM_BYTES = 256
PAD, BOS, EOS = "<pad>", "<s>", "</s>"
CONFIG_FILE = "tokenizer_config.json"


def special_tokens() -> list[str]:
    """The tokens of ids 256..BYTE_VOCAB_SIZE-1, in id order."""
    named = {BYTE_PAD_ID: PAD, BYTE_BOS_ID: BOS, BYTE_EOS_ID: EOS}
    return [named.get(i, f"<reserved_{i}>") for i in range(_NUM_BYTES, BYTE_VOCAB_SIZE)]


def byte_tokenizer() -> Tokenizer:
    """The `tokenizers` form of the byte tokenizer (module docstring)."""
    vocab = {f"<0x{b:02X}>": b for b in range(_NUM_BYTES)}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[], byte_fallback=True))
    tokenizer.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Fuse()])
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                  for t in special_tokens()])
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, BYTE_BOS_ID)])
    return tokenizer


def write_byte_tokenizer(path: str | pathlib.Path) -> None:
    """tokenizer.json and tokenizer_config.json of the byte tokenizer into directory `path`."""
    path = pathlib.Path(path)
    byte_tokenizer().save(str(path / TOKENIZER_FILE))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": BOS,
              "eos_token": EOS, "pad_token": PAD, "split_special_tokens": True}
    (path / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")


def is_byte_tokenizer(path: str | pathlib.Path) -> bool:
    """Whether directory `path`'s tokenizer.json is this module's byte tokenizer (an export of
    a byte-tokenizer run, e.g. the RLHF pipeline's SFT stage): its ids are the byte
    tokenizer's, so the default `tokenizer=byte` drives it as it was trained."""
    try:
        saved = json.loads((pathlib.Path(path) / TOKENIZER_FILE).read_text())
    except (OSError, ValueError):
        return False
    return saved == json.loads(byte_tokenizer().to_str())
