"""A trajectory's conversation as token ids: the policy's turns are the tokens it sampled, the
environment's messages are rendered the way the model's chat template renders them.

With a chat template (`data/chat.py`), the ids of a reply are the text the template adds after
the conversation so far: render(conversation + reply, generation prompt) less
render(conversation), whose end (after the policy's last turn, e.g. Qwen's `<|im_end|>\\n`)
starts with the stop token the policy already sampled; the rest of that end (Qwen's newline) is
the reply's first text. So the whole trajectory's ids are what `apply_chat_template` gives for
its messages. Without a template (the byte tokenizer of the tiny configs), messages are plain
text: a user message its content, a tool message `<tool_response>CONTENT</tool_response>`.
"""

from __future__ import annotations

from typing import Sequence

from jaxrlhf.data.chat import ChatTemplate, Message
from jaxrlhf.data.tokenizer import Tokenizer, encode_prompt


class TranscriptError(ValueError):
    """The chat template does not extend the conversation by the reply (it rewrites earlier
    turns), so the reply has no ids of its own."""


def _plain(message: Message) -> str:
    if message["role"] == "tool":
        return f"<tool_response>{message['content']}</tool_response>"
    return message["content"]


class Transcript:
    """Renders first messages and environment replies for one tokenizer (and its template)."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self.template: ChatTemplate | None = getattr(tokenizer, "chat_template", None)

    def first_ids(self, messages: Sequence[Message]) -> list[int]:
        """The prompt ids of a trajectory's first messages, ending where the policy writes."""
        if self.template is None:
            return encode_prompt(self.tokenizer, "".join(_plain(m) for m in messages))
        return self.tokenizer.encode(self.template.render(messages, add_generation_prompt=True))

    def reply_ids(self, conversation: Sequence[Message], reply: Sequence[Message]) -> list[int]:
        """The ids that follow the policy's last turn (the last of `conversation`, which ended
        with a stop token) when the environment answers with `reply`, up to where the policy
        writes next.

        Raises:
          TranscriptError: the template renders the conversation differently once the reply
            is added, or does not end the policy's turn with a stop token.
        """
        if self.template is None:
            return self.tokenizer.encode("".join(_plain(m) for m in reply))
        before = self.template.render(conversation, add_generation_prompt=False)
        after = self.template.render([*conversation, *reply], add_generation_prompt=True)
        if not after.startswith(before):
            raise TranscriptError("the chat template rewrites the conversation when a reply is "
                                  "added; its turns cannot be appended as tokens")
        return self._turn_end_ids(conversation)[1:] + self.tokenizer.encode(after[len(before):])

    def _turn_end_ids(self, conversation: Sequence[Message]) -> list[int]:
        """The ids the template writes after the policy's last turn's text (e.g. Qwen's
        <|im_end|> "\n"), a stop token first."""
        before = self.template.render(conversation, add_generation_prompt=False)
        content = conversation[-1]["content"]
        at = before.rfind(content)
        if at < 0:
            raise TranscriptError("the chat template rewrites the policy's turn (its text is not "
                                  "in the rendered conversation); its turns cannot be appended")
        at += len(content)
        end_ids = self.tokenizer.encode(before[at:])
        if not end_ids or end_ids[0] not in self.tokenizer.stop_ids:
            raise TranscriptError(f"the chat template ends a policy turn with {before[at:]!r}, "
                                  "not a stop token")
        return end_ids

    def demonstration_ids(self, first: Sequence[Message], turns: Sequence[Message]
                          ) -> tuple[list[int], list[int], list[bool]]:
        """(prompt ids, the ids after them, which of those the policy wrote) of a multi-turn
        demonstration: the first messages, then `turns`, whose `assistant` messages are the
        policy's turns (their text's ids and the stop token that ends them, as a rollout samples
        them) and whose other messages are the environment's replies (`reply_ids`).

        Raises:
          ValueError: a demonstration that does not start with a policy turn.
          TranscriptError: as `reply_ids`.
        """
        if not turns or turns[0]["role"] != "assistant":
            raise ValueError("a demonstration's turns start with the policy's (an assistant "
                             "message)")
        conversation, ids, policy = list(first), [], []
        for i, message in enumerate(turns):
            if message["role"] == "assistant":
                conversation.append(message)
                stop = ([self.tokenizer.eos_id] if self.template is None
                        else self._turn_end_ids(conversation)[:1])
                turn = self.tokenizer.encode(message["content"]) + stop
                ids, policy = ids + turn, policy + [True] * len(turn)
            elif turns[i - 1]["role"] == "assistant":  # a reply: all its messages at once
                reply = _take_reply(turns[i:])
                turn = self.reply_ids(conversation, reply)
                conversation.extend(reply)
                ids, policy = ids + turn, policy + [False] * len(turn)
        return self.first_ids(first), ids, policy


def _take_reply(messages: Sequence[Message]) -> list[Message]:
    """The environment's messages at the start of `messages` (up to the policy's next turn)."""
    reply = []
    for m in messages:
        if m["role"] == "assistant":
            break
        reply.append(m)
    return reply
