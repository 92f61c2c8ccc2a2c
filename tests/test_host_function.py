"""A host reward function that fails on most samples of a step stops the run, with its error."""

import pathlib

import pytest

from jaxrlhf.data.rewards import RewardPool
from jaxrlhf.dataflow.executors import HostFunctionError, check_error_rate

FIXTURES = pathlib.Path(__file__).parent / "fixtures"


@pytest.fixture(scope="module")
def pool():
    with RewardPool(f"{FIXTURES / 'reward_fns.py'}:misbehaving", num_workers=1,
                    timeout_s=5.0) as p:
        yield p


def test_mostly_failing_step_raises_the_functions_error(pool):
    result = pool.submit(["raise", "raise", "raise", "ok"], ["a", "b", "c", "dd"],
                         ["", "", "", ""]).result(timeout=60)
    assert result.errors.exception == 3
    with pytest.raises(HostFunctionError, match=r"reward function failed on 3 of 4 samples this "
                       r"step \(reward.max_error_rate=0.5\): \d: exception: RuntimeError: boom"):
        check_error_rate(result, "reward", 0.5)


def test_a_few_failures_are_counted_not_fatal(pool):
    result = pool.submit(["raise", "ok", "ok", "ok"], ["a", "b", "c", "dd"],
                         ["", "", "", ""]).result(timeout=60)
    check_error_rate(result, "reward", 0.5)  # 1 of 4: under the budget
    assert list(result.rewards_b) == [0.0, 1.0, 1.0, 2.0] and result.errors.total == 1
    with pytest.raises(HostFunctionError):
        check_error_rate(result, "reward", 0.0)  # a zero budget: any failure stops the run
