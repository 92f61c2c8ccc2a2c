"""Graph validation, placement resolution and scheduler dispatch order."""

import dataclasses

import pytest

from jaxrlhf.dataflow.graph import MFC, Call, GraphError, Role, build_graph
from jaxrlhf.dataflow.placement import Placement, PlacementError, resolve_placement
from jaxrlhf.parallel.strategy import parse_strategy

R, C = Role, Call


def _resolved(graph, kind, n, **kw) -> dict[str, str]:
    """resolve_placement's strategies, written as the grammar writes them."""
    return {name: str(s) for name, s in resolve_placement(graph, kind, n, **kw).items()}


def ppo_like():
    return [
        MFC("actor_gen", R.ACTOR, C.GENERATE, ("prompts",), ("seq", "logp")),
        MFC("reward", R.REWARD, C.INFERENCE, ("seq", "answer"), ("rewards",), host=True),
        MFC("ref_inf", R.REF, C.INFERENCE, ("seq",), ("ref_logp",)),
        MFC("critic_inf", R.CRITIC, C.INFERENCE, ("seq",), ("values",)),
        MFC("actor_train", R.ACTOR, C.TRAIN_STEP, ("seq", "logp", "ref_logp", "rewards", "values")),
        MFC("critic_train", R.CRITIC, C.TRAIN_STEP, ("seq", "rewards", "values")),
    ]


def test_graph_order_dataset_keys_and_version_edges():
    g = build_graph(ppo_like())
    assert g.order[0] == "actor_gen"
    assert set(g.dataset_keys) == {"prompts", "answer"}
    assert ("actor_train", "actor_gen") in g.parameter_version_edges()
    assert ("critic_train", "critic_inf") in g.parameter_version_edges()
    assert not any(e[1] == "ref_inf" for e in g.parameter_version_edges())


@pytest.mark.parametrize("mfcs, message", [
    ([MFC("a", R.ACTOR, C.GENERATE, ("p",), ("x",)), MFC("b", R.REF, C.INFERENCE, ("x",), ("x",))],
     "key 'x' is produced by both 'a' and 'b'"),
    ([MFC("a", R.ACTOR, C.GENERATE, ("y",), ("x",)), MFC("b", R.REF, C.INFERENCE, ("x",), ("y",))],
     "cycle"),
    ([MFC("a", R.ACTOR, C.GENERATE, ("p",), ("x",)), MFC("a", R.REF, C.INFERENCE, ("x",), ("y",))],
     "two MFCs are named 'a'"),
    ([MFC("a", R.COST, C.INFERENCE, ("p",), ("x",))], "does not define"),
])
def test_graph_errors(mfcs, message):
    with pytest.raises(GraphError, match=message):
        build_graph(mfcs, roles={R.ACTOR, R.REF})


def test_placements_cover_every_model_mfc():
    g = build_graph(ppo_like())
    split = _resolved(g, Placement.SPLIT, 8)
    assert split["actor_gen"] == "0-3:d4" and split["critic_inf"] == "4-7:d4"
    assert "reward" not in split  # host MFC
    inter = _resolved(g, Placement.INTERLEAVE, 8)
    assert inter["ref_inf"] == "0-3:d4" and inter["actor_train"] == "0-7:d8"
    colo = _resolved(g, Placement.COLOCATE, 8, strategy="d2f2t2")
    assert set(colo.values()) == {"0-7:d2f2t2"}
    alone = _resolved(g, Placement.STANDALONE, 8)
    assert alone["actor_gen"] == "0-3:d4" and alone["critic_train"] == "4-5:d2"
    assert alone["ref_inf"] == "6-7:d2"


def test_standalone_leaves_a_device_for_every_model():
    """Four models on four devices (ppo with a reward model on the 4 chips of a v5p-8):
    halving would give the actor two and the reward model none."""
    mfcs = [dataclasses.replace(m, host=False) if m.name == "reward" else m for m in ppo_like()]
    alone = _resolved(build_graph(mfcs), Placement.STANDALONE, 4)
    assert alone == {"actor_gen": "0:d1", "reward": "3:d1", "ref_inf": "2:d1",
                     "critic_inf": "1:d1", "actor_train": "0:d1", "critic_train": "1:d1"}


def test_manual_placement_errors_name_the_mfc():
    g = build_graph(ppo_like())
    with pytest.raises(PlacementError, match=r"no layout for MFC\(s\) \['critic_inf'"):
        resolve_placement(g, Placement.MANUAL, 8, allocation={
            name: parse_strategy(text) for name, text in
            {"actor_gen": "0-7:d8", "ref_inf": "0-3:d4", "actor_train": "0-7:d8"}.items()})
    with pytest.raises(PlacementError, match="unknown MFCs: \\['nope'\\]"):
        resolve_placement(g, Placement.MANUAL, 8, allocation={"nope": parse_strategy("0-7:d8")})
