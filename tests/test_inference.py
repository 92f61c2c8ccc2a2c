"""The inference call kinds: log-probs/entropy, values and scores against Hugging Face on each
unpadded sequence, padded == packed, bucketing, and sharded == single-device."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hf_fixtures import hf_logits, hf_token_scores, make_tiny_hf_model
from jaxrlhf.engine import buckets, inference
from jaxrlhf.engine.inference import (
    InferenceBatch, InferenceConfig, InferenceKind, head_row_chunks, make_inference_fn,
    positions_from_segments, row_chunks,
)
from jaxrlhf.models import hf_io
from jaxrlhf.models.config import HeadKind
from jaxrlhf.models.sizes import abstract_params
from jaxrlhf.parallel import make_layout

LENGTHS = (5, 11, 3, 8)  # four sequences; packed as [5 + 11] and [3 + 8]
WIDTH = 16
TEMPERATURE = 0.8


def _load(path, layout_spec="0:d1"):
    config = hf_io.load_hf_config(path, dtype=jnp.float32)
    layout = make_layout(layout_spec, model=config)
    config, params = hf_io.load_hf(
        path, dtype=jnp.float32, shardings=layout.param_shardings(abstract_params(config))
    )
    return config, layout, params


@pytest.fixture(scope="module")
def lm(tmp_path_factory):
    """(hf_model, config, layout, params) of a tiny random causal Llama."""
    path, hf_model = make_tiny_hf_model(tmp_path_factory.mktemp("lm"), "llama")
    return (hf_model, *_load(path))


@pytest.fixture(scope="module")
def critic(tmp_path_factory):
    """(hf_model, config, layout, params) of a tiny random one-label Llama classifier."""
    path, hf_model = make_tiny_hf_model(tmp_path_factory.mktemp("cls"), "llama", seq_cls=True)
    hf_model, config, layout, params = (hf_model, *_load(path))
    assert config.head is HeadKind.SCALAR
    return hf_model, config, layout, params


@pytest.fixture(scope="module")
def sequences(lm):
    rng = np.random.default_rng(0)
    return [rng.integers(1, lm[1].vocab_size, n).astype(np.int32) for n in LENGTHS]


@pytest.fixture(scope="module")
def logprob_fn(lm):
    _, config, layout, _ = lm
    cfg = InferenceConfig(InferenceKind.LOGPROBS, temperature=TEMPERATURE, with_entropy=True)
    return make_inference_fn(config, cfg, layout, length_buckets=(WIDTH,))


def _padded(sequences):
    """One sequence per row, left-padded rows 0 and 2, right-padded rows 1 and 3."""
    tokens, mask = np.zeros((len(sequences), WIDTH), np.int32), np.zeros((len(sequences), WIDTH))
    for row, seq in enumerate(sequences):
        start = WIDTH - len(seq) if row % 2 == 0 else 0
        tokens[row, start:start + len(seq)], mask[row, start:start + len(seq)] = seq, 1
    return InferenceBatch.padded(tokens, mask.astype(bool)), mask.astype(bool)


def _packed(sequences):
    """Two sequences per row (segment ids 1 and 2), right-padded with segment 0; rows 2 and 3
    are all padding (so the batch size equals the padded one's)."""
    tokens, segments = np.zeros((4, WIDTH), np.int32), np.zeros((4, WIDTH), np.int32)
    for row in range(2):
        start = 0
        for seg, seq in enumerate(sequences[2 * row: 2 * row + 2], start=1):
            tokens[row, start:start + len(seq)], segments[row, start:start + len(seq)] = seq, seg
            start += len(seq)
    return InferenceBatch.packed(tokens, segments), segments


def _log_softmax(x):
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def _reference_logprobs(hf_model, seq, temperature=TEMPERATURE):
    """(logprobs [n], entropy [n]) of the lone sequence by HF + numpy, 0 at the first token."""
    logits = hf_logits(hf_model, seq[None], np.ones((1, len(seq)), np.int32))[0]
    logp = _log_softmax(logits.astype(np.float64) / temperature)
    token_logp = np.concatenate([[0.0], logp[np.arange(len(seq) - 1), seq[1:]]])
    entropy = np.concatenate([[0.0], -(np.exp(logp) * logp).sum(-1)[:-1]])
    return token_logp, entropy


def _reference_values(hf_model, seq):
    return hf_token_scores(hf_model, seq[None], np.ones((1, len(seq)), np.int32))[0]


def test_bucket_helpers():
    assert buckets.power_of_two_buckets(100) == (16, 32, 64, 100)
    assert buckets.power_of_two_buckets(64, min_len=8) == (8, 16, 32, 64)
    assert buckets.power_of_two_buckets(8) == (8,)
    assert [buckets.bucket_length(n, (16, 32, 64)) for n in (0, 16, 17, 64)] == [16, 16, 32, 64]
    with pytest.raises(ValueError, match="exceeds"):
        buckets.bucket_length(65, (16, 32, 64))
    assert buckets.response_widths(128) == (16, 32, 48, 64, 80, 96, 112, 128)
    assert buckets.response_widths(100) == (16, 32, 48, 64, 80, 96, 100)
    assert buckets.response_widths(8) == (8,) and buckets.response_widths(10) == (8, 10)
    x = np.arange(6).reshape(2, 3)
    np.testing.assert_array_equal(buckets.pad_axis(x, 5, axis=1, value=-1, left=True),
                                  [[-1, -1, 0, 1, 2], [-1, -1, 3, 4, 5]])
    np.testing.assert_array_equal(buckets.pad_axis(jnp.asarray(x), 3, axis=0),
                                  [[0, 1, 2], [3, 4, 5], [0, 0, 0]])


def test_compile_cache_counts_and_reports():
    cache = buckets.CompileCache("test/double")
    double = jax.jit(lambda x: 2 * x)
    for n in (3, 3, 4):
        x = np.ones(n, np.float32)
        out = cache.get(n, lambda: double.lower(x))(x)
        np.testing.assert_array_equal(np.asarray(out), 2 * x)
    assert cache.compiles == 2 and len(cache) == 2 and cache.compile_seconds > 0
    assert buckets.compile_report()["test/double"]["compiles"] == 2


def test_positions_from_segments():
    segments = np.array([[0, 0, 1, 1, 1, 2, 2, 0], [1, 1, 1, 1, 2, 3, 3, 3]], np.int32)
    want = np.array([[0, 1, 0, 1, 2, 0, 1, 0], [0, 1, 2, 3, 0, 0, 1, 2]])
    np.testing.assert_array_equal(np.asarray(positions_from_segments(jnp.asarray(segments))),
                                  want)


def test_logprobs_and_entropy_padded_and_packed(lm, logprob_fn, sequences):
    hf_model, _, _, params = lm
    padded_batch, mask = _padded(sequences)
    packed_batch, segments = _packed(sequences)
    padded = logprob_fn(params, padded_batch)
    packed = logprob_fn(params, packed_batch)
    assert logprob_fn.compiles == 1  # both batch layouts share one executable
    assert padded.values_bt is None and padded.scores_bk is None
    assert np.isfinite(np.asarray(packed.entropy_bt)).all()

    for i, seq in enumerate(sequences):
        want_logp, want_entropy = _reference_logprobs(hf_model, seq)
        row, seg = divmod(i, 2)
        for got, r, valid in ((padded, i, mask[i]), (packed, row, segments[row] == seg + 1)):
            np.testing.assert_allclose(np.asarray(got.logprobs_bt)[r][valid], want_logp,
                                       atol=1e-5, rtol=0)
            np.testing.assert_allclose(np.asarray(got.entropy_bt)[r][valid], want_entropy,
                                       atol=1e-5, rtol=0)
    assert (np.asarray(padded.logprobs_bt)[~mask] == 0).all()
    assert (np.asarray(packed.logprobs_bt)[segments == 0] == 0).all()


def test_values_and_scores_padded_and_packed(critic, sequences):
    hf_model, config, layout, params = critic
    values_fn = make_inference_fn(config, InferenceConfig(InferenceKind.VALUES), layout,
                                  length_buckets=(WIDTH,))
    padded_batch, mask = _padded(sequences)
    packed_batch, segments = _packed(sequences)
    padded_values = np.asarray(values_fn(params, padded_batch).values_bt)
    packed_values = np.asarray(values_fn(params, packed_batch).values_bt)
    want = [_reference_values(hf_model, seq) for seq in sequences]
    assert np.ptp(np.concatenate(want)) > 0.1  # values vary, so misplaced ones would show
    for i in range(len(sequences)):
        row, seg = divmod(i, 2)
        np.testing.assert_allclose(padded_values[i][mask[i]], want[i], atol=1e-5, rtol=0)
        np.testing.assert_allclose(packed_values[row][segments[row] == seg + 1], want[i],
                                   atol=1e-5, rtol=0)
    assert (padded_values[~mask] == 0).all() and (packed_values[segments == 0] == 0).all()

    # Up to 3 sequences per row: padded rows fill slot 0, packed rows slots 0 and 1.
    scores_fn = make_inference_fn(
        config, InferenceConfig(InferenceKind.SCORES, max_segments=3), layout,
        length_buckets=(WIDTH,),
    )
    last = np.array([w[-1] for w in want])
    got = np.asarray(scores_fn(params, padded_batch).scores_bk)
    np.testing.assert_allclose(got[:, 0], last, atol=1e-5, rtol=0)
    assert (got[:, 1:] == 0).all()
    got = np.asarray(scores_fn(params, packed_batch).scores_bk)
    np.testing.assert_allclose(got[:2, :2], last.reshape(2, 2), atol=1e-5, rtol=0)
    assert (got[:, 2] == 0).all() and (got[2:] == 0).all()
    assert scores_fn.compiles == 1


def test_length_bucketing_cuts_outputs_and_compiles_once(lm, sequences):
    hf_model, config, layout, params = lm
    infer = make_inference_fn(config, InferenceConfig(InferenceKind.LOGPROBS), layout,
                              length_buckets=(8, 32))
    n = min(LENGTHS)
    short = np.stack([seq[:n] for seq in sequences])
    want = np.stack([_reference_logprobs(hf_model, seq, temperature=1.0)[0] for seq in short])
    for width in (9, 12):  # both in bucket 32
        tokens = np.zeros((4, width), np.int32)
        tokens[:, :n] = short
        mask = np.broadcast_to(np.arange(width)[None] < n, (4, width))
        out = infer(params, InferenceBatch.padded(tokens, mask))
        assert out.logprobs_bt.shape == (4, width) and out.entropy_bt is None
        np.testing.assert_allclose(np.asarray(out.logprobs_bt)[:, :n], want, atol=1e-5, rtol=0)
    assert infer.compiles == 1


def test_head_mismatch_is_rejected(lm):
    _, config, layout, _ = lm
    with pytest.raises(ValueError, match="head"):
        make_inference_fn(config, InferenceConfig(InferenceKind.VALUES), layout)


@pytest.mark.devices(8)
@pytest.mark.parametrize("spec", ["0-7:d4t2", "0-7:f2t2d2"])
def test_sharded_inference_equals_single_device(lm, logprob_fn, sequences, spec):
    _, config, _, params = lm
    batch, _ = _padded(sequences)
    single = logprob_fn(params, batch)
    layout = make_layout(spec, model=config)
    sharded_params = jax.device_put(params, layout.param_shardings(abstract_params(config)))
    sharded = make_inference_fn(config, logprob_fn.cfg, layout, length_buckets=(WIDTH,))(
        sharded_params, batch
    )
    assert len(sharded.logprobs_bt.sharding.device_set) == 8
    for got, want in ((sharded.logprobs_bt, single.logprobs_bt),
                      (sharded.entropy_bt, single.entropy_bt)):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=0)


def test_row_chunks():
    # W-cpu's 64 rows of 96 tokens on one device: 4 chunks of 1,536 tokens.
    assert row_chunks(64, 96, 2048) == 4
    assert row_chunks(8, 96, 2048) == 1  # its share of 8 devices: one chunk
    assert row_chunks(18, 96, 600) == 3  # the fewest chunks that divide the rows evenly
    assert row_chunks(7, 1024, 2048) == 7 and row_chunks(3, 4096, 2048) == 3  # a row a chunk
    assert row_chunks(64, 96, None) == 1


def _assert_hfs_logprobs(out, hf_model, sequences, mask):
    """Each padded row's log-probs and entropies as HF gives them on its lone sequence."""
    for i, seq in enumerate(sequences):
        want_logp, want_entropy = _reference_logprobs(hf_model, seq)
        np.testing.assert_allclose(np.asarray(out.logprobs_bt)[i][mask[i]], want_logp,
                                   atol=1e-5, rtol=0)
        np.testing.assert_allclose(np.asarray(out.entropy_bt)[i][mask[i]], want_entropy,
                                   atol=1e-5, rtol=0)


def test_head_row_chunks():
    # A v5p chip's 16 rows of 2,048 tokens over Llama-3's vocabulary: a row's logits a chunk.
    assert head_row_chunks(16, 2048, 128256) == 16
    assert head_row_chunks(8, 2048, 128256 // 4) == 2  # t4: four rows a chunk
    assert head_row_chunks(3, 4096, 128256) == 3  # a row alone holds more: a row a chunk
    assert head_row_chunks(6, 128, 1000) == 1


@pytest.mark.devices(2)
@pytest.mark.parametrize("spec", ["0:d1", "0-1:d2"])
def test_head_in_row_chunks_equals_hf(lm, sequences, spec, monkeypatch):
    """An accelerator's log-probs read the head out in row chunks (`head_row_chunks`); here on
    CPU devices with a budget of one row's logits and the whole forward in one chunk: a loop
    more in the program, log-probs and entropies as HF gives them on each sequence."""
    hf_model, config, _, params = lm
    layout = make_layout(spec, model=config)
    params = jax.device_put(params, layout.param_shardings(abstract_params(config)))
    sequences = sequences * layout.dp_size  # every device packs two rows
    batch, mask = _padded(sequences)
    fn = make_inference_fn(config, InferenceConfig(InferenceKind.LOGPROBS, TEMPERATURE,
                                                   with_entropy=True), layout,
                           length_buckets=(WIDTH,))
    assert fn._head_vocab == 0  # XLA:CPU chunks its whole forward instead
    loops = lambda: fn._lower(params, jax.device_put(batch, fn._rows)).as_text().count(
        "stablehlo.while")
    fn._chunk_tokens, whole = None, loops()
    monkeypatch.setattr(inference, "HEAD_CHUNK_BYTES", WIDTH * config.vocab_size * 4)
    fn._head_vocab = config.vocab_size
    assert loops() == whole + 1
    out = fn(params, batch)
    _assert_hfs_logprobs(out, hf_model, sequences, mask)


@pytest.mark.devices(2)
@pytest.mark.parametrize("spec", ["0:d1", "0-1:d2"])
def test_inference_in_row_chunks_equals_hf(lm, critic, sequences, spec, monkeypatch):
    """A chunk budget of one row: the forward runs its packed rows one at a time (a second
    loop in the program), log-probs, entropies and scores as HF gives them on each sequence."""
    hf_model, config, _, params = lm
    layout = make_layout(spec, model=config)
    params = jax.device_put(params, layout.param_shardings(abstract_params(config)))
    rows = 2 * layout.dp_size  # every device packs (5 + 11) and (3 + 8): two rows
    sequences = sequences * layout.dp_size
    batch, mask = _padded(sequences)
    loops, default = {}, inference.CPU_CHUNK_TOKENS
    for budget in (default, WIDTH):
        monkeypatch.setattr(inference, "CPU_CHUNK_TOKENS", budget)
        fn = make_inference_fn(config, InferenceConfig(InferenceKind.LOGPROBS, TEMPERATURE,
                                                       with_entropy=True), layout,
                               length_buckets=(WIDTH,))
        loops[budget] = fn._lower(params, jax.device_put(batch, fn._rows)).as_text().count(
            "stablehlo.while")
    assert row_chunks(rows // layout.dp_size, WIDTH, WIDTH) == 2
    assert loops[WIDTH] == loops[default] + 1
    out = fn(params, batch)
    _assert_hfs_logprobs(out, hf_model, sequences, mask)
    hf_critic, critic_config, _, critic_params = critic
    critic_params = jax.device_put(critic_params,
                                   layout.param_shardings(abstract_params(critic_config)))
    scores_fn = make_inference_fn(critic_config, InferenceConfig(InferenceKind.SCORES),
                                  layout, length_buckets=(WIDTH,))
    got = np.asarray(scores_fn(critic_params, batch).scores_bk)[:, 0]
    np.testing.assert_allclose(got, [_reference_values(hf_critic, seq)[-1] for seq in sequences],
                               atol=1e-5, rtol=0)
