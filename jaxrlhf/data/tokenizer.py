"""Tokenizers: a byte-level one for the tiny CPU models and a wrapper around HF `tokenizer.json`.

Both satisfy the `Tokenizer` protocol. `encode` never adds special tokens. Prompts go through
`encode_prompt`, which for an HF tokenizer gives exactly `transformers.AutoTokenizer`'s ids (the
tokenizer.json post-processor places BOS, or none for Qwen) and for the byte tokenizer prepends
its BOS. Chat-templated prompts (data/chat.py) carry their specials in the text.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
from typing import Any, Protocol, Sequence, runtime_checkable

import tokenizers

from jaxrlhf.data.chat import ChatTemplate

# Byte-tokenizer layout: ids 0..255 are raw bytes; specials follow; the rest is reserved so the
# vocabulary matches the tiny model's embedding (272 rows, a multiple of 16).
_NUM_BYTES = 256
BYTE_PAD_ID = 256
BYTE_BOS_ID = 257
BYTE_EOS_ID = 258
BYTE_VOCAB_SIZE = 272

TOKENIZER_FILE = "tokenizer.json"  # what a Hugging Face directory's tokenizer is read from


class VocabMismatchError(ValueError):
    """The tokenizer can emit ids that the model's embedding table does not have."""


@runtime_checkable
class Tokenizer(Protocol):
    """What the trainer needs from a tokenizer.

    Attributes:
      vocab_size: number of ids the tokenizer can produce (ids are in [0, vocab_size)).
      bos_id: id prepended to prompts, or None when the model uses none.
      eos_id: id that ends a response (generation stops on any of `stop_ids`).
      pad_id: id used for padding; masked out everywhere, so its embedding is irrelevant.
      stop_ids: every id that ends a response, `eos_id` first.
    """

    vocab_size: int
    bos_id: int | None
    eos_id: int
    pad_id: int
    stop_ids: tuple[int, ...]

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`, without any special tokens."""
        ...

    def decode(self, ids: Sequence[int]) -> str:
        """Text of `ids`, dropping special tokens."""
        ...


@dataclasses.dataclass(frozen=True)
class ByteTokenizer:
    """UTF-8 bytes as ids 0..255, then pad=256, bos=257, eos=258; 272 ids in all."""

    vocab_size: int = BYTE_VOCAB_SIZE
    bos_id: int | None = BYTE_BOS_ID
    eos_id: int = BYTE_EOS_ID
    pad_id: int = BYTE_PAD_ID

    @property
    def stop_ids(self) -> tuple[int, ...]:
        return (self.eos_id,)

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        # Sampled ids may split a multi-byte character; replace rather than fail on them.
        raw = bytes(int(i) for i in ids if 0 <= int(i) < _NUM_BYTES)
        return raw.decode("utf-8", errors="replace")


@dataclasses.dataclass(frozen=True)
class HFTokenizer:
    """A HuggingFace `tokenizers` tokenizer with the special ids of its model directory."""

    backend: tokenizers.Tokenizer
    vocab_size: int
    bos_id: int | None
    eos_id: int
    pad_id: int
    stop_ids: tuple[int, ...]
    # The directory's chat template (data/chat.py), or None when it has none.
    chat_template: ChatTemplate | None = dataclasses.field(default=None, compare=False)

    @classmethod
    def from_dir(cls, path: str | pathlib.Path) -> "HFTokenizer":
        """Loads `path/tokenizer.json`; special tokens from tokenizer_config.json / config.json.

        Token strings in tokenizer_config.json (`bos_token`, `eos_token`, `pad_token`) take
        precedence over ids in config.json (`bos_token_id`, `eos_token_id`, `pad_token_id`);
        a list-valued `eos_token_id` (Llama-3 instruct) makes every entry a stop id. With no pad
        token the EOS id is used for padding.

        Raises:
          FileNotFoundError: no tokenizer.json in `path`.
          ValueError: no EOS token can be found, or a named token is not in the vocabulary.
        """
        path = pathlib.Path(path)
        tokenizer_file = path / TOKENIZER_FILE
        if not tokenizer_file.is_file():
            raise FileNotFoundError(f"no tokenizer.json in {path}")
        backend = tokenizers.Tokenizer.from_file(str(tokenizer_file))
        tok_config = _read_json(path / "tokenizer_config.json")
        # transformers' flag: text that spells a special token is encoded as text (the byte
        # tokenizer's export sets it, data/byte_hf.py); tokenizer.json cannot say so itself.
        backend.encode_special_tokens = bool(tok_config.get("split_special_tokens", False))
        model_config = _read_json(path / "config.json")

        def special(name: str) -> list[int]:
            token = tok_config.get(f"{name}_token")
            if isinstance(token, dict):  # AddedToken serialised as {"content": ..., ...}
                token = token.get("content")
            if isinstance(token, str):
                token_id = backend.token_to_id(token)
                if token_id is None:
                    raise ValueError(f"{path}: {name}_token {token!r} is not in the vocabulary")
                return [token_id]
            ids = model_config.get(f"{name}_token_id")
            if ids is None:
                return []
            return [int(i) for i in ids] if isinstance(ids, list) else [int(ids)]

        eos_ids = special("eos")
        # HF `generate` stops on generation_config.json's eos_token_id (a list for chat models:
        # <|im_end|>, <|eot_id|>), which wins over config.json's; both add to the tokenizer's EOS.
        gen_config = _read_json(path / "generation_config.json")
        extra = gen_config.get("eos_token_id", model_config.get("eos_token_id"))
        extra_ids = extra if isinstance(extra, list) else ([] if extra is None else [extra])
        stop_ids = tuple(dict.fromkeys(eos_ids + [int(i) for i in extra_ids]))
        if not stop_ids:
            raise ValueError(f"{path}: no eos_token in tokenizer_config.json or config.json")
        bos_ids = special("bos")
        pad_ids = special("pad")
        return cls(
            backend=backend,
            vocab_size=backend.get_vocab_size(with_added_tokens=True),
            bos_id=bos_ids[0] if bos_ids else None,
            eos_id=stop_ids[0],
            pad_id=pad_ids[0] if pad_ids else stop_ids[0],
            stop_ids=stop_ids,
            chat_template=ChatTemplate.from_dir(path),
        )

    def encode(self, text: str) -> list[int]:
        return self.backend.encode(text, add_special_tokens=False).ids

    def encode_prompt(self, text: str) -> list[int]:
        """Ids as `transformers.AutoTokenizer(path)(text).input_ids`: the tokenizer.json
        post-processor alone decides the special tokens (Llama adds BOS; Qwen adds none, even
        though its config.json names a `bos_token_id`)."""
        return self.backend.encode(text, add_special_tokens=True).ids

    def decode(self, ids: Sequence[int]) -> str:
        return self.backend.decode([int(i) for i in ids], skip_special_tokens=True)


def _read_json(path: pathlib.Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    with path.open(encoding="utf-8") as f:
        return json.load(f)


def load_tokenizer(spec: str) -> Tokenizer:
    """`"byte"` for the byte tokenizer, otherwise a directory holding tokenizer.json."""
    match spec:
        case "byte":
            return ByteTokenizer()
        case _:
            return HFTokenizer.from_dir(spec)


def encode_prompt(tokenizer: Tokenizer, text: str) -> list[int]:
    """Prompt ids. A tokenizer with its own `encode_prompt` (HFTokenizer: the post-processor, as
    transformers does) decides; otherwise BOS (when the tokenizer has one) then the text's ids."""
    own = getattr(tokenizer, "encode_prompt", None)
    if own is not None:
        return own(text)
    ids = tokenizer.encode(text)
    return ids if tokenizer.bos_id is None else [tokenizer.bos_id, *ids]


def decode_response(tokenizer: Tokenizer, ids: Sequence[int]) -> str:
    """Text of a generated response: its ids up to (not including) the first stop id."""
    stops = set(tokenizer.stop_ids)
    end = next((i for i, t in enumerate(ids) if int(t) in stops), len(ids))
    return tokenizer.decode(ids[:end])


def check_vocab(tokenizer: Tokenizer, model_vocab_size: int) -> None:
    """Raises VocabMismatchError if the tokenizer can emit ids outside the model's embedding.

    A model vocabulary larger than the tokenizer's is fine (HF checkpoints pad it for speed).
    """
    if tokenizer.vocab_size > model_vocab_size:
        raise VocabMismatchError(
            f"tokenizer has {tokenizer.vocab_size} ids but the model's embedding has only "
            f"{model_vocab_size} rows; use the tokenizer the model was trained with, or a model "
            f"config with vocab_size >= {tokenizer.vocab_size}"
        )
    specials = {"bos": tokenizer.bos_id, "eos": tokenizer.eos_id, "pad": tokenizer.pad_id}
    specials.update({f"stop[{i}]": s for i, s in enumerate(tokenizer.stop_ids)})
    for name, token_id in specials.items():
        if token_id is not None and not 0 <= token_id < model_vocab_size:
            raise VocabMismatchError(
                f"tokenizer {name} id {token_id} is outside the model's vocabulary "
                f"[0, {model_vocab_size})"
            )
