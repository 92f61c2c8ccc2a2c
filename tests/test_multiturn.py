"""Multi-turn rollouts: tool calls, environments in their pool, trajectories on the rollout
engine, and GRPO's loss over them (only the policy's tokens trained)."""

import pathlib
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import transformers

from jaxrlhf.algorithms import grpo, losses, ppo
from jaxrlhf.algorithms import kl as kl_lib
from jaxrlhf.data import tools
from jaxrlhf.data.environments import EnvPool, Llama3ToolEnv, ToolEnv
from jaxrlhf.data.tokenizer import ByteTokenizer, HFTokenizer
from jaxrlhf.data.tools import ToolCall, ToolCallError, ToolCallFormat, parse_tool_calls
from jaxrlhf.data.transcript import Transcript
from jaxrlhf.dataflow.trajectories import EnvironmentFailed, TrajectoryLimits, rollout
from jaxrlhf.engine.generate import GenerateConfig, decode_rows, make_generate_fn
from jaxrlhf.engine.inference import (
    InferenceBatch, InferenceConfig, InferenceKind, InferenceOutput, make_inference_fn,
)
from jaxrlhf.engine.packing import Rows
from jaxrlhf.engine.rollout.scheduler import Abandoned
from jaxrlhf.mfc import Role
from jaxrlhf.models.sizes import get_size
from jaxrlhf.parallel.layout import init_params, make_layout
from jaxrlhf.parallel.reshard import fetch, transfer
from tests.unit.test_chat import LLAMA3_TEMPLATE, CHATML_TEMPLATE, llama3_dir, qwen_dir

from tests.fixtures.envs import TwoTurns

FIXTURES = pathlib.Path(__file__).parent / "fixtures"
MISBEHAVING = f"{FIXTURES / 'envs.py'}:Misbehaving"
P, N = 8, 64
REPLY = "<tool_response>ok</tool_response>"  # TwoTurns' reply without a chat template


# --- tool calls ----------------------------------------------------------------------------


def test_tool_calls_parse_as_qwen3_and_llama3_write_them():
    qwen = ('Let me compute.\n<tool_call>\n{"name": "calculator", "arguments": {"expression": '
            '"12*3"}}\n</tool_call>\n<tool_call>\n{"name": "python", "arguments": '
            '"{\\"code\\": \\"print(1)\\"}"}\n</tool_call>')
    assert parse_tool_calls(qwen, ToolCallFormat.QWEN3) == [
        ToolCall("calculator", {"expression": "12*3"}), ToolCall("python", {"code": "print(1)"})]
    assert parse_tool_calls("The answer is 36.", ToolCallFormat.QWEN3) == []
    llama = '{"name": "calculator", "parameters": {"expression": "2**10"}}'
    assert parse_tool_calls(llama, ToolCallFormat.LLAMA3) == [
        ToolCall("calculator", {"expression": "2**10"})]
    assert parse_tool_calls("<|python_tag|>" + llama, ToolCallFormat.LLAMA3) == [
        ToolCall("calculator", {"expression": "2**10"})]
    assert parse_tool_calls("It is 1024.", ToolCallFormat.LLAMA3) == []
    for bad, fmt in [("<tool_call>{\"name\": 1}</tool_call>", ToolCallFormat.QWEN3),
                     ("<tool_call>{not json}</tool_call>", ToolCallFormat.QWEN3),
                     ("<tool_call>{\"name\": \"x\"}", ToolCallFormat.QWEN3),
                     ('{"name": "x", "parameters": [1]}', ToolCallFormat.LLAMA3)]:
        with pytest.raises(ToolCallError):
            parse_tool_calls(bad, fmt)


def test_calculator_evaluates_arithmetic_and_refuses_everything_else():
    assert tools.calculate("12+34*2") == "80"
    assert tools.calculate("(7 - 10) // 2") == "-2"
    assert tools.calculate("2**10 / 4") == "256"
    assert tools.calculate("1/4") == "0.25"
    for bad in ["__import__('os').system('ls')", "x + 1", "abs(-1)", "9**9**9", "1/0", "1 +",
                "(1).real", "'a' * 3"]:
        with pytest.raises(ValueError):
            tools.calculate(bad)
    assert tools.call_tool(ToolCall("calculator", {"expression": "x"})).startswith("error: ")
    assert tools.call_tool(ToolCall("search", {})).startswith("error: no tool 'search'")


def test_python_tool_runs_in_the_sandbox(bwrap):
    assert tools.call_tool(ToolCall("python", {"code": "print(sum(range(10)))"})) == "45\n"
    out = tools.call_tool(ToolCall("python", {"code": "print(open('/etc/hostname').read())"}))
    assert out == "error: FileNotFoundError: [Errno 2] No such file or directory: '/etc/hostname'"


def test_tool_calls_too_deep_or_too_large_are_answered_with_an_error_message():
    """A call whose JSON nests past Python's stack, or whose arithmetic overflows, is the
    policy's mistake: a tool message saying so, never an environment failure (issue 46)."""
    row = {"prompt": "1+1=", "answer": "2"}
    deep = "[" * 1100 + "]" * 1100
    for env, text in [(ToolEnv(), f"<tool_call>{deep}</tool_call>"), (Llama3ToolEnv(), "{" * 1100)]:
        turn = env.step([{"role": "assistant", "content": text}], row)
        assert turn.messages[0]["content"].startswith("error: ") and not turn.done, turn
    for expression in ["1e300**2", "(10.0**64)**64", "((99**64)**64)**64"]:
        call = ('<tool_call>{"name": "calculator", "arguments": {"expression": "%s"}}'
                "</tool_call>" % expression)
        turn = ToolEnv().step([{"role": "assistant", "content": call}], row)
        assert turn.messages == ({"role": "tool", "content": "error: result too large"},), turn


@pytest.mark.parametrize("env, call", [
    (ToolEnv(), '<tool_call>{"name": "calculator", "arguments": {"expression": "12+34"}}'
                '</tool_call>'),
    (Llama3ToolEnv(), '{"name": "calculator", "parameters": {"expression": "12+34"}}')])
def test_tool_env_rewards_a_right_answer_after_a_calculator_call(env, call):
    row = {"prompt": "12+34=", "answer": "46"}
    messages = env.reset(row)
    turn = env.step(messages + [{"role": "assistant", "content": call}], row)
    assert turn.messages == ({"role": "tool", "content": "46"},) and not turn.done
    history = messages + [{"role": "assistant", "content": call}, *turn.messages]
    assert env.step(history + [{"role": "assistant", "content": "46"}], row).reward == 1.0
    assert env.step(history + [{"role": "assistant", "content": "47"}], row).reward == 0.0
    assert env.step(messages + [{"role": "assistant", "content": "46"}], row).reward == 0.0


# --- transcripts against transformers --------------------------------------------------------


@pytest.mark.parametrize("kind", ["qwen", "llama3"])
def test_a_trajectory_with_tool_calls_has_apply_chat_templates_ids(tmp_path, kind):
    """The policy's turns as sampled ids (content then its stop token) and the environment's
    replies from `reply_ids`: together, transformers' ids of the whole conversation."""
    make, template, stop = {"qwen": (qwen_dir, CHATML_TEMPLATE, "<|im_end|>"),
                            "llama3": (llama3_dir, LLAMA3_TEMPLATE, "<|eot_id|>")}[kind]
    make(tmp_path)
    tok, hf = HFTokenizer.from_dir(tmp_path), transformers.AutoTokenizer.from_pretrained(
        str(tmp_path))
    (stop_id,) = tok.encode(stop)
    transcript = Transcript(tok)
    messages = [{"role": "user", "content": "what is 1+1 ?"},
                {"role": "assistant", "content": "the answer is"},
                {"role": "tool", "content": "2"},
                {"role": "assistant", "content": "2"}]
    ids = transcript.first_ids(messages[:1])
    ids += tok.encode(messages[1]["content"]) + [stop_id]
    ids += transcript.reply_ids(messages[:2], messages[2:3])
    want = hf.apply_chat_template(messages[:3], add_generation_prompt=True, tokenize=True)
    assert ids == list(getattr(want, "input_ids", want)), kind
    ids += tok.encode(messages[3]["content"]) + [stop_id]
    want = hf.apply_chat_template(messages, add_generation_prompt=False, tokenize=True)
    want = list(getattr(want, "input_ids", want))
    assert ids == want[:len(ids)] and not tok.encode(hf.decode(want[len(ids):])), kind


# --- trajectories on the rollout engine --------------------------------------------------------


class EarlyStops(ByteTokenizer):
    """Bytes, with every id from 128 up stopping a turn: an untrained model ends its turns
    within a few tokens, so trajectories take several turns."""

    @property
    def stop_ids(self):
        return (self.eos_id, *range(128, 256))


@pytest.fixture(scope="module")
def engine():
    config = get_size("tiny", dtype=jnp.float32)
    layout = make_layout("0-1:d2" if jax.device_count() >= 2 else "0:d1", model=config)
    tok = EarlyStops()
    gen_cfg = GenerateConfig(max_new_tokens=N, eos_token_id=tok.stop_ids, pad_token_id=tok.pad_id)
    generator = make_generate_fn(config, gen_cfg, layout, prompt_buckets=(P,))
    params = init_params(config, layout, jax.random.key(3))
    return config, layout, tok, generator, params


ROWS = [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a, b in
        [(12, 34), (5, 6), (70, 8), (1, 99), (40, 40), (3, 21)]]


@pytest.fixture(scope="module")
def pool():
    """`Misbehaving`: TwoTurns, but for rows whose answer names a failure."""
    with EnvPool(MISBEHAVING, num_workers=2, timeout_s=1.0) as pool:
        yield pool


def _rollout(engine, pool, rows, max_error_rate=0.5, rng=None):
    config, layout, tok, generator, params = engine
    rng = jax.random.key(0) if rng is None else rng
    return rollout(generator, params, rng, pool, Transcript(tok), tok, rows,
                   TrajectoryLimits(3, P, N, max_error_rate))


@pytest.fixture(scope="module")
def instant(engine, pool):
    """ROWS' trajectories with TwoTurns answering at once."""
    rng = jax.random.key(0)
    with jax.transfer_guard("disallow"):  # as a step runs it: nothing implicit
        return _rollout(engine, pool, ROWS, rng=rng)


def test_trajectories_interleave_policy_turns_and_replies(engine, instant):
    config, layout, tok, _, params = engine
    out = instant
    assert out.turns_b.tolist() == [2] * len(ROWS)  # TwoTurns ends after the second turn
    np.testing.assert_array_equal(out.rewards_b, 1.25)  # 0.25 for the first turn, 1 at the end
    assert out.errors.total == 0 and out.tool_error_rate == 0.0
    reply = tok.encode(REPLY)
    for i, row in enumerate(ROWS):
        prompt = out.tokens_bs[i, :P][out.mask_bs[i, :P]].tolist()
        assert prompt == [tok.bos_id, *tok.encode(row["prompt"])]
        n = int(out.mask_bs[i, P:].sum())
        tokens, policy = out.tokens_bs[i, P:P + n], out.policy_bn[i, :n]
        assert not out.policy_bn[i, n:].any() and not out.mask_bs[i, P + n:].any()
        # policy turn, the reply (its tokens exactly, none of them the policy's), policy turn
        start = int(np.argmin(policy))
        assert tokens[start - 1] in tok.stop_ids and start > 0
        assert tokens[start:start + len(reply)].tolist() == reply
        assert not policy[start:start + len(reply)].any() and policy[start + len(reply):].all()
        assert policy[:start].all() and tokens[-1] in tok.stop_ids
        assert (out.logp_bn[i][~out.policy_bn[i]] == 0).all()
    # The behaviour log-probs of the policy's tokens are an inference call's over the whole
    # trajectory (the engine prefilled the conversation, replies included, each turn).
    infer = make_inference_fn(config, InferenceConfig(InferenceKind.LOGPROBS), layout,
                              length_buckets=(out.tokens_bs.shape[1],), rows=Rows.PADDED)
    whole = fetch(infer(params, InferenceBatch.padded(out.tokens_bs, out.mask_bs)).logprobs_bt)
    w = out.policy_bn.shape[1]
    np.testing.assert_allclose(out.logp_bn[out.policy_bn], whole[:, -w:][out.policy_bn],
                               atol=1e-5, rtol=0)


def _turn_synchronous(engine, rows, rng, max_turns=3):
    """The reference rollout: each turn, every unfinished trajectory's conversation in one
    batch (`decode_rows`, the generate call's path; trajectory i's turn j as row i * max_turns
    + j), then TwoTurns (here, in-process) answers them all. (tokens, policy mask, log-probs)
    of each trajectory after its prompt."""
    _, layout, tok, generator, params = engine
    transcript, env, dp = Transcript(tok), TwoTurns(), layout.dp_size
    conversations = [env.reset(row) for row in rows]
    firsts = [transcript.first_ids(c) for c in conversations]
    ids, policy, logp = ([[] for _ in rows] for _ in range(3))
    live, key = list(range(len(rows))), transfer(rng, layout.replicated())
    for turn in range(max_turns):
        if not live:
            break
        contexts = [firsts[i] + ids[i] for i in live]
        k = -(-len(live) // dp) * dp  # rows rounded up with copies of the first
        tokens_kp, mask_kp = np.zeros((k, P + N), np.int32), np.zeros((k, P + N), bool)
        for j in range(k):
            c = contexts[j] if j < len(live) else contexts[0]
            tokens_kp[j, P + N - len(c):], mask_kp[j, P + N - len(c):] = c, True
        streams_k = np.array([i * max_turns + turn for i in live] + [0] * (k - len(live)))
        limits_k = np.array([N - len(ids[i]) for i in live] + [1] * (k - len(live)))
        out, _ = decode_rows(generator.rollout_engine(P + N, k), params, tokens_kp, mask_kp,
                             [key] * k, streams_k, k, limits_b=limits_k)
        still = []
        for j, i in enumerate(live):
            mask_n = out["response_mask_bn"][j]
            sampled = out["sequences_bs"][j, P + N:][mask_n].tolist()
            ids[i], policy[i] = ids[i] + sampled, policy[i] + [True] * len(sampled)
            logp[i] += out["logprobs_bn"][j][mask_n].tolist()
            conversations[i].append({"role": "assistant", "content": tok.decode(sampled)})
            reply = env.step(conversations[i], rows[i])
            if reply.done or sampled[-1] not in tok.stop_ids or turn + 1 == max_turns:
                continue
            reply_ids = transcript.reply_ids(conversations[i], reply.messages)
            if len(ids[i]) + len(reply_ids) < N:
                ids[i], policy[i] = ids[i] + reply_ids, policy[i] + [False] * len(reply_ids)
                logp[i] += [0.0] * len(reply_ids)
                conversations[i] += reply.messages
                still.append(i)
        live = still
    return ids, policy, logp


def test_streamed_trajectories_are_the_turn_synchronous_ones_whatever_the_timing(
        engine, pool, instant):
    """The streamed rollout computes what one batch per turn computes, and a slow environment
    (0 to 0.1 s a turn, rows queued for 4 slots) changes its timing only, not its tokens."""
    config, layout, tok, generator, params = engine
    ids, policy, logp = _turn_synchronous(engine, ROWS, jax.random.key(0))
    rows = [dict(row, delay=0.05 * (i % 3)) for i, row in enumerate(ROWS)]
    slow = rollout(generator, params, jax.random.key(0), pool, Transcript(tok), tok, rows,
                   TrajectoryLimits(3, P, N, 0.5), slots=4)
    for out in (instant, slow):
        np.testing.assert_array_equal(out.turns_b, instant.turns_b)
        for i in range(len(ROWS)):
            n = len(ids[i])
            assert out.tokens_bs[i, P:P + n].tolist() == ids[i] and not out.mask_bs[i, P + n:].any()
            assert out.policy_bn[i, :n].tolist() == policy[i]
            np.testing.assert_allclose(out.logp_bn[i, :n], logp[i], atol=1e-5, rtol=0)
    assert max(out.turns_b) > 1  # replies were appended


def test_a_failing_environment_ends_its_trajectory_with_reward_0_and_is_counted(engine, pool):
    rows = [{"prompt": r["prompt"], "answer": a} for r, a in
            zip(ROWS, ["raise", "hang", "bad", "nan", "tool_error", "11"])]
    out = _rollout(engine, pool, rows, max_error_rate=0.7)
    np.testing.assert_array_equal(out.rewards_b, [0, 0, 0, 0, 1.25, 1.25])
    assert out.turns_b.tolist() == [1, 1, 1, 1, 2, 2]
    assert out.errors.total == 4
    assert out.tool_error_rate == 0.5  # of the two tool messages, one reports a failed call
    with pytest.raises(EnvironmentFailed) as failed:
        _rollout(engine, pool, rows[:1] + rows[4:], max_error_rate=0.2)
    message = str(failed.value)
    assert "\n" not in message and "1 of 3 trajectories" in message and "boom" in message


def test_a_stop_abandons_the_rollout_and_cancels_its_environment_calls(engine):
    """A stop during a rollout whose environment takes 30 s a turn (one worker: 6 rows, 180 s
    of calls) abandons it within a second or two of the stop (`Abandoned`); the calls queued
    and running are cancelled, so the pool closes at once instead of finishing them."""
    config, layout, tok, generator, params = engine
    rows = [dict(row, delay=30.0) for row in ROWS]
    t0 = time.monotonic()
    stop = lambda: time.monotonic() > t0 + 3.0
    with EnvPool(MISBEHAVING, num_workers=1, timeout_s=60.0) as pool:
        with pytest.raises(Abandoned):
            rollout(generator, params, jax.random.key(0), pool, Transcript(tok), tok, rows,
                    TrajectoryLimits(3, P, N, 0.5), stop=stop)
        abandoned = time.monotonic() - t0
    closed = time.monotonic() - t0
    assert abandoned < 5.0 and closed < abandoned + 10.0, (abandoned, closed)


# --- the loss over trajectories ------------------------------------------------------------


def test_environment_tokens_get_no_gradient():
    """GRPO over trajectories (its graph's train batch and loss): the loss's gradient with
    respect to the log-probs and entropies at the environment's tokens is exactly zero, and
    not at the policy's."""
    cfg = grpo.GRPOConfig(group_size=2, loss=grpo.losses.GRPOLossConfig(
        kl_coef=0.1, policy=grpo.losses.PPOLossConfig(entropy_coef=0.01)))
    train = grpo.make_multiturn(cfg).train[Role.ACTOR]
    rng = np.random.default_rng(0)
    b, p, n = 4, 3, 10
    policy_bn = np.ones((b, n), bool)
    policy_bn[:, 3:6] = False  # a reply in the middle of every trajectory
    policy_bn[:, 8:] = False  # and padding after it
    mask_bs = np.concatenate([np.ones((b, p), bool), policy_bn | (np.arange(n) < 8)], 1)
    buf = {"seq_tokens_bs": jnp.asarray(rng.integers(0, 200, (b, p + n)), jnp.int32),
           "seq_mask_bs": jnp.asarray(mask_bs), "response_mask_bn": jnp.asarray(policy_bn),
           "behav_logp_bn": jnp.asarray(-rng.random((b, n)), jnp.float32) * policy_bn,
           "ref_logp_bn": jnp.asarray(-rng.random((b, n)), jnp.float32),
           "scores_b": jnp.asarray([1.0, 0.0, 0.5, 2.0])}
    batch, _ = train.prepare(buf, {})

    def loss(logp_bt, entropy_bt):
        loss_sum, weight, _ = train.loss_fn(InferenceOutput(logp_bt, entropy_bt), batch)
        return loss_sum / weight

    logp_bt = jnp.asarray(-rng.random((b, p + n)), jnp.float32)
    g_logp, g_entropy = jax.grad(loss, argnums=(0, 1))(logp_bt, jnp.ones((b, p + n)))
    for g in (g_logp, g_entropy):
        response = np.asarray(g[:, p:])
        assert (response[~policy_bn] == 0).all() and (np.asarray(g[:, :p]) == 0).all()
        assert (response[policy_bn] != 0).all()


def _gae_over_policy_tokens(rewards_bn, values_bn, policy_bn, gamma, lam):
    """numpy GAE of each row's policy tokens alone, as one sequence (the environment's cut
    out): (advantages, returns) [b, n], 0 elsewhere."""
    adv_bn, ret_bn = np.zeros_like(rewards_bn), np.zeros_like(rewards_bn)
    for i in range(len(rewards_bn)):
        at = np.flatnonzero(policy_bn[i])
        r, v = rewards_bn[i, at], values_bn[i, at]
        a, next_a, next_v = np.zeros(len(at)), 0.0, 0.0
        for j in reversed(range(len(at))):
            a[j] = r[j] + gamma * next_v - v[j] + gamma * lam * next_a
            next_a, next_v = a[j], v[j]
        adv_bn[i, at], ret_bn[i, at] = a, a + v
    return adv_bn, ret_bn


def test_ppo_over_trajectories_trains_and_values_the_policy_tokens_only():
    """PPO over trajectories: each turn's reward on its turn's last token, GAE over the
    policy's tokens (numpy, the environment's cut out), and the actor's and the critic's
    losses have exactly zero gradient at the environment's tokens."""
    cfg = ppo.PPOConfig(gamma=0.9, lam=0.8, whiten_advantages=False,
                        kl=kl_lib.KLControllerConfig(init_kl_coef=0.1),
                        policy=losses.PPOLossConfig(entropy_coef=0.01))
    b, p, n = 4, 3, 10
    algorithm = ppo.make_multiturn(cfg, batch_size=b)
    assert {m.name for m in algorithm.mfcs} == {"actor_gen", "ref_inf", "critic_inf",
                                                "actor_train", "critic_train"}
    rng = np.random.default_rng(0)
    policy_bn = np.ones((b, n), bool)
    policy_bn[:, 3:6] = False  # a reply after the first turn (tokens 0-2)
    policy_bn[:, 8:] = False  # padding after the second (tokens 6-7)
    turn_rewards_bn = np.zeros((b, n), np.float32)
    turn_rewards_bn[:, 2], turn_rewards_bn[:, 7] = [0.25, 0.0, 0.5, 0.0], [1.0, 0.0, 1.0, 2.0]
    mask_bs = np.concatenate([np.ones((b, p), bool), np.arange(n) < 8 + np.zeros((b, 1))], 1)
    behav_bn = -rng.random((b, n)).astype(np.float32) * policy_bn
    ref_bn = -rng.random((b, n)).astype(np.float32)
    values_bn = rng.standard_normal((b, n)).astype(np.float32)
    buf = {"seq_tokens_bs": jnp.asarray(rng.integers(0, 200, (b, p + n)), jnp.int32),
           "seq_mask_bs": jnp.asarray(mask_bs), "response_mask_bn": jnp.asarray(policy_bn),
           "behav_logp_bn": jnp.asarray(behav_bn), "ref_logp_bn": jnp.asarray(ref_bn),
           "values_bn": jnp.asarray(values_bn), "turn_rewards_bn": jnp.asarray(turn_rewards_bn),
           "scores_b": jnp.asarray(turn_rewards_bn.sum(1))}
    actor, critic = algorithm.train[Role.ACTOR], algorithm.train[Role.CRITIC]
    batch, _ = actor.prepare(buf, algorithm.controller_init)
    rewards_bn = turn_rewards_bn - 0.1 * (behav_bn - ref_bn)  # k1: -beta log(pi / ref)
    want_adv, want_ret = _gae_over_policy_tokens(rewards_bn, values_bn, policy_bn, 0.9, 0.8)
    np.testing.assert_allclose(batch["advantages_bn"], want_adv, atol=1e-5, rtol=0)
    np.testing.assert_allclose(batch["returns_bn"], want_ret, atol=1e-5, rtol=0)

    def actor_loss(logp_bt, entropy_bt):
        loss_sum, weight, _ = actor.loss_fn(InferenceOutput(logp_bt, entropy_bt), batch)
        return loss_sum / weight

    def critic_loss(values_bt):
        loss_sum, weight, _ = critic.loss_fn(InferenceOutput(values_bt=values_bt), batch)
        return loss_sum / weight

    # Near the behaviour's log-probs and the old values: no token clipped (its gradient 0).
    near = lambda x_bn: jnp.asarray(np.pad(x_bn + 0.01 * rng.standard_normal((b, n)),
                                           ((0, 0), (p, 0))), jnp.float32)
    logp_bt = near(behav_bn)
    g_logp, g_entropy = jax.grad(actor_loss, argnums=(0, 1))(logp_bt, jnp.ones((b, p + n)))
    values_bt = jnp.roll(near(values_bn), -1, axis=1)  # V(s_t) sits one before token t
    g_values = np.asarray(jax.grad(critic_loss)(values_bt))[:, p - 1:-1]  # V(s_t) predicts t
    for g in (np.asarray(g_logp)[:, p:], np.asarray(g_entropy)[:, p:], g_values):
        assert (g[~policy_bn] == 0).all() and (g[policy_bn] != 0).all()


# --- configuration ---------------------------------------------------------------------------


def test_env_config_errors_are_one_line_naming_the_key():
    from jaxrlhf.configs import tool_math_tiny
    from jaxrlhf.schema import ConfigError
    from jaxrlhf.spec import run_spec

    spec = run_spec(tool_math_tiny.get_config("smoke"))
    assert [m.name for m in spec.graph.mfcs] == ["actor_gen", "ref_inf", "actor_train"]
    assert "scores_b" in spec.graph.mfc("actor_gen").outputs and not spec.rewards
    assert spec.env.spec == "tools" and spec.env.max_turns == 3
    for key, value, words in [("name", "nope", "env.name: unknown environment 'nope'"),
                              ("name", f"{FIXTURES / 'envs.py'}:Nope", "has no class 'Nope'"),
                              ("max_turns", 0, "env.max_turns")]:
        config = tool_math_tiny.get_config("smoke")
        config.env[key] = value
        with pytest.raises(ConfigError) as e:
            run_spec(config)
        assert words in str(e.value) and "\n" not in str(e.value), str(e.value)
    config = tool_math_tiny.get_config("smoke")
    config.algorithm = "rloo"
    with pytest.raises(ConfigError, match="env.name='tools': multi-turn rollouts train with "
                                          "algorithm=grpo or ppo"):
        run_spec(config)
    config.algorithm = "ppo"
    spec = run_spec(config)
    assert [m.name for m in spec.graph.mfcs] == ["actor_gen", "ref_inf", "critic_inf",
                                                  "actor_train", "critic_train"]
    assert "turn_rewards_bn" in spec.graph.mfc("actor_gen").outputs and not spec.rewards
