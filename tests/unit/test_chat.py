"""Tokenizer conventions and chat templates against transformers on directories built here."""

import json

import pytest
import tokenizers
import transformers

from jaxrlhf.data.chat import ChatTemplate, ChatTemplateError, encode_chat
from jaxrlhf.data.tokenizer import HFTokenizer, encode_prompt

WORDS = ["hello", "world", "what", "is", "1+1", "?", "2", "the", "answer", "user", "assistant",
         "system", "be", "brief", ":"]
TEXTS = ["hello world", "what is 1+1 ?", "the answer is 2"]

LLAMA3_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] "
    "| trim + '<|eot_id|>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}"
    "{% endif %}")
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
# Qwen3-like: namespace, tojson, raise_exception, loop controls.
QWEN3_TEMPLATE = """{%- set ns = namespace(n=0) -%}
{%- for message in messages -%}
  {%- if message.role not in ['system', 'user', 'assistant'] -%}
    {{- raise_exception('bad role ' + message.role) -}}
  {%- endif -%}
  {%- set ns.n = ns.n + 1 -%}
  {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}
  {{- '<|im_start|>assistant\\n<think>\\n\\n</think>\\n\\n' -}}
{%- endif -%}"""
# Gemma-3-like (written here in its shape): BOS from the template, a system message folded into
# the first user turn, assistant turns as "model", alternation enforced, text parts of list
# content joined, trimmed turns.
GEMMA3_TEMPLATE = """{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
  {%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}
  {%- set loop_messages = messages[1:] -%}
{%- else -%}
  {%- set first_user_prefix = '' -%}
  {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
  {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
    {{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}
  {%- endif -%}
  {%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}
  {{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else '') }}
  {%- if message['content'] is string -%}
    {{ message['content'] | trim }}
  {%- else -%}
    {%- for item in message['content'] if item['type'] == 'text' -%}
      {{ item['text'] | trim }}
    {%- endfor -%}
  {%- endif -%}
  {{ '<end_of_turn>\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
  {{ '<start_of_turn>model\n' }}
{%- endif -%}"""


def _write(directory, *, specials, post_bos, tok_config, config, gen_config=None):
    vocab = {t: i for i, t in enumerate(specials + WORDS)}
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token=specials[0]))
    backend.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    backend.add_special_tokens([tokenizers.AddedToken(s, special=True) for s in specials])
    if post_bos is not None:  # Llama: the post-processor adds BOS
        backend.post_processor = tokenizers.processors.TemplateProcessing(
            single=f"{post_bos} $A", pair=f"{post_bos} $A {post_bos} $B",
            special_tokens=[(post_bos, vocab[post_bos])])
    directory.mkdir(parents=True, exist_ok=True)
    backend.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(
        json.dumps({"tokenizer_class": "PreTrainedTokenizerFast", **tok_config}))
    (directory / "config.json").write_text(json.dumps(config))
    if gen_config is not None:
        (directory / "generation_config.json").write_text(json.dumps(gen_config))
    return vocab


def llama3_dir(directory):
    specials = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>",
                "<|end_header_id|>", "<|eot_id|>"]
    vocab = _write(directory, specials=specials, post_bos="<|begin_of_text|>",
                   tok_config={"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>",
                               "chat_template": LLAMA3_TEMPLATE},
                   config={"model_type": "llama", "bos_token_id": 0, "eos_token_id": [1, 4]},
                   gen_config={"bos_token_id": 0, "eos_token_id": [1, 4]})
    return vocab


def qwen_dir(directory, template=CHATML_TEMPLATE, jinja_file=False):
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]
    tok_config = {"bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}
    if not jinja_file:
        tok_config["chat_template"] = template
    vocab = _write(directory, specials=specials, post_bos=None, tok_config=tok_config,
                   # Qwen's config.json names <|endoftext|> as bos_token_id; it is never prepended.
                   # No model_type: with "qwen2" transformers 5 would swap in Qwen2Tokenizer's
                   # own BPE pipeline, which cannot read this word-level tokenizer.json.
                   config={"bos_token_id": 0, "eos_token_id": 0},
                   gen_config={"bos_token_id": 0, "eos_token_id": [2, 0]})
    if jinja_file:
        (directory / "chat_template.jinja").write_text(template)
    return vocab


def gemma3_dir(directory):
    """Gemma 3's conventions: <bos> from the post-processor for plain text and from the template
    in chats, <eos> and <end_of_turn> both stop ids."""
    specials = ["<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>"]
    return _write(directory, specials=specials, post_bos="<bos>",
                  tok_config={"bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>",
                              "chat_template": GEMMA3_TEMPLATE},
                  # No model_type: as qwen_dir, transformers would swap in Gemma's own tokenizer.
                  config={"bos_token_id": 2, "eos_token_id": [1, 4], "pad_token_id": 0},
                  gen_config={"bos_token_id": 2, "eos_token_id": [1, 4]})


@pytest.mark.parametrize("kind", ["llama3", "qwen2", "qwen3", "gemma3"])
def test_prompt_ids_and_chat_ids_match_transformers(tmp_path, kind):
    match kind:
        case "gemma3":
            gemma3_dir(tmp_path)
        case "llama3":
            llama3_dir(tmp_path)
        case "qwen2":
            qwen_dir(tmp_path)
        case "qwen3":
            qwen_dir(tmp_path, QWEN3_TEMPLATE, jinja_file=True)
    ours = HFTokenizer.from_dir(tmp_path)
    hf = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    for text in TEXTS:
        assert encode_prompt(ours, text) == hf(text).input_ids, (kind, text)
    template = ChatTemplate.from_dir(tmp_path)
    conversations = [
        [{"role": "user", "content": "what is 1+1 ?"}],
        [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"},
         {"role": "assistant", "content": "2"}, {"role": "user", "content": "what is 1+1 ?"}],
    ]
    for messages in conversations:
        for gen in (True, False):
            want_text = hf.apply_chat_template(messages, add_generation_prompt=gen, tokenize=False)
            assert template.render(messages, add_generation_prompt=gen) == want_text
            want = hf.apply_chat_template(messages, add_generation_prompt=gen, tokenize=True)
            want = want["input_ids"] if isinstance(want, dict) or hasattr(want, "keys") else want
            assert encode_chat(ours, template, messages, add_generation_prompt=gen) == want


def test_special_ids_follow_hf_conventions(tmp_path):
    llama3_dir(tmp_path / "llama")
    qwen_dir(tmp_path / "qwen")
    llama = HFTokenizer.from_dir(tmp_path / "llama")
    assert (llama.bos_id, llama.eos_id, llama.stop_ids) == (0, 4, (4, 1))
    qwen = HFTokenizer.from_dir(tmp_path / "qwen")
    # Stop on generation_config's list, as HF generate does; pad as tokenizer_config names it.
    assert (qwen.eos_id, qwen.pad_id, qwen.stop_ids) == (2, 0, (2, 0))
    assert encode_prompt(qwen, "hello")[0] != 0  # no <|endoftext|> prepended


def test_chat_template_errors(tmp_path):
    qwen_dir(tmp_path, QWEN3_TEMPLATE)
    template = ChatTemplate.from_dir(tmp_path)
    with pytest.raises(ChatTemplateError, match="bad role tool"):
        template.render([{"role": "tool", "content": "x"}])
    with pytest.raises(ChatTemplateError, match="not a dict with a 'role'"):
        template.render(["hello"])
    (tmp_path / "none").mkdir()
    assert ChatTemplate.from_dir(tmp_path / "none") is None


# --- data.chat_template: `messages` rows and templated prompts at dataset load ---

CHAT_ROWS = [
    {"messages": [{"role": "system", "content": "be brief"},
                  {"role": "user", "content": "what is 1+1 ?"}], "answer": "2"},
    {"prompt": "hello world"},
    {"question": "what is 1+1 ?", "answer": "1+1 = 2\n#### 2"},  # GSM8K style
]


def _chat_file(tmp_path, suffix=".jsonl"):
    from jaxrlhf.data.datasets import RowKind, read_rows
    path = tmp_path / f"chat{suffix}"
    path.write_text("".join(json.dumps(r) + "\n" for r in CHAT_ROWS))
    return read_rows(path, RowKind.PROMPT)


def test_prompt_rows_carry_messages_prompts_or_questions(tmp_path):
    from jaxrlhf.data.datasets import DataError, PromptRow, RowKind, read_rows, write_rows
    rows = _chat_file(tmp_path)
    assert rows[0] == PromptRow("", "2", messages=tuple(CHAT_ROWS[0]["messages"]))
    assert rows[1] == PromptRow("hello world")
    assert rows[2] == PromptRow("what is 1+1 ?", "1+1 = 2\n#### 2")
    again = read_rows(write_rows(tmp_path / "again.jsonl", rows), RowKind.PROMPT)
    assert again == rows
    for bad, match in [({"messages": []}, "'messages' is not a non-empty list"),
                       ({"messages": [{"role": "user"}]}, "message 0 is not an object"),
                       ({"answer": "2"}, "'prompt' is missing .*'messages', 'question' or 'problem'")]:
        (tmp_path / "bad.jsonl").write_text(json.dumps(bad) + "\n")
        with pytest.raises(DataError, match=match):
            read_rows(tmp_path / "bad.jsonl", RowKind.PROMPT)


def test_chat_rows_from_parquet(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from jaxrlhf.data.datasets import RowKind, read_rows
    path = tmp_path / "chat.parquet"
    pq.write_table(pa.table({"messages": [CHAT_ROWS[0]["messages"]], "answer": ["2"]}), path)
    assert read_rows(path, RowKind.PROMPT) == _chat_file(tmp_path)[:1]


@pytest.mark.parametrize("kind", ["llama3", "qwen3"])
def test_auto_template_renders_rows_as_apply_chat_template(tmp_path, kind):
    from jaxrlhf.data.chat import ChatTemplateMode
    from jaxrlhf.data.encode import prompt_batch
    from jaxrlhf.data.long_prompts import LongPrompts, fit_rows
    rows = _chat_file(tmp_path)
    model_dir = tmp_path / "model"
    if kind == "llama3":
        llama3_dir(model_dir)
    else:
        qwen_dir(model_dir, QWEN3_TEMPLATE)
    ours = HFTokenizer.from_dir(model_dir)
    hf = transformers.AutoTokenizer.from_pretrained(str(model_dir))
    fitted = fit_rows(rows, ours, 64, LongPrompts.ERROR, "chat.jsonl", ChatTemplateMode.AUTO)
    chats = [CHAT_ROWS[0]["messages"], [{"role": "user", "content": "hello world"}],
             [{"role": "user", "content": "what is 1+1 ?"}]]
    for row, chat in zip(fitted, chats):
        want = hf.apply_chat_template(chat, add_generation_prompt=True, tokenize=True)
        want = list(want["input_ids"] if hasattr(want, "keys") else want)
        assert list(row.prompt_ids) == want
        assert row.prompt == hf.apply_chat_template(chat, add_generation_prompt=True,
                                                    tokenize=False)
        assert row.messages is None
    assert [r.answer for r in fitted] == [r.answer for r in rows]
    batch = prompt_batch(fitted, ours, 64)  # the batch holds exactly the templated ids
    n = len(fitted[0].prompt_ids)
    assert batch["prompt_tokens_bp"][0, 64 - n:].tolist() == list(fitted[0].prompt_ids)
    # Too long after templating: the long-prompt policy sees the templated length.
    with pytest.raises(ValueError, match="row 0: prompt of"):
        fit_rows(rows, ours, n - 1, LongPrompts.ERROR, "chat.jsonl", ChatTemplateMode.AUTO)


def test_none_or_no_template_keeps_prompts_and_rejects_messages(tmp_path):
    from jaxrlhf.data.chat import ChatTemplateMode
    from jaxrlhf.data.long_prompts import LongPrompts, fit_rows
    from jaxrlhf.data.tokenizer import ByteTokenizer
    rows = _chat_file(tmp_path)
    qwen_dir(tmp_path / "model")
    ours = HFTokenizer.from_dir(tmp_path / "model")
    plain = fit_rows(rows[1:], ours, 64, LongPrompts.ERROR, "x", ChatTemplateMode.NONE)
    assert [r.prompt_ids for r in plain] == [None, None]
    assert plain == rows[1:]
    with pytest.raises(ChatTemplateError, match="chat.jsonl: row 0 holds messages, but "
                                                "data.chat_template=none"):
        fit_rows(rows, ours, 64, LongPrompts.ERROR, "chat.jsonl", ChatTemplateMode.NONE)
    with pytest.raises(ChatTemplateError, match="the tokenizer has no chat template"):
        fit_rows(rows, ByteTokenizer(), 64, LongPrompts.ERROR, "chat.jsonl")
    assert fit_rows(rows[1:], ByteTokenizer(), 64, LongPrompts.ERROR, "x") == rows[1:]


def test_chat_template_config_value_is_checked():
    from jaxrlhf.schema import base_config
    from jaxrlhf.spec import ConfigError, run_spec
    config = base_config()
    config.data.chat_template = "none"
    assert run_spec(config).data.chat_template.value == "none"
    config.data.chat_template = "jinja"
    with pytest.raises(ConfigError,
                       match=r"^data.chat_template='jinja' is not one of: auto, none$"):
        run_spec(config)
