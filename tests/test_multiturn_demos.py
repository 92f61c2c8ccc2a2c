"""Multi-turn demonstrations for the warm start: laid out as a rollout's trajectory (the same ids,
transformers' for a chat template), only the policy's turns trained, and the built-in tool
task's demonstrations scored by its environment as they are meant to be."""

import pytest
import transformers

from jaxrlhf.data import datasets, tasks, tools
from jaxrlhf.data.datasets import SFTRow
from jaxrlhf.data.encode import sft_batch
from jaxrlhf.data.environments import LookupEnv, ToolEnv
from jaxrlhf.data.tokenizer import ByteTokenizer, HFTokenizer
from jaxrlhf.data.transcript import Transcript
from tests.unit.test_chat import llama3_dir, qwen_dir

TURNS = ({"role": "assistant", "content": tasks.calculator_call("1+1")},
         {"role": "tool", "content": "2"},
         {"role": "assistant", "content": "2"})


@pytest.mark.parametrize("kind", ["qwen", "llama3"])
def test_a_demonstration_has_apply_chat_templates_ids(tmp_path, kind):
    make, stop = {"qwen": (qwen_dir, "<|im_end|>"), "llama3": (llama3_dir, "<|eot_id|>")}[kind]
    make(tmp_path)
    tok = HFTokenizer.from_dir(tmp_path)
    hf = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    first = [{"role": "user", "content": "1+1="}]
    prompt, ids, policy = Transcript(tok).demonstration_ids(first, TURNS)
    want = hf.apply_chat_template([*first, *TURNS], add_generation_prompt=False, tokenize=True)
    want = list(getattr(want, "input_ids", want))
    # the template's ids after the last stop token (Qwen's newline) are not the policy's
    assert prompt + ids == want[:len(prompt) + len(ids)], kind
    assert not tok.encode(hf.decode(want[len(prompt) + len(ids):])), kind
    (stop_id,) = tok.encode(stop)
    trained = [i for i, p in zip(ids, policy) if p]
    assert trained == (tok.encode(TURNS[0]["content"]) + [stop_id]
                       + tok.encode(TURNS[2]["content"]) + [stop_id]), kind
    assert "2" in tok.decode([i for i, p in zip(ids, policy) if not p]), kind


def test_demonstration_rows_train_the_policys_turns_only():
    tok = ByteTokenizer()
    rows = [SFTRow("1+1=", "", TURNS), SFTRow("3+4=", "", (
        {"role": "assistant", "content": "7"},))]
    batch = sft_batch(rows, tok, max_prompt_len=8, max_new_tokens=128)
    tokens_bn, mask_bn = batch["seq_tokens_bs"][:, 8:], batch["response_mask_bn"]
    assert batch["seq_mask_bs"][:, 8:].sum(1).tolist() == [
        len(TURNS[0]["content"]) + 1 + len("<tool_response>2</tool_response>") + 2, 2]
    policy = tok.decode(tokens_bn[0][mask_bn[0] & (tokens_bn[0] != tok.eos_id)].tolist())
    assert policy == TURNS[0]["content"] + "2"
    context = batch["seq_mask_bs"][0, 8:] & ~mask_bn[0]
    assert tok.decode(tokens_bn[0][context].tolist()) == "<tool_response>2</tool_response>"
    assert tok.decode(tokens_bn[1][mask_bn[1]].tolist()[:-1]) == "7"
    with pytest.raises(ValueError, match="mix"):
        sft_batch([rows[0], SFTRow("3+4=", "7")], tok, 8, 128)
    with pytest.raises(ValueError, match="max_new_tokens=16"):
        sft_batch(rows[:1], tok, 8, 16)


def test_tool_task_demonstrations_slip_as_often_as_asked_and_the_env_agrees(tmp_path):
    task = tasks.ToolArithmeticTask(num_train=100, num_eval=20, num_sft=50, sft_noise=0.6)
    data = tasks.make_tool_task(task)
    files = tasks.write_task(task, tmp_path)
    assert datasets.read_rows(files.sft, datasets.RowKind.SFT) == data.sft  # JSONL round trip
    answers = {r.prompt: r.answer for r in data.train}
    env, slips = ToolEnv(), 0
    for row in data.sft:
        call, reply, answer = row.messages
        (parsed,) = tools.parse_tool_calls(call["content"], tools.ToolCallFormat.QWEN3)
        assert reply["content"] == tools.call_tool(parsed) == answer["content"]
        conversation = [{"role": "user", "content": row.prompt}, *row.messages]
        env_row = {"prompt": row.prompt, "answer": answers[row.prompt]}
        assert env.step(conversation[:2], env_row).messages == (reply,)
        slip = "-" in parsed.arguments["expression"]
        slips += slip
        right = answer["content"] == answers[row.prompt]  # x-0 is x+0
        assert env.step(conversation, env_row).reward == float(right) and (right or slip)
    assert slips == 30





def test_lookup_demonstrations_slip_as_often_as_asked_and_the_env_agrees(tmp_path):
    """The chained facts: every demonstration's replies are what `LookupEnv` answers; the clean
    ones ask twice and score 1, the slipping ones (60%) answer the first reply and score 0."""
    task = tasks.LookupTask(num_train=100, num_eval=20, num_sft=50, sft_noise=0.6)
    data = tasks.make_lookup_task(task)
    files = tasks.write_task(task, tmp_path)
    assert datasets.read_rows(files.sft, datasets.RowKind.SFT) == data.sft  # JSONL round trip
    assert not {(r.prompt, r.answer) for r in data.train} & {(r.prompt, r.answer)
                                                              for r in data.eval}
    env, slips = LookupEnv(), 0
    for row, prompt_row in zip(data.sft, data.train):
        env_row = {"prompt": prompt_row.prompt, "answer": prompt_row.answer}
        conversation = env.reset(env_row)
        for turn, reply in zip(row.messages[::2], row.messages[1::2]):
            conversation.append(turn)
            assert env.step(conversation, env_row).messages == (reply,)
            conversation.append(reply)
        answer = row.messages[-1]["content"]
        final = env.step([*conversation, row.messages[-1]], env_row)
        slip = len(row.messages) == 3  # asked once
        slips += slip
        assert final.done and final.reward == float(not slip)
        assert answer == (row.messages[1]["content"] if slip else prompt_row.answer)
    assert slips == 30
    row = {"prompt": "q=", "answer": "58"}
    link = tasks.lookup_link("q", "58")
    ask = lambda text: env.step([*env.reset(row), {"role": "assistant", "content": text}], row)
    assert ask("q?").messages == ({"role": "tool", "content": link},) and link != "q"
    assert ask(f"{link}?").messages == ({"role": "tool", "content": "58"},)
    other = next(k for k in "abc" if k not in ("q", link))
    assert ask(f"{other}?").messages[0]["content"].startswith(f"error: no key '{other}'")
    assert ask("58").reward == 1.0 and ask("57").reward == 0.0
