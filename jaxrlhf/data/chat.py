"""Chat templates rendered the way `transformers.apply_chat_template` renders them.

The template comes from `tokenizer_config.json`'s `chat_template` (a string, or a list of named
templates of which "default" is used) or from `chat_template.jinja`. It is rendered by a sandboxed
jinja2 environment with the same options, filters and globals as transformers (trim/lstrip blocks,
a `tojson` that does not HTML-escape, `raise_exception`, `strftime_now`, loop controls) and the
tokenizer's special-token strings (`bos_token`, `eos_token`, ...) as variables. The rendered text
already holds its special tokens, so it is encoded WITHOUT the post-processor's (as transformers).
`template_rows` applies `data.chat_template` to a dataset's prompt rows when it loads.
"""

from __future__ import annotations

import dataclasses
import datetime
import enum
import json
import pathlib
from typing import Any, Sequence

import jinja2
import jinja2.ext
import jinja2.sandbox

from jaxrlhf.data.datasets import PromptRow

Message = dict[str, Any]  # {"role": "user" | "assistant" | "system", "content": str}
_SPECIAL_NAMES = ("bos", "eos", "unk", "sep", "pad", "cls", "mask")


class ChatTemplateMode(enum.Enum):
    """`data.chat_template`: AUTO templates `messages` rows with the model's template; NONE never
    templates (rows must carry `prompt`)."""

    AUTO = "auto"
    NONE = "none"


class ChatTemplateError(ValueError):
    """The model directory has no chat template, or the template rejected the messages."""


def _raise_exception(message: str):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    # jinja's own tojson HTML-escapes '<' and '>', which transformers (and so every template) avoid.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _environment() -> jinja2.sandbox.ImmutableSandboxedEnvironment:
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    return env


def _token_string(value: Any) -> str | None:
    if isinstance(value, dict):  # AddedToken serialised as {"content": ..., ...}
        value = value.get("content")
    return value if isinstance(value, str) else None


class ChatTemplate:
    """A compiled chat template plus the special-token strings it may refer to."""

    def __init__(self, source: str, special_tokens: dict[str, str]):
        self.source = source
        self.special_tokens = special_tokens
        self._template = _environment().from_string(source)

    @classmethod
    def from_dir(cls, path: str | pathlib.Path) -> "ChatTemplate | None":
        """The template of model directory `path`, or None when it has none."""
        path = pathlib.Path(path)
        config_file = path / "tokenizer_config.json"
        config = json.loads(config_file.read_text(encoding="utf-8")) if config_file.is_file() else {}
        source = config.get("chat_template")
        if isinstance(source, list):  # [{"name": ..., "template": ...}, ...]
            named = {t["name"]: t["template"] for t in source}
            source = named.get("default")
        jinja_file = path / "chat_template.jinja"
        if source is None and jinja_file.is_file():
            source = jinja_file.read_text(encoding="utf-8")
        if source is None:
            return None
        specials = {f"{n}_token": s for n in _SPECIAL_NAMES
                    if (s := _token_string(config.get(f"{n}_token"))) is not None}
        return cls(source, specials)

    def render(self, messages: Sequence[Message], *, add_generation_prompt: bool = True) -> str:
        """The prompt text of `messages` (role/content dicts), as apply_chat_template(tokenize=False).

        Raises:
          ChatTemplateError: the template raised (e.g. roles not alternating).
        """
        for m in messages:
            if not isinstance(m, dict) or "role" not in m:
                raise ChatTemplateError(f"chat message {m!r} is not a dict with a 'role'")
        try:
            return self._template.render(
                messages=[dict(m) for m in messages], tools=None, documents=None,
                add_generation_prompt=add_generation_prompt, **self.special_tokens)
        except jinja2.exceptions.TemplateError as e:
            raise ChatTemplateError(f"chat template rejected the messages: {e}") from e


def encode_chat(tokenizer, template: ChatTemplate, messages: Sequence[Message], *,
                add_generation_prompt: bool = True) -> list[int]:
    """Prompt ids of `messages`, equal to apply_chat_template(messages, add_generation_prompt)."""
    return tokenizer.encode(template.render(messages, add_generation_prompt=add_generation_prompt))


def template_rows(rows: Sequence[PromptRow], tokenizer, mode: ChatTemplateMode,
                  where: str) -> list[PromptRow]:
    """Prompt rows as the model sees them under `data.chat_template=mode`.

    AUTO with a tokenizer that has a chat template (`tokenizer.chat_template`): every row is
    rendered with it and the generation prompt, a `messages` row as its chat and a `prompt` row
    as one user message; the row's `prompt` becomes the rendered text and `prompt_ids` its ids
    (encoded as apply_chat_template encodes). Otherwise rows stay as they are.

    Raises:
      ChatTemplateError: a `messages` row without a template to render it (naming `where`), or
        a template that rejects a row's messages.
    """
    template = getattr(tokenizer, "chat_template", None) if mode is ChatTemplateMode.AUTO else None
    if template is None:
        chat = next((i for i, r in enumerate(rows) if r.messages is not None), None)
        if chat is not None:
            why = ("data.chat_template=none" if mode is ChatTemplateMode.NONE
                   else "the tokenizer has no chat template")
            raise ChatTemplateError(f"{where}: row {chat} holds messages, but {why}; give "
                                    "such rows a 'prompt' or use a tokenizer with a chat_template")
        return list(rows)
    out = []
    for row in rows:
        messages = row.messages or ({"role": "user", "content": row.prompt},)
        text = template.render(messages, add_generation_prompt=True)
        out.append(dataclasses.replace(row, prompt=text, messages=None,
                                       prompt_ids=tuple(tokenizer.encode(text))))
    return out
