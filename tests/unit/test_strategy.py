"""Strategy grammar and sub-mesh carving."""

import dataclasses
import types

import jax
import pytest

from jaxrlhf.models.sizes import get_size
from jaxrlhf.parallel import make_layout
from jaxrlhf.parallel.strategy import Axis, DeviceRange, Strategy, parse_strategy
from jaxrlhf.parallel.submesh import (
    ClusterShape, check_submesh, cluster_devices, cluster_shape, group_by_host, legal_submeshes,
    mesh_devices,
)


@pytest.mark.parametrize(
    "spec, expected",
    [
        ("0-7:d2f2t2", Strategy(2, 2, 2, DeviceRange(0, 7))),
        ("t2d4", Strategy(data=4, tensor=2)),
        ("3:d1", Strategy(devices=DeviceRange(3, 3))),
        ("4-7:f4", Strategy(fsdp=4, devices=DeviceRange(4, 7))),
        (" 0-1 : T2 ", Strategy(tensor=2, devices=DeviceRange(0, 1))),
        ("d2p1", Strategy(data=2)),
        ("0-7:d2e4", Strategy(data=2, expert=4, devices=DeviceRange(0, 7))),
        ("e2t2", Strategy(expert=2, tensor=2)),
    ],
)
def test_parse(spec, expected):
    assert parse_strategy(spec) == expected


def test_canonical_string_round_trips():
    strategy = parse_strategy("0-7:t2f4")
    assert str(strategy) == "0-7:f4t2"
    assert parse_strategy(str(strategy)) == strategy
    assert strategy.mesh_shape == (1, 1, 4, 1, 2)  # (pipeline, data, fsdp, expert, tensor)
    assert strategy.dp_size == 4
    assert [strategy.size(a) for a in Axis] == [1, 4, 2, 1, 1]


def test_expert_axis_splits_the_batch():
    strategy = parse_strategy("0-7:t2e2d2")
    assert str(strategy) == "0-7:d2e2t2" and parse_strategy(str(strategy)) == strategy
    assert strategy.mesh_shape == (1, 2, 1, 2, 2)  # (pipeline, data, fsdp, expert, tensor)
    assert strategy.size(Axis.EXPERT) == 2 and strategy.num_devices == 8
    assert strategy.dp_size == 4  # attention and dense layers see e as data


@pytest.mark.parametrize(
    "spec, message",
    [
        ("d2x2", "unknown axis letter 'x' in strategy 'd2x2'"),
        ("d2d2", "axis letter 'd' repeated in strategy 'd2d2'"),
        ("d0", "size of 'd' must be at least 1"),
        ("dt2", "missing size after 'd'"),
        ("t", "missing size after 't'"),
        ("", "names no parallel axes"),
        ("0-7:", "names no parallel axes"),
        ("0-3:d2p4", "uses 8 devices but range 0-3 has 4"),
        ("7-0:d8", "device range 7-0 is reversed"),
        ("0-7:d4", "uses 4 devices but range 0-7 has 8"),
        ("2:t2", "uses 2 devices but range 2 has 1"),
        ("d2$", "unexpected character '$'"),
        ("0-:d2", "expected an integer for device range end"),
        ("2t2", "expected an axis letter, got '2'"),
        ("0-1t2", "expected an axis letter, got '0'"),
        ("0-1-2:d2", "expected ':' after device range"),
    ],
)
def test_grammar_errors(spec, message):
    with pytest.raises(ValueError) as info:
        parse_strategy(spec)
    assert message in str(info.value)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(
    "spec, model_overrides, message",
    [
        ("0-15:d16", None, "device range 0-15 is out of bounds for 8 devices"),
        ("t2", None, "uses 2 devices but 8 are given; add a device range such as '0-1:t2'"),
        ("1-2:t2", None, "device range 1-2 is not aligned"),
        ("0-5:d6", None, "has 6 devices; a sub-mesh inside a host must have a power-of-two"),
        ("0-3:t4", {}, "tensor=4 does not divide the model's num_kv_heads=2"),
        ("0-7:t8", {"num_kv_heads": 4}, "tensor=8 does not divide the model's num_heads=4"),
        ("0-1:e2", {}, "strategy 0-1:e2 has expert=2 but the model is dense (no experts to "
                       "split); use d2 instead"),
        ("0-7:d2e2t2", {"num_kv_heads": 4}, "0-7:d2e2t2 has expert=2 but the model is dense "
                                            "(no experts to split); use d4t2 instead"),
        ("0-7:e8", {"size": "tiny-moe", "num_experts": 4},
         "expert=8 does not divide the model's num_experts=4"),
    ],
)
def test_layout_errors(spec, model_overrides, message):
    model = None if model_overrides is None else _model(**model_overrides)
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        make_layout(spec, model=model)


def _model(size="tiny", num_experts=None, **overrides):
    model = get_size(size, **overrides)
    if num_experts is not None:
        model = dataclasses.replace(model, moe=model.moe.replace(num_experts=num_experts))
    return model


def _fake_devices(num_hosts, per_host):
    # Only `id` and `process_index` are read by the grouping code; real multi-host devices
    # cannot exist in a single-process test.
    return [
        types.SimpleNamespace(id=h * per_host + i, process_index=h)
        for h in reversed(range(num_hosts)) for i in reversed(range(per_host))
    ]


def test_group_by_host_orders_hosts_then_ids():
    devices = _fake_devices(2, 4)
    hosts = group_by_host(devices)
    assert [[d.id for d in host] for host in hosts] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert cluster_shape(devices) == ClusterShape(num_hosts=2, devices_per_host=4)
    with pytest.raises(ValueError, match="unequal device counts"):
        cluster_shape(devices[:-1])


@pytest.mark.parametrize("cluster", [ClusterShape(1, 8), ClusterShape(2, 8), ClusterShape(4, 4)])
def test_legal_submeshes_match_rule(cluster):
    def legal(r):
        try:
            check_submesh(cluster, r)
            return True
        except ValueError:
            return False

    brute = {
        DeviceRange(a, b) for a in range(cluster.num_devices)
        for b in range(a, cluster.num_devices) if legal(DeviceRange(a, b))
    }
    found = legal_submeshes(cluster)
    assert len(found) == len(set(found))
    assert set(found) == brute


def test_legal_submesh_counts():
    # In-host: 8 singles + 4 pairs + 2 quads per host; then whole-host runs.
    assert len(legal_submeshes(ClusterShape(1, 8))) == 8 + 4 + 2 + 1
    assert len(legal_submeshes(ClusterShape(2, 8))) == 16 + 8 + 4 + (2 + 1)


@pytest.mark.parametrize(
    "cluster, devices, message",
    [
        (ClusterShape(2, 8), DeviceRange(4, 15), "spans more than one host"),
        (ClusterShape(2, 8), DeviceRange(4, 11), "is not aligned"),
        (ClusterShape(2, 8), DeviceRange(8, 23), "out of bounds for 16 devices"),
        (ClusterShape(1, 8), DeviceRange(2, 5), "is not aligned"),
        (ClusterShape(1, 8), DeviceRange(0, 2), "power-of-two size dividing 8"),
    ],
)
def test_check_submesh_errors(cluster, devices, message):
    with pytest.raises(ValueError, match=message):
        check_submesh(cluster, devices)


def test_mesh_devices_order():
    devices = cluster_devices()
    subset = mesh_devices(devices, DeviceRange(4, 7), (1, 2, 2))
    assert [d.id for d in subset.flat] == [4, 5, 6, 7]
    full = mesh_devices(devices, DeviceRange(0, 7), (2, 2, 2))
    assert full.shape == (2, 2, 2)
    assert sorted(d.id for d in full.flat) == list(range(8))
    assert cluster_devices() == sorted(jax.devices(), key=lambda d: d.id)
