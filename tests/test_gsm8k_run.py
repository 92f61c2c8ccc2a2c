"""End to end: PPO on a local GSM8K-style JSONL with the `math` reward and a chat template, on a
tiny Qwen3 model given as a Hugging Face directory.

Rollouts are greedy (rollout.top_k=1), so step 0's responses are the initial model's
greedy answers to the chat-templated questions. The test computes those with `transformers`
(apply_chat_template + generate) and writes the file's answers so that some are the model's own
final number and others are not: the run's step-0 reward and its held-out evaluation must then
equal exactly the share of rows the test made right. Learning is not asked for.
"""

import json

import pytest
import tokenizers
import torch
import transformers

from hf_fixtures import make_tiny_hf_model
from jaxrlhf.data.math_reward import final_answer
from jaxrlhf.run import rl
from jaxrlhf.run.check import check_config
from jaxrlhf.schema import base_config

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
            "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
N_ROWS, N_NEW = 8, 6


def _letters(i: int) -> str:
    """A vocabulary word without digits (digits are tokens of their own)."""
    word = ""
    for _ in range(2):
        word, i = chr(ord("a") + i % 26) + word, i // 26
    return "w" + word


def _write_tokenizer(directory, vocab_size: int):
    """Qwen-convention word-level tokenizer: no BOS, <|im_end|> stop, digits as single tokens."""
    words = SPECIALS + ["user", "assistant", "system", "?"] + [str(d) for d in range(10)]
    words += [_letters(i) for i in range(vocab_size - len(words))]
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel(
        {w: i for i, w in enumerate(words)}, unk_token=SPECIALS[0]))
    backend.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    backend.add_special_tokens([tokenizers.AddedToken(s, special=True) for s in SPECIALS])
    backend.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": None,
        "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "chat_template": TEMPLATE}))
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, "bos_token_id": 0,
                                                       "eos_token_id": 2}))
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    return transformers.PreTrainedTokenizerFast.from_pretrained(str(directory)), words


def _greedy_finals(hf_model, hf_tok, questions):
    """The final answer (math reward's reading) of transformers' greedy chat response."""
    finals = []
    for question in questions:
        ids = hf_tok.apply_chat_template([{"role": "user", "content": question}],
                                         add_generation_prompt=True, tokenize=True)
        ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
        with torch.no_grad():
            out = hf_model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids)),
                                    max_new_tokens=N_NEW, do_sample=False, eos_token_id=[2, 0],
                                    pad_token_id=0)
        new = out[0, len(ids):].tolist()
        new = new[:next((i for i, t in enumerate(new) if t in (2, 0)), len(new))]
        finals.append(final_answer(hf_tok.decode(new, skip_special_tokens=True)))
    return finals


@pytest.mark.entry
@pytest.mark.slow  # ~1.5 min of CPU: HF generation, then a PPO step's compiles at HF shapes
def test_ppo_on_gsm8k_jsonl_with_math_reward_and_chat_template(tmp_path):
    path, hf_model = make_tiny_hf_model(tmp_path, "qwen3", seed=6)
    hf_tok, words = _write_tokenizer(path, hf_model.config.vocab_size)
    questions = [" ".join(words[17 + 5 * i + j] for j in range(4)) + " ?" for i in range(N_ROWS)]
    finals = _greedy_finals(hf_model, hf_tok, questions)
    # Of the rows whose response ends in a number, every other one gets that number as its
    # answer (right), the rest a different one (wrong); rows without a number cannot be right.
    numbered = [i for i, f in enumerate(finals) if f is not None]
    right = set(numbered[::2])
    assert len(numbered) >= 2, finals  # the seed gives both cases
    answers = [finals[i] if i in right else str(int(finals[i] or 0) + 1) for i in range(N_ROWS)]
    data = tmp_path / "gsm8k.jsonl"
    data.write_text("".join(json.dumps({"question": q, "answer": f"steps\n#### {a}"}) + "\n"
                            for q, a in zip(questions, answers)))

    config = base_config()
    config.steps = 1
    config.tokenizer = str(path)
    config.models.actor.path = str(path)
    config.models.critic.path = str(path)  # the causal LM's trunk with a new zero value head
    config.data.update(train_path=str(data), eval_path=str(data), chat_template="auto")
    config.reward.update(function="math", workers=1)
    # top_k=1 samples the argmax: greedy rollouts (temperature=0 makes PPO's log-probs NaN,
    # reported to the algorithms' owner).
    config.rollout.update(batch_size=N_ROWS, max_prompt_len=16, max_new_tokens=N_NEW,
                          temperature=1.0, top_k=1)
    config.checkpoint.update(every=0, async_save=False)
    summary = rl.run(check_config(config, str(tmp_path / "run")))

    expected = len(right) / N_ROWS
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text()
            .splitlines()]
    assert rows[0]["step"] == 0 and rows[0]["reward"] == pytest.approx(expected, abs=1e-6)
    # The held-out evaluation (greedy, same rows) scores the same responses the same way.
    assert summary["reward_before"] == pytest.approx(expected, abs=1e-12)
    assert summary["accuracy_before"] == pytest.approx(expected, abs=1e-12)
