"""`data.long_prompts`: what to do, at dataset load, with prompts longer than max_prompt_len
(after `data.chat_template` has rendered them).

ERROR raises naming the first offending row; DROP removes such rows; TRUNCATE_LEFT keeps the
last max_prompt_len ids (the end of a prompt, next to where the response starts, matters most).
The count of affected rows is returned so the caller can log/report it before compiling.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Callable, Sequence

from jaxrlhf.data.chat import ChatTemplateMode, template_rows
from jaxrlhf.data.datasets import PromptRow


class LongPrompts(enum.Enum):
    ERROR = "error"
    DROP = "drop"
    TRUNCATE_LEFT = "truncate_left"


def parse_long_prompts(value: str) -> LongPrompts:
    """The policy named by config value `value`; ValueError naming `data.long_prompts` if bad."""
    try:
        return LongPrompts(value)
    except ValueError:
        choices = " | ".join(p.value for p in LongPrompts)
        raise ValueError(f"data.long_prompts={value!r}: use one of {choices}") from None


@dataclasses.dataclass(frozen=True)
class FittedPrompts:
    """Rows that fit, with their prompt ids (left-truncated where the policy says so).

    Attributes:
      rows: the kept rows, in input order.
      ids: prompt ids of each kept row, each of length <= max_prompt_len.
      affected: rows dropped (DROP) or truncated (TRUNCATE_LEFT); 0 under ERROR.
    """

    rows: list[PromptRow]
    ids: list[list[int]]
    affected: int


def fit_prompts(rows: Sequence[PromptRow], encode: Callable[[str], list[int]],
                max_prompt_len: int, policy: LongPrompts) -> FittedPrompts:
    """Applies `policy` to every row whose ids (its `prompt_ids`, else `encode(row.prompt)`)
    exceed `max_prompt_len`.

    Raises:
      ValueError: under ERROR, for the first long row (naming rollout.max_prompt_len and the
        policy key); under DROP, when no row is left.
    """
    kept_rows, kept_ids, affected = [], [], 0
    for i, row in enumerate(rows):
        ids = list(row.prompt_ids) if row.prompt_ids is not None else encode(row.prompt)
        if len(ids) <= max_prompt_len:
            kept_rows.append(row)
            kept_ids.append(ids)
            continue
        match policy:
            case LongPrompts.ERROR:
                raise ValueError(
                    f"row {i}: prompt of {len(ids)} tokens exceeds rollout.max_prompt_len="
                    f"{max_prompt_len} (set data.long_prompts=drop or truncate_left): "
                    f"{row.prompt[:60]!r}")
            case LongPrompts.DROP:
                affected += 1
            case LongPrompts.TRUNCATE_LEFT:
                affected += 1
                kept_rows.append(row)
                kept_ids.append(ids[len(ids) - max_prompt_len:])
    if not kept_rows:
        raise ValueError(f"data.long_prompts=drop removed all {len(rows)} rows: every prompt "
                         f"exceeds rollout.max_prompt_len={max_prompt_len}")
    return FittedPrompts(kept_rows, kept_ids, affected)


def fit_rows(rows: Sequence[PromptRow], tokenizer, max_prompt_len: int, policy: LongPrompts,
             where: str, chat: ChatTemplateMode = ChatTemplateMode.AUTO) -> list[PromptRow]:
    """`rows` rendered by `data.chat_template=chat` (see `chat.template_rows`), then under
    `policy`, reporting how many were dropped or truncated (one line).

    Templated and truncated rows carry their ids (`PromptRow.prompt_ids`), which batches use as
    they are.

    Raises:
      ValueError: as `fit_prompts`, naming the row; ChatTemplateError as `template_rows`.
    """
    from jaxrlhf.data.tokenizer import encode_prompt

    rows = template_rows(rows, tokenizer, chat, where)
    fitted = fit_prompts(rows, lambda text: encode_prompt(tokenizer, text), max_prompt_len,
                         policy)
    if fitted.affected:
        done = "dropped" if policy is LongPrompts.DROP else "truncated on the left"
        print(f"data.long_prompts={policy.value}: {fitted.affected} of {len(rows)} prompts of "
              f"{where} {done} (longer than rollout.max_prompt_len={max_prompt_len})",
              flush=True)
    if policy is not LongPrompts.TRUNCATE_LEFT:
        return list(fitted.rows)
    return [dataclasses.replace(row, prompt_ids=tuple(ids))
            for row, ids in zip(fitted.rows, fitted.ids)]
