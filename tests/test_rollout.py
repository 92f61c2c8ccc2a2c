"""Continuous, interruptible generation (jaxrlhf.engine.rollout): rows decoded in slots equal
one `generate` call, also when slots are refilled as rows finish; an interruption swaps
weights mid-sequence, the per-token versions show the switch, and every token's log-prob is its
own version's (checked against a full forward pass of each version over the finished
sequences, so the recomputed KV cache is right).

Partial rollouts (`async_rl.on_new_version`, `engine.rollout.scheduler.OnNewVersion`): what a
row still decoding does when the rollout worker gets new weights. `continue` recomputes its
cache under them (its earlier tokens keep their versions and log-probs, the later ones are the
new policy's to the full forward pass), `restart` decodes it anew under them (the generate
call's row under the new weights; its tokens so far counted as discarded), `finish` ends it
under the old ones while new rows wait (each batch the generate call's under one version)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrlhf.engine.generate import GenerateConfig, make_generate_fn
from jaxrlhf.engine.rollout import NO_VERSION, Rollout
from jaxrlhf.engine.rollout.scheduler import OnNewVersion
from jaxrlhf.mfc import MFC, Call, Role
from jaxrlhf.models.sizes import get_size
from jaxrlhf.models.transformer import Transformer
from jaxrlhf.parallel.layout import init_params, make_layout
from jaxrlhf.parallel.reshard import fetch
from jaxrlhf.run.rollout_worker import RolloutWorker

P, N = 6, 10
LENGTHS = (6, 2, 4, 1)
OUTPUTS = ("seq_bs", "seq_mask_bs", "response_mask_bn", "logp_bn")
GENERATED = {"seq_bs": "sequences_bs", "seq_mask_bs": "sequence_mask_bs",
             "response_mask_bn": "response_mask_bn", "logp_bn": "logprobs_bn"}


@pytest.fixture(scope="module")
def setup():
    # fp32: the interruption test compares the cached decode with a full forward pass to 1e-5,
    # which bf16 activations meet only where both happen to round alike (2 CPU devices, not 1).
    config = get_size("tiny", dtype=jnp.float32)
    # Two devices where there are (the CPU suite's 8), else one (a single accelerator).
    layout = make_layout("0-1:d2" if jax.device_count() >= 2 else "0:d1", model=config)
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


def _worker(config, layout, cfg, slots, micro_batches=1, seed=5):
    mfc = MFC("actor_gen", Role.ACTOR, Call.GENERATE, ("prompt_tokens_bp", "prompt_mask_bp"),
              OUTPUTS)
    return RolloutWorker(mfc, Rollout(config, cfg, layout, P, slots), layout, config, seed=seed,
                         chunk_tokens=3, micro_batches=micro_batches)


def _generate_all(worker, batches):
    """Admits every batch at once and steps until all are generated: {index: Generated}."""
    for index, batch in batches.items():
        worker.start(index, batch, None, 0.0)
    done, chunks = {}, 0
    while worker.busy:
        done.update((g.index, g) for g in worker.step(lambda: 1.0))
        chunks += 1
    return done, chunks


def _expected(generate, params, tokens, mask, rng, micro_batches=1):
    """What the synchronous generate executor computes: one call per strided micro-batch j
    (rows j::k, key fold_in(rng, j)), merged back."""
    k = micro_batches
    keys = [rng] if k == 1 else [jax.random.fold_in(rng, j) for j in range(k)]
    parts = [generate(params, tokens[j::k], mask[j::k], keys[j]) for j in range(k)]
    out = {}
    for key, name in GENERATED.items():
        first = np.asarray(getattr(parts[0], name))
        out[key] = np.zeros((len(tokens), *first.shape[1:]), first.dtype)
        for j, part in enumerate(parts):
            out[key][j::k] = np.asarray(getattr(part, name))
    return out


def _cut_like(want: dict, got: dict) -> dict:
    """`want` (full N columns) cut to the response width of `got` (the worker cuts after the
    longest response): the columns dropped must hold no token."""
    n = got["response_mask_bn"].shape[1]
    assert not want["response_mask_bn"][:, n:].any()
    end = P + n
    return {"seq_bs": want["seq_bs"][:, :end], "seq_mask_bs": want["seq_mask_bs"][:, :end],
            "response_mask_bn": want["response_mask_bn"][:, :n], "logp_bn": want["logp_bn"][:, :n]}


def test_slots_without_interruption_equal_one_generate_call(setup):
    config, layout, params, _, tokens, mask = setup
    cfg = _gen_config()
    worker = _worker(config, layout, cfg, slots=len(LENGTHS))
    worker.install(params, 0)
    done, chunks = _generate_all(worker, {3: {"prompt_tokens_bp": tokens,
                                              "prompt_mask_bp": mask}})
    rng = jax.random.fold_in(jax.random.key(5), np.uint32(3))
    want = _cut_like(_expected(make_generate_fn(config, cfg, layout, prompt_buckets=(P,)),
                               params, tokens, mask, rng), done[3].buffer)
    assert chunks >= 2 and done[3].interruptions == 0
    for key in ("seq_bs", "seq_mask_bs", "response_mask_bn"):
        np.testing.assert_array_equal(done[3].buffer[key], want[key], err_msg=key)
    # fp32 log-probs to an ulp or so: XLA fuses the slots' step and generate's loop apart.
    np.testing.assert_allclose(done[3].buffer["logp_bn"], want["logp_bn"], rtol=0, atol=1e-6)
    np.testing.assert_array_equal(done[3].versions_bn,
                                  np.where(want["response_mask_bn"], 0, NO_VERSION))


def test_refilled_slots_decode_every_row_as_one_generate_call(setup):
    """Two batches of 4 rows through 2 slots: a slot whose row stopped takes the next row
    (of its batch, then of the next), which starts at its own position with the predecessor's
    keys still in the cache; every row still comes out as the generate call's, and the slots
    were busy for more than a batch-at-a-time decode would keep them."""
    config, layout, params, _, tokens, mask = setup
    cfg = _gen_config(eos_token_id=tuple(range(1, 40)))  # random weights stop at any length
    worker = _worker(config, layout, cfg, slots=2)
    worker.install(params, 0)
    other = np.roll(tokens, 1, axis=1), np.roll(mask, 1, axis=1)
    batches = {0: {"prompt_tokens_bp": tokens, "prompt_mask_bp": mask},
               1: {"prompt_tokens_bp": np.where(other[1], other[0], 0), "prompt_mask_bp": mask}}
    done, _ = _generate_all(worker, batches)
    generate = make_generate_fn(config, cfg, layout, prompt_buckets=(P,))
    for index, batch in batches.items():
        rng = jax.random.fold_in(jax.random.key(5), np.uint32(index))
        want = _cut_like(_expected(generate, params, batch["prompt_tokens_bp"],
                                   batch["prompt_mask_bp"], rng), done[index].buffer)
        lengths = want["response_mask_bn"].sum(1)
        assert len(set(lengths)) > 1, "rows of one length would never refill mid-batch"
        for key in ("seq_bs", "seq_mask_bs", "response_mask_bn"):
            np.testing.assert_array_equal(done[index].buffer[key], want[key], err_msg=key)
        # Refills prefill 1 or 2 rows, not the batch's 4: other matmul shapes, same math.
        np.testing.assert_allclose(done[index].buffer["logp_bn"], want["logp_bn"], rtol=0,
                                   atol=1e-6)


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
    rollout = Rollout(config, cfg, layout, P, len(LENGTHS))
    keys = [jax.random.key(3)] * len(LENGTHS)
    state = rollout.fill(rollout.empty(), params_a, 0, np.arange(len(LENGTHS)), tokens, mask,
                         keys, np.arange(len(LENGTHS)))
    state = rollout.advance(state, params_a, 0, 3, longest=1)  # tokens 0..3 under version 0
    _, counts = rollout.poll(state)
    assert counts[2] == 4  # the longest busy row: the cache is recomputed 8 of N slots far
    state = rollout.reload(state, params_b, counts[2])  # the rest under version 1
    state = rollout.advance(state, params_b, 1, N)
    done_b, counts = rollout.poll(state)
    assert done_b.all() and counts.tolist() == [(N - 1) * len(LENGTHS)] * 2 + [0]
    out = rollout.rows(state)
    want = np.array([0] * 4 + [1] * (N - 4))
    np.testing.assert_array_equal(out.versions_bn, np.broadcast_to(want, out.versions_bn.shape))
    # Each token's recorded log-prob is its sampling policy's: version 0's for the first
    # four, version 1's (through the recomputed cache) for the rest.
    logp_a = _full_forward_logp(config, params_a, out.sequences_bs, out.sequence_mask_bs)
    logp_b = _full_forward_logp(config, params_b, out.sequences_bs, out.sequence_mask_bs)
    expected = np.where(out.versions_bn == 0, logp_a, logp_b)
    np.testing.assert_allclose(out.logprobs_bn, expected, rtol=1e-5, atol=1e-5)
    # ...and the two policies really differ on the tokens after the switch.
    assert np.abs(logp_a - logp_b)[:, 4:].max() > 1e-2


def test_each_device_decodes_its_own_slots_alone(setup):
    """A data-parallel device whose slots are all free runs no decode step while the other
    decodes (each device loops on its own slots: no all-reduce of the loop condition), and
    the busy slots' rows are the generate call's."""
    config, layout, params, _, tokens, mask = setup
    if layout.dp_size < 2:
        pytest.skip("needs two data-parallel devices")
    cfg = _gen_config(force_max_length=True)
    rollout = Rollout(config, cfg, layout, P, len(LENGTHS))  # slots 0-1 on one device, 2-3
    state = rollout.fill(rollout.empty(), params, 0, [2, 3], tokens[:2], mask[:2],
                         [jax.random.key(3)] * 2, [0, 1])
    state = rollout.advance(state, params, 0, N)
    np.testing.assert_array_equal(np.asarray(fetch(state.steps_b)), [0, 0, N - 1, N - 1])
    out = rollout.rows(state)
    generate = make_generate_fn(config, cfg, layout, prompt_buckets=(P,))
    want = generate(params, tokens[:2], mask[:2], jax.random.key(3))
    np.testing.assert_array_equal(out.sequences_bs[2:], np.asarray(fetch(want.sequences_bs)))
    np.testing.assert_allclose(out.logprobs_bn[2:], np.asarray(fetch(want.logprobs_bn)),
                               rtol=0, atol=1e-6)


@pytest.mark.slow  # two more compiles (a generate call and a rollout for 2-row micro-batches)
def test_micro_batches_decode_in_turn_like_the_synchronous_generate_call(setup):
    """`actor_gen@2` in the asynchronous loop: rows j::2 queued micro-batch by micro-batch into
    2 slots, micro-batch j sampling with fold_in(the batch's key, j), merged back: exactly what
    the synchronous generate executor computes (one `generate` call per micro-batch)."""
    config, layout, params, _, tokens, mask = setup
    cfg = _gen_config()
    worker = _worker(config, layout, cfg, slots=2, micro_batches=2)
    worker.install(params, 0)
    done, _ = _generate_all(worker, {3: {"prompt_tokens_bp": tokens, "prompt_mask_bp": mask}})
    rng = jax.random.fold_in(jax.random.key(5), np.uint32(3))
    want = _cut_like(_expected(make_generate_fn(config, cfg, layout, prompt_buckets=(P,)),
                               params, tokens, mask, rng, micro_batches=2), done[3].buffer)
    for key in ("seq_bs", "seq_mask_bs", "response_mask_bn"):
        np.testing.assert_array_equal(done[3].buffer[key], want[key], err_msg=key)
    np.testing.assert_allclose(done[3].buffer["logp_bn"], want["logp_bn"], rtol=0, atol=1e-6)
    np.testing.assert_array_equal(done[3].versions_bn,
                                  np.where(want["response_mask_bn"], 0, NO_VERSION))


# --- partial rollouts: a busy row when new weights come ----------------------------------------

SEED = 5  # the partial-rollout tests' worker seed
FIRST = 4  # tokens a row has when the weights change: its fill's, then one chunk of 3


def _mode_worker(setup, cfg, mode: OnNewVersion, slots: int = 4) -> RolloutWorker:
    config, layout, *_ = setup
    mfc = MFC("actor_gen", Role.ACTOR, Call.GENERATE, ("prompt_tokens_bp", "prompt_mask_bp"),
              OUTPUTS)
    return RolloutWorker(mfc, Rollout(config, cfg, layout, P, slots), layout, config,
                         seed=SEED, chunk_tokens=FIRST - 1, on_new_version=mode)


def _switched(setup, cfg, mode: OnNewVersion, second_batch: bool = False) -> dict:
    """Batch 0 (and, with `second_batch`, batch 1 admitted right after the switch) through 4
    slots: one step under params_a (version 0), then params_b (version 1) to the end;
    {index: Generated}."""
    _, _, params_a, params_b, tokens, mask = setup
    worker = _mode_worker(setup, cfg, mode)
    worker.install(params_a, 0)
    worker.start(0, {"prompt_tokens_bp": tokens, "prompt_mask_bp": mask}, None, 0.0)
    done = {g.index: g for g in worker.step(lambda: 1.0)}
    assert not done, "every row must still decode at the switch"
    worker.install(params_b, 1)
    if second_batch:
        worker.start(1, {"prompt_tokens_bp": tokens, "prompt_mask_bp": mask}, None, 0.0)
    while worker.busy:
        done.update((g.index, g) for g in worker.step(lambda: 1.0))
    return done


def _want(setup, cfg, params, index: int, got) -> dict:
    """The synchronous generate call's batch `index` under `params`, cut as `got`."""
    config, layout, _, _, tokens, mask = setup
    generate = make_generate_fn(config, cfg, layout, prompt_buckets=(P,))
    rng = jax.random.fold_in(jax.random.key(SEED), np.uint32(index))
    return _cut_like(_expected(generate, params, tokens, mask, rng), got.buffer)


def _assert_rows(got: dict, want: dict, rows) -> None:
    for key in ("seq_bs", "seq_mask_bs", "response_mask_bn"):
        np.testing.assert_array_equal(got[key][rows], want[key][rows], err_msg=key)
    np.testing.assert_allclose(got["logp_bn"][rows], want["logp_bn"][rows], rtol=0, atol=1e-6)


def test_continue_recomputes_the_cache_and_keeps_the_earlier_tokens(setup):
    """Every row spans both versions: its first tokens are version 0's (the generate call's
    under params_a, log-probs included), the rest version 1's, each token's log-prob its own
    version's full forward pass (so the recomputed cache is a prefill under the new weights);
    no row was discarded."""
    config, _, params_a, params_b, *_ = setup
    cfg = _gen_config(force_max_length=True)
    got = _switched(setup, cfg, OnNewVersion.CONTINUE)[0]
    assert got.interruptions == 1 and got.restarts == 0 and got.discarded_tokens == 0
    b, versions_bn = got.buffer, got.versions_bn
    assert b["response_mask_bn"].all()
    np.testing.assert_array_equal(versions_bn[:, :FIRST], 0)
    np.testing.assert_array_equal(versions_bn[:, FIRST:], 1)
    before = _want(setup, cfg, params_a, 0, got)
    for key in ("seq_bs", "logp_bn"):  # the tokens before the switch, as sampled
        cut = P + FIRST if key == "seq_bs" else FIRST
        np.testing.assert_allclose(b[key][:, :cut], before[key][:, :cut], rtol=0, atol=1e-6)
    logp_a = _full_forward_logp(config, params_a, b["seq_bs"], b["seq_mask_bs"])
    logp_b = _full_forward_logp(config, params_b, b["seq_bs"], b["seq_mask_bs"])
    np.testing.assert_allclose(b["logp_bn"], np.where(versions_bn == 0, logp_a, logp_b),
                               rtol=1e-5, atol=1e-5)
    assert np.abs(logp_a - logp_b)[:, FIRST:].max() > 1e-2  # the policies differ there


def test_restart_decodes_the_busy_rows_anew_under_the_new_weights(setup):
    """Rows done at the switch are the generate call's under params_a (version 0); the rows
    still decoding were aborted (their tokens discarded) and are the generate call's under
    params_b, every token version 1."""
    _, _, params_a, params_b, *_ = setup
    cfg = _gen_config(eos_token_id=tuple(range(1, 40)))  # random weights stop at any length
    got = _switched(setup, cfg, OnNewVersion.RESTART)[0]
    before = _want(setup, cfg, params_a, 0, got)
    after = _want(setup, cfg, params_b, 0, got)
    busy_b = before["response_mask_bn"].sum(1) > FIRST  # still decoding at the switch
    assert busy_b.any() and not busy_b.all()
    assert got.restarts == busy_b.sum() and got.interruptions == 0
    assert got.discarded_tokens == FIRST * busy_b.sum()
    _assert_rows(got.buffer, before, ~busy_b)
    _assert_rows(got.buffer, after, busy_b)
    policy_bn = got.buffer["response_mask_bn"]
    np.testing.assert_array_equal(
        got.versions_bn, np.where(policy_bn, np.where(busy_b, 1, 0)[:, None], NO_VERSION))


def test_finish_ends_the_busy_rows_under_their_weights_before_new_rows_start(setup):
    """Batch 0 finishes under params_a although params_b came part-way (every token version 0,
    the generate call's rows); batch 1, admitted meanwhile, waits for it and decodes wholly
    under params_b."""
    _, _, params_a, params_b, *_ = setup
    cfg = _gen_config(eos_token_id=tuple(range(1, 40)))
    done = _switched(setup, cfg, OnNewVersion.FINISH, second_batch=True)
    for index, params, version in ((0, params_a, 0), (1, params_b, 1)):
        got = done[index]
        assert got.interruptions == 0 and got.restarts == 0 and got.discarded_tokens == 0
        want = _want(setup, cfg, params, index, got)
        _assert_rows(got.buffer, want, slice(None))
        np.testing.assert_array_equal(
            got.versions_bn, np.where(got.buffer["response_mask_bn"], version, NO_VERSION))


@pytest.mark.parametrize("mode", list(OnNewVersion))
def test_new_weights_between_batches_change_nothing_else(setup, mode):
    """Weights that come when no row decodes take effect at once in every mode: the next
    batch is the generate call's under them."""
    _, _, params_a, params_b, tokens, mask = setup
    cfg = _gen_config(eos_token_id=tuple(range(1, 40)))
    worker = _mode_worker(setup, cfg, mode)
    worker.install(params_a, 0)
    worker.install(params_b, 1)
    worker.start(0, {"prompt_tokens_bp": tokens, "prompt_mask_bp": mask}, None, 0.0)
    done = []
    while worker.busy:
        done += worker.step(lambda: 1.0)
    (got,) = done
    _assert_rows(got.buffer, _want(setup, cfg, params_b, 0, got), slice(None))
    assert got.restarts == 0 and got.interruptions == 0
