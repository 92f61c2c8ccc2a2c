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


@pytest.mark.parametrize("kind", ["llama3", "qwen2", "qwen3"])
def test_prompt_ids_and_chat_ids_match_transformers(tmp_path, kind):
    match kind:
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
