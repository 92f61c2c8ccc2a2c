"""Rows to padded token arrays, in the layout generation uses.

Every batch is [left-padded prompt | right-padded response]: the prompt ends at column P-1 and
the response starts at column P, so training rows and generated rows line up and one compiled
function serves both.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from jaxrlhf.data.datasets import PreferenceRow, PromptRow, SFTRow
from jaxrlhf.data.tokenizer import Tokenizer, encode_prompt
from jaxrlhf.data.transcript import Transcript


def _prompt_ids(tokenizer: Tokenizer, text: str, max_prompt_len: int, where: str) -> list[int]:
    ids = encode_prompt(tokenizer, text)
    if len(ids) > max_prompt_len:
        raise ValueError(f"{where}: prompt of {len(ids)} tokens exceeds "
                         f"rollout.max_prompt_len={max_prompt_len}: {text[:60]!r}")
    return ids


def prompt_batch(rows: Sequence[PromptRow], tokenizer: Tokenizer, max_prompt_len: int,
                 repeat: int = 1) -> dict[str, object]:
    """Prompts left-padded to `max_prompt_len`, each repeated `repeat` times (GRPO groups).

    Returns:
      prompt_tokens_bp int32 [B·repeat, P], prompt_mask_bp bool [B·repeat, P], and the host
      lists prompt_text and answer (length B·repeat).
    """
    rows = [row for row in rows for _ in range(repeat)]
    tokens_bp = np.full((len(rows), max_prompt_len), tokenizer.pad_id, np.int32)
    mask_bp = np.zeros((len(rows), max_prompt_len), bool)
    for b, row in enumerate(rows):
        ids = (list(row.prompt_ids) if row.prompt_ids is not None
               else _prompt_ids(tokenizer, row.prompt, max_prompt_len, "prompt batch"))
        tokens_bp[b, max_prompt_len - len(ids):] = ids
        mask_bp[b, max_prompt_len - len(ids):] = True
    return {"prompt_tokens_bp": tokens_bp, "prompt_mask_bp": mask_bp,
            "prompt_text": [r.prompt for r in rows], "answer": [r.answer for r in rows]}


def sequence_batch(prompts: Sequence[str], responses: Sequence[str], tokenizer: Tokenizer,
                   max_prompt_len: int, max_new_tokens: int) -> dict[str, np.ndarray]:
    """Prompt + response + EOS rows in generation layout.

    Returns:
      seq_tokens_bs int32 [B, P+N], seq_mask_bs bool [B, P+N], response_mask_bn bool [B, N].
    """
    p, n = max_prompt_len, max_new_tokens
    tokens_bs = np.full((len(prompts), p + n), tokenizer.pad_id, np.int32)
    mask_bs = np.zeros((len(prompts), p + n), bool)
    for b, (prompt, response) in enumerate(zip(prompts, responses)):
        ids = _prompt_ids(tokenizer, prompt, p, "sequence batch")
        resp = tokenizer.encode(response) + [tokenizer.eos_id]
        if len(resp) > n:
            raise ValueError(f"response of {len(resp)} tokens (with EOS) exceeds "
                             f"rollout.max_new_tokens={n}: {response[:60]!r}")
        tokens_bs[b, p - len(ids):p] = ids
        tokens_bs[b, p:p + len(resp)] = resp
        mask_bs[b, p - len(ids):p + len(resp)] = True
    return {"seq_tokens_bs": tokens_bs, "seq_mask_bs": mask_bs, "response_mask_bn": mask_bs[:, p:]}


def sft_batch(rows: Sequence[SFTRow], tokenizer: Tokenizer, max_prompt_len: int,
              max_new_tokens: int) -> dict[str, np.ndarray]:
    """`sequence_batch` of the rows; multi-turn demonstrations (rows with `messages`) are laid
    out as a rollout's trajectory, their response mask True only on the policy's turns."""
    if all(r.messages is None for r in rows):
        return sequence_batch([r.prompt for r in rows], [r.response for r in rows], tokenizer,
                              max_prompt_len, max_new_tokens)
    if any(r.messages is None for r in rows):
        raise ValueError("SFT rows mix responses and multi-turn demonstrations (messages)")
    return demonstration_batch(rows, tokenizer, max_prompt_len, max_new_tokens)


def demonstration_batch(rows: Sequence[SFTRow], tokenizer: Tokenizer, max_prompt_len: int,
                        max_new_tokens: int) -> dict[str, np.ndarray]:
    """Multi-turn demonstrations in generation layout: the prompt (a user message) left-padded
    to P, its turns (the policy's and the environment's, `Transcript.demonstration_ids`) in N.

    Returns:
      seq_tokens_bs int32 [B, P+N], seq_mask_bs bool [B, P+N], response_mask_bn bool [B, N]
      (True on the policy's tokens only: the environment's are context, never trained).
    """
    p, n = max_prompt_len, max_new_tokens
    transcript = Transcript(tokenizer)
    tokens_bs = np.full((len(rows), p + n), tokenizer.pad_id, np.int32)
    mask_bs = np.zeros((len(rows), p + n), bool)
    response_mask_bn = np.zeros((len(rows), n), bool)
    for b, row in enumerate(rows):
        first, ids, policy = transcript.demonstration_ids(
            [{"role": "user", "content": row.prompt}], row.messages)
        if len(first) > p:
            raise ValueError(f"demonstration batch: prompt of {len(first)} tokens exceeds "
                             f"rollout.max_prompt_len={p}: {row.prompt[:60]!r}")
        if len(ids) > n:
            raise ValueError(f"demonstration of {len(ids)} tokens after its prompt exceeds "
                             f"rollout.max_new_tokens={n}: {row.prompt[:60]!r}")
        tokens_bs[b, p - len(first):p + len(ids)] = first + ids
        mask_bs[b, p - len(first):p + len(ids)] = True
        response_mask_bn[b, :len(ids)] = policy
    return {"seq_tokens_bs": tokens_bs, "seq_mask_bs": mask_bs,
            "response_mask_bn": response_mask_bn}


def preference_batch(rows: Sequence[PreferenceRow], tokenizer: Tokenizer, max_prompt_len: int,
                     max_new_tokens: int) -> dict[str, np.ndarray]:
    """The B pairs as 2B sequence rows: chosen responses, then rejected ones (same prompts)."""
    prompts = [r.prompt for r in rows]
    responses = [r.chosen for r in rows] + [r.rejected for r in rows]
    return sequence_batch(prompts + prompts, responses, tokenizer, max_prompt_len, max_new_tokens)
