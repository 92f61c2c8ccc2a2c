"""Generate a completion from a Hugging Face checkpoint directory.

    python -m jaxrlhf.generate --model=HF_DIR --prompt="Once upon a time"
        [--max_new_tokens=64] [--temperature=0.7] [--top_k=50] [--top_p=0.9] [--seed=0]
        [--layout=0-7:d2t4] [--ignore_eos] [--json] [--chat]

Flag names may also be written with dashes (`--max-new-tokens`). The model is loaded straight
into the layout's shardings and the tokenizer comes from HF_DIR/tokenizer.json. With --json
exactly one JSON object is printed: {"text", "token_ids", "logprobs", "prompt_token_ids",
"finished", "seconds"}; `token_ids` and `logprobs` hold one entry per new token, and
`seconds` is the wall time of the generate call (compilation included). Prompt ids are those of
`transformers.AutoTokenizer(HF_DIR)(PROMPT)`; with --chat, those of
`apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True)`.
A directory or layout that cannot work (an unreadable config.json or safetensors file, a prompt
and new tokens past the model's positions included) is one line `error: --FLAG=VALUE: problem`
on stderr, exit code 2, before anything compiles.
"""

from __future__ import annotations

import json
import math
import sys
import time

from absl import flags

from jaxrlhf import cli
from jaxrlhf.schema import ConfigError, field

_MODEL = flags.DEFINE_string("model", None, "HF checkpoint directory (config.json, "
                             "safetensors, tokenizer.json).", required=True)
_PROMPT = flags.DEFINE_string("prompt", None, "Prompt text.", required=True)
_MAX_NEW_TOKENS = flags.DEFINE_integer("max_new_tokens", 64, "Tokens to generate at most.",
                                       lower_bound=1)
_TEMPERATURE = flags.DEFINE_float("temperature", 0.0, "Sampling temperature; 0 = greedy.",
                                  lower_bound=0.0)
_TOP_K = flags.DEFINE_integer("top_k", 0, "Top-k truncation; 0 = off.", lower_bound=0)
_TOP_P = flags.DEFINE_float("top_p", 1.0, "Nucleus truncation; 1.0 = off.")
_SEED = flags.DEFINE_integer("seed", 0, "PRNG seed.")
_LAYOUT = flags.DEFINE_string("layout", "0:d1", "Strategy string, e.g. 0-7:d2t4.")
_IGNORE_EOS = flags.DEFINE_bool("ignore_eos", False, "Always generate max_new_tokens.")
_JSON = flags.DEFINE_bool("json", False, "Print one JSON object instead of the text.")
_CHAT = flags.DEFINE_bool("chat", False, "Apply the model's chat template to the prompt as one "
                          "user message (with the generation prompt).")
_DTYPE = flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "Compute dtype.")

def check_length(prompt_len: int, max_new_tokens: int, positions: int) -> None:
    """The prompt and the new tokens fit the model's positions (past them RoPE extrapolates
    silently).

    Raises:
      ConfigError: naming --prompt or --max_new_tokens.
    """
    if prompt_len >= positions:
        raise ConfigError(f"--prompt: {prompt_len} tokens, but the model has "
                          f"{positions} positions (max_position_embeddings) for the prompt and "
                          "at least one new token")
    if prompt_len + max_new_tokens > positions:
        raise ConfigError(f"--max_new_tokens={max_new_tokens}: with the {prompt_len}-token prompt "
                          f"that is {prompt_len + max_new_tokens} tokens, more than the model's "
                          f"{positions} positions (max_position_embeddings); at most "
                          f"{positions - prompt_len} new tokens fit")


def _run() -> dict:
    # Heavy imports after flag parsing, so --help is instant.
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxrlhf.data.chat import encode_chat
    from jaxrlhf.data.tokenizer import HFTokenizer, check_vocab, decode_response, encode_prompt
    from jaxrlhf.engine.generate import GenerateConfig, make_generate_fn
    from jaxrlhf.models import hf_io
    from jaxrlhf.models.sizes import abstract_params
    from jaxrlhf.parallel import make_layout

    match _DTYPE.value:
        case "float32":
            dtype = jnp.float32
        case "bfloat16":
            dtype = jnp.bfloat16
    model = f"--model={_MODEL.value}"
    with field(model):
        tokenizer = HFTokenizer.from_dir(_MODEL.value)
        model_config = hf_io.load_hf_config(_MODEL.value, dtype=dtype)
        check_vocab(tokenizer, model_config.vocab_size)
    if _CHAT.value:
        template = tokenizer.chat_template  # tokenizer_config.json's or chat_template.jinja
        if template is None:
            raise ConfigError(f"--chat: {_MODEL.value} has no chat_template in "
                              "tokenizer_config.json nor a chat_template.jinja")
        prompt_ids = encode_chat(tokenizer, template, [{"role": "user", "content": _PROMPT.value}])
    else:
        prompt_ids = encode_prompt(tokenizer, _PROMPT.value)
    check_length(len(prompt_ids), _MAX_NEW_TOKENS.value, model_config.max_position_embeddings)
    if not math.isfinite(_TEMPERATURE.value):
        raise ConfigError(f"--temperature={_TEMPERATURE.value}: must be a finite number")
    with field(f"--layout={_LAYOUT.value}"):
        layout = make_layout(_LAYOUT.value, model=model_config)
    with field(model):
        hf_io.check_weights(_MODEL.value)
        model_config, params = hf_io.load_hf(
            _MODEL.value, dtype=dtype,
            shardings=lambda config: layout.param_shardings(abstract_params(config)),
        )
    gen_config = GenerateConfig(
        max_new_tokens=_MAX_NEW_TOKENS.value, eos_token_id=tokenizer.stop_ids,
        pad_token_id=tokenizer.pad_id, temperature=_TEMPERATURE.value, top_k=_TOP_K.value,
        top_p=_TOP_P.value, force_max_length=_IGNORE_EOS.value,
    )
    generate = make_generate_fn(model_config, gen_config, layout)
    # One row per data-parallel replica (the batch must split evenly); row 0 is reported.
    rows = layout.dp_size
    tokens_bp = np.tile(np.asarray(prompt_ids, np.int32), (rows, 1))
    start = time.perf_counter()
    out = generate(params, tokens_bp, np.ones_like(tokens_bp, bool),
                   jax.random.key(_SEED.value))
    length = int(out.response_lengths_b[0])
    token_ids = [int(t) for t in np.asarray(out.response_bn[0, :length])]
    logprobs = [float(x) for x in np.asarray(out.logprobs_bn[0, :length])]
    return {
        "text": decode_response(tokenizer, token_ids),
        "token_ids": token_ids,
        "logprobs": logprobs,
        "prompt_token_ids": list(prompt_ids),
        "finished": bool(token_ids) and token_ids[-1] in tokenizer.stop_ids,
        "seconds": time.perf_counter() - start,
    }


def main() -> None:
    result = _run()
    if _JSON.value:
        print(json.dumps(result))
    else:
        print(_PROMPT.value + result["text"])
    sys.stdout.flush()


if __name__ == "__main__":
    cli.run(main, flags_parser=cli.parse_dashed_flags)
