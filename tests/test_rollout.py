"""Interruptible generation (jaxrlhf.engine.rollout): chunks without interruption are exactly
one `generate` call; an interruption swaps weights mid-sequence, the per-token versions show
the switch, and every token's log-prob is its own version's (checked against a full forward
pass of each version over the finished sequences, so the recomputed KV cache is right)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrlhf.engine.generate import GenerateConfig, make_generate_fn
from jaxrlhf.engine.rollout import NO_VERSION, Rollout
from jaxrlhf.models.sizes import get_size
from jaxrlhf.models.transformer import Transformer
from jaxrlhf.parallel.layout import init_params, make_layout

P, N = 6, 10
LENGTHS = (6, 2, 4, 1)


@pytest.fixture(scope="module")
def setup():
    config = get_size("tiny")
    layout = make_layout("0-1:d2", model=config)
    params_a = init_params(config, layout, jax.random.key(1))
    params_b = init_params(config, layout, jax.random.key(2))
    rng = np.random.default_rng(0)
    tokens = np.zeros((len(LENGTHS), P), np.int32)
    mask = np.zeros((len(LENGTHS), P), bool)
    for r, length in enumerate(LENGTHS):
        tokens[r, P - length:] = rng.integers(3, config.vocab_size, length)
        mask[r, P - length:] = True
    return config, layout, params_a, params_b, tokens, mask


def _gen_config(**kw):
    return GenerateConfig(**{"max_new_tokens": N, "eos_token_id": 1, "pad_token_id": 0,
                             "temperature": 1.0, **kw})


def test_chunks_without_interruption_equal_one_generate_call(setup):
    config, layout, params, _, tokens, mask = setup
    cfg = _gen_config()
    rng = jax.random.key(7)
    want = make_generate_fn(config, cfg, layout, prompt_buckets=(P,))(params, tokens, mask, rng)
    rollout = Rollout(config, cfg, layout, P)
    inflight = rollout.start(params, 0, tokens, mask, rng)
    chunks = 0
    while not rollout.poll(inflight):
        inflight = rollout.advance(inflight, params, 0, 3)
        chunks += 1
    got, versions_bn = rollout.finish(inflight)
    assert chunks >= 2 and inflight.interruptions == 0
    for name in ("sequences_bs", "response_mask_bn", "logprobs_bn", "response_lengths_b"):
        np.testing.assert_array_equal(np.asarray(getattr(got, name)),
                                      np.asarray(getattr(want, name)), err_msg=name)
    mask_bn = np.asarray(got.response_mask_bn)
    np.testing.assert_array_equal(np.asarray(versions_bn), np.where(mask_bn, 0, NO_VERSION))


def _full_forward_logp(config, params, sequences_bs, seq_mask_bs):
    """[b, N] log π(response token i | prefix) from one pass over the whole sequence."""
    seg = seq_mask_bs.astype(np.int32)
    positions = np.maximum(np.cumsum(seg, axis=1) - 1, 0)
    logits, _ = Transformer(config).apply({"params": params}, jnp.asarray(sequences_bs),
                                          jnp.asarray(positions), jnp.asarray(seg))
    logp = jax.nn.log_softmax(np.asarray(logits, np.float64)[:, P - 1:-1], axis=-1)
    return np.take_along_axis(np.asarray(logp), sequences_bs[:, P:, None], axis=-1)[..., 0]


def test_interruption_switches_weights_mid_sequence(setup):
    config, layout, params_a, params_b, tokens, mask = setup
    cfg = _gen_config(force_max_length=True)  # every row runs past the switch
    rollout = Rollout(config, cfg, layout, P)
    inflight = rollout.start(params_a, 0, tokens, mask, jax.random.key(3))
    inflight = rollout.advance(inflight, params_a, 0, 3)  # tokens 0..3 under version 0
    inflight = rollout.advance(inflight, params_b, 1, N)  # new weights arrive: the rest
    assert rollout.poll(inflight) and inflight.interruptions == 1
    out, versions_bn = rollout.finish(inflight)
    versions_bn = np.asarray(versions_bn)
    want = np.array([0] * 4 + [1] * (N - 4))
    np.testing.assert_array_equal(versions_bn, np.broadcast_to(want, versions_bn.shape))
    # Each token's recorded log-prob is its sampling policy's: version 0's for the first
    # four, version 1's (through the recomputed cache) for the rest.
    seq = np.asarray(out.sequences_bs)
    seq_mask = np.concatenate([np.asarray(out.prompt_mask_bp),
                               np.asarray(out.response_mask_bn)], axis=1)
    logp_a = _full_forward_logp(config, params_a, seq, seq_mask)
    logp_b = _full_forward_logp(config, params_b, seq, seq_mask)
    expected = np.where(versions_bn == 0, logp_a, logp_b)
    np.testing.assert_allclose(np.asarray(out.logprobs_bn), expected, rtol=1e-5, atol=1e-5)
    # ...and the two policies really differ on the tokens after the switch.
    assert np.abs(logp_a - logp_b)[:, 4:].max() > 1e-2


@pytest.mark.slow  # two more compiles (a generate call and a rollout for 2-row micro-batches)
def test_micro_batches_decode_in_turn_like_the_synchronous_generate_call(setup):
    """`actor_gen@2` in the asynchronous loop: rows j::2 decoded one micro-batch after the
    other, micro-batch j sampling with fold_in(the batch's key, j), merged back: exactly what
    the synchronous generate executor computes (one `generate` call per micro-batch)."""
    from jaxrlhf.mfc import MFC, Call, Role
    from jaxrlhf.run.rollout_worker import RolloutWorker

    config, layout, params, _, tokens, mask = setup
    cfg = _gen_config()
    outputs = ("seq_bs", "seq_mask_bs", "response_mask_bn", "logp_bn")
    mfc = MFC("actor_gen", Role.ACTOR, Call.GENERATE, ("prompt_tokens_bp", "prompt_mask_bp"),
              outputs)
    worker = RolloutWorker(mfc, Rollout(config, cfg, layout, P), layout, config, seed=5,
                           chunk_tokens=4, micro_batches=2)
    worker.install(params, 0)
    worker.start(3, {"prompt_tokens_bp": tokens, "prompt_mask_bp": mask}, None, 0.0)
    done = None
    while done is None:
        done = worker.step(lambda: 1.0)
    rng = jax.random.fold_in(jax.random.key(5), np.uint32(3))
    generate = make_generate_fn(config, cfg, layout, prompt_buckets=(P,))
    parts = [generate(params, tokens[j::2], mask[j::2], jax.random.fold_in(rng, j))
             for j in range(2)]
    want = {"seq_bs": "sequences_bs", "seq_mask_bs": "sequence_mask_bs",
            "response_mask_bn": "response_mask_bn", "logp_bn": "logprobs_bn"}
    for key, name in want.items():
        expected = np.zeros(np.shape(done.buffer[key]), np.asarray(done.buffer[key]).dtype)
        for j, part in enumerate(parts):
            expected[j::2] = np.asarray(getattr(part, name))
        np.testing.assert_array_equal(np.asarray(done.buffer[key]), expected, err_msg=key)
    mask_bn = np.asarray(done.buffer["response_mask_bn"])
    np.testing.assert_array_equal(done.versions_bn, np.where(mask_bn, 0, NO_VERSION))
