"""Reward functions, their resolution from config strings, and the RewardPool's failure handling."""

import pathlib
import time

import numpy as np
import pytest

from jaxrlhf.data import rewards
from jaxrlhf.data.rewards import (
    ErrorCounts,
    RewardPool,
    RewardPoolError,
    StartMethod,
    exact_match,
    extract_answer,
    resolve_reward,
)

FIXTURES = pathlib.Path(__file__).parent / "fixtures"
MISBEHAVING = f"{FIXTURES / 'reward_fns.py'}:misbehaving"


@pytest.mark.parametrize(
    "completion, expected",
    [
        ("579", 1.0),
        (" 579 ", 1.0),
        ("579\n1+1=2", 1.0),  # only the first line is the answer
        ("579 \n", 1.0),
        ("57", 0.0),
        ("5790", 0.0),
        ("\n579", 0.0),  # an empty first line is an empty answer
        ("", 0.0),
    ],
)
def test_exact_match(completion, expected):
    assert exact_match("123+456=", completion, "579") == expected


def test_exact_match_needs_answer():
    with pytest.raises(ValueError, match="reference answer"):
        exact_match("1+1=", "2", None)


def test_extract_answer():
    assert extract_answer("  -42  \nrest") == "-42"


def test_resolve_reward_specs():
    assert resolve_reward("exact_match") is exact_match
    assert resolve_reward("jaxrlhf.data.rewards:exact_match") is exact_match
    assert resolve_reward(MISBEHAVING)("p", "abc", None) == 3.0
    with pytest.raises(ValueError, match="unknown reward"):
        resolve_reward("exact_matchh")
    with pytest.raises(FileNotFoundError):
        resolve_reward(f"{FIXTURES / 'missing.py'}:f")
    with pytest.raises(ValueError, match="no function 'nope'"):
        resolve_reward(f"{FIXTURES / 'reward_fns.py'}:nope")
    with pytest.raises(ModuleNotFoundError):
        resolve_reward("no_such_module_xyz:f")


@pytest.fixture(scope="module")
def pool():
    with RewardPool(MISBEHAVING, num_workers=2, timeout_s=1.0) as p:
        yield p


def test_pool_turns_every_failure_into_zero_and_a_count(pool):
    cases = {
        "ok": 2.0, "raise": 0.0, "hang": 0.0, "nan": 0.0, "string": 0.0, "inf": 0.0,
        "exit": 0.0,
    }
    prompts = list(cases) + ["ok"]
    completions = ["ab"] * len(cases) + ["abcde"]
    before = pool.error_counts()
    start = time.monotonic()
    handle = pool.submit(prompts, completions)
    assert not handle.done()  # submit only enqueues; the 1 s hang runs in the background
    batch = handle.result(timeout=30)
    elapsed = time.monotonic() - start

    np.testing.assert_array_equal(batch.rewards_b, list(cases.values()) + [5.0])
    assert batch.rewards_b.dtype == np.float32
    np.testing.assert_array_equal(batch.valid_b, [True] + [False] * 6 + [True])
    # nan, string and inf are bad values; raise and the dying worker are exceptions.
    assert batch.errors == ErrorCounts(exception=2, timeout=1, bad_value=3)
    assert any("RuntimeError: boom" in m for m in batch.messages)
    assert any(m.startswith("6: exception: worker died (exit code 3)") for m in batch.messages)
    assert 1.0 <= elapsed < 15.0  # the hung call was cut at its 1 s timeout
    after = pool.error_counts()
    assert after.total - before.total == 6 and after.timeout - before.timeout == 1


def test_pool_still_works_after_failures(pool):
    test_pool_turns_every_failure_into_zero_and_a_count(pool)  # kill and replace workers
    handles = [pool.submit(["ok"] * 3, ["a" * (i + k) for k in range(3)]) for i in range(3)]
    for i, handle in enumerate(handles):
        batch = handle.result(timeout=30)
        np.testing.assert_array_equal(batch.rewards_b, [i, i + 1, i + 2])
        assert batch.errors.total == 0 and batch.valid_b.all()


def test_pool_empty_batch_and_length_mismatch(pool):
    assert pool.submit([], []).result(timeout=1).rewards_b.shape == (0,)
    with pytest.raises(ValueError, match="2 prompts, 1 completions"):
        pool.submit(["a", "b"], ["c"])


def test_spawn_pool_with_builtin_exact_match():
    with RewardPool("exact_match", num_workers=1, start_method=StartMethod.SPAWN) as pool:
        batch = pool.submit(["1+2=", "2+2=", "9+9="], ["3", "5", "18\n"], ["3", "4", "18"]).result(
            timeout=60
        )
        # A row without an answer is a counted exception, not a crash.
        missing = pool.submit(["1+2="], ["3"]).result(timeout=60)
    np.testing.assert_array_equal(batch.rewards_b, [1.0, 0.0, 1.0])
    assert batch.errors.total == 0
    assert missing.errors == ErrorCounts(exception=1)
    with pytest.raises(RewardPoolError, match="closed"):
        pool.submit(["a"], ["b"])


def test_pool_fails_fast_on_bad_spec():
    with pytest.raises(ValueError, match="unknown reward"):
        RewardPool("nope")


def test_worker_that_cannot_load_fails_the_batch_instead_of_hanging():
    spec = f"{FIXTURES / 'reward_fns_child_fails.py'}:score"
    assert resolve_reward(spec)("p", "c", None) == 1.0  # loads fine in this process
    with RewardPool(spec, num_workers=1) as pool:
        # The worker may fail before or after the first submit: either fails the batch.
        with pytest.raises(RewardPoolError, match="refuses to load"):
            pool.submit(["p"], ["c"]).result(timeout=30)
        with pytest.raises(RewardPoolError, match="refuses to load"):
            pool.submit(["p"], ["c"])


def test_error_counts_as_metrics():
    counts = ErrorCounts(exception=1, timeout=2, bad_value=3)
    assert counts.total == 6
    assert counts.as_dict() == {
        "reward_errors/exception": 1, "reward_errors/timeout": 2, "reward_errors/bad_value": 3,
    }
    assert set(rewards.BUILTIN_REWARDS) == {"exact_match", "zero", "math", "code"}


def test_values_outside_float32_are_bad_values():
    """1e300 is finite as a Python float but inf once rewards become float32."""
    assert rewards._check_value(1e300)[0] is rewards.ErrorKind.BAD_VALUE
    assert rewards._check_value(-3.4e38) == (None, -3.4e38)


def test_a_function_that_kills_every_worker_warns_once_and_echoes_no_megabytes(caplog):
    """One reward function that kills its worker on every call logged one warning per call
    (40 lines), and one that raised with its 1 MB completion in the message echoed it into
    every message (42 MB on stderr); now one warning, and each message is clipped (issue 46)."""
    with caplog.at_level("WARNING"), RewardPool(MISBEHAVING, num_workers=1) as pool:
        batch = pool.submit(["exit"] * 6 + ["echo"] * 3, ["ab"] * 6 + ["x" * 10**6] * 3
                            ).result(timeout=120)
    assert batch.errors == ErrorCounts(exception=9)
    died = [r for r in caplog.records if "worker died" in r.getMessage()]
    assert len(died) == 1 and "later ones are counted" in died[0].getMessage(), died
    assert max(len(m) for m in batch.messages) < 400
    assert any(m.startswith("6: exception: ValueError: bad completion: xxx") and
               m.endswith("... (1,000,028 characters)") for m in batch.messages), batch.messages
