"""The planner's price of a weight sync (plan/weight_sync.py), by hand on a 16 x 8 H100 file."""

import pathlib

import pytest

from jaxrlhf.parallel.strategy import DeviceRange
from jaxrlhf.plan.choice import CallChoice
from jaxrlhf.plan.cluster import load_cluster
from jaxrlhf.plan.weight_sync import sync_price

REPO = pathlib.Path(__file__).resolve().parents[2]
GB = 10**9


@pytest.fixture(scope="module")
def h100():
    return load_cluster(str(REPO / "meshes/h100_16x8.py"))


def test_each_generator_host_receives_the_share_its_devices_hold(h100):
    train = CallChoice(DeviceRange(0, 63), fsdp=64)
    whole = sync_price(16 * GB, train, CallChoice(DeviceRange(64, 127), data=8, tensor=8), h100)
    # t8 inside a host: each of the 8 generator hosts holds the whole model; 8 x 50 GB/s per
    # host at the cluster's 0.7 efficiency, plus one inter-host latency.
    assert (whole.bytes_per_host, whole.gen_hosts, whole.train_hosts) == (16 * GB, 8, 8)
    assert whole.host_bandwidth == 400 * GB
    assert whole.seconds == pytest.approx(16 / (400 * 0.7) + 20e-6, rel=1e-12)
    # t16 spans two hosts: each holds half the model.
    half = sync_price(16 * GB, train, CallChoice(DeviceRange(64, 127), data=4, tensor=16), h100)
    assert half.bytes_per_host == 8 * GB and half.total_bytes == 64 * GB


def test_few_trainer_hosts_bound_the_senders_side(h100):
    """One trainer host sends what 8 generator hosts receive: the senders' time bounds it."""
    price = sync_price(16 * GB, CallChoice(DeviceRange(0, 7), fsdp=8),
                       CallChoice(DeviceRange(64, 127), data=8, tensor=8), h100)
    assert price.seconds == pytest.approx(8 * 16 / (400 * 0.7) + 20e-6, rel=1e-12)


def test_shared_devices_are_not_priced_here(h100):
    train = CallChoice(DeviceRange(0, 63), fsdp=64)
    assert sync_price(GB, train, CallChoice(DeviceRange(32, 95), data=8, tensor=8), h100) is None
