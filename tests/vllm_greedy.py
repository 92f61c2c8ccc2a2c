"""Greedy tokens of an exported model directory in vLLM (run by the vLLM venv's interpreter,
not the suite's: vLLM pins its own torch; see tests/test_vllm_serving.py).

    VLLM_PYTHON tests/vllm_greedy.py DIR '[[1, 2, 3], [4, 5]]' 16

prints one line `TOKENS <JSON list>` (vLLM logs to stdout too): the new token ids of each prompt (given as token ids, so that the
comparison is of the model's greedy choices, the tokenizer having been checked on its own),
generating exactly N tokens (EOS ignored) in fp32.
"""

import json
import sys

MARK = "TOKENS"


def main(path: str, prompts: str, new_tokens: str) -> None:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=path, dtype="float32", max_model_len=256, enforce_eager=True, seed=0)
    params = SamplingParams(temperature=0.0, max_tokens=int(new_tokens), ignore_eos=True)
    outputs = llm.generate([TokensPrompt(prompt_token_ids=ids) for ids in json.loads(prompts)],
                           params)
    print(MARK, json.dumps([list(out.outputs[0].token_ids) for out in outputs]), flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:])
