"""Routing replay in the dataflow graph: the experts a rollout recorded travel with its rows
from the generate call to the actor's and the reference's log-prob calls and the actor's train
step (`engine.replay` says why; docs/ARCHITECTURE.md, "Routing replay").

`models.actor.moe.replay_routing` (auto | on | off) becomes a `Routing` mode once, when the
spec is built: RECORD (the routes travel and `actor/routing_mismatch` measures what a fresh
forward would change; replay off), REPLAY (the calls use them), or NONE (a model without
experts, or a run that trains on other rows than it generates: offline batches,
oversampling). Asynchronous RL's rollout worker and multi-turn trajectories hand the routes
over with their rows.
"""

from __future__ import annotations

import dataclasses
import enum

from jaxrlhf.algorithms.spec import Algorithm
from jaxrlhf.mfc import MFC, Call, Role


class Routing(enum.Enum):
    """What a run does with the experts its rollout chose (module docstring)."""

    NONE = "none"
    RECORD = "record"
    REPLAY = "replay"


def routes_key(tokens_key: str) -> str:
    """The step-buffer key of the routes [b, s, L, k] of the sequences at `tokens_key`
    [b, s] ("seq_tokens_bs" -> "seq_routes_bslk")."""
    return tokens_key.replace("tokens", "routes") + "lk"


def is_routes_key(key: str) -> bool:
    return "routes" in key and key.endswith("lk")


def _reads_routes(mfc: MFC) -> bool:
    """The actor's and the reference's forwards over generated rows (their models are the
    actor's shapes: the recorded experts are theirs)."""
    return (not mfc.host and mfc.role in (Role.ACTOR, Role.REF)
            and mfc.call in (Call.INFERENCE, Call.TRAIN_STEP))


def with_recorded_routes(algorithm: Algorithm) -> Algorithm:
    """`algorithm` whose generate calls also output their rows' routes, read by every actor
    and reference call over those rows."""
    produced = {mfc.outputs[0]: routes_key(mfc.outputs[0]) for mfc in algorithm.mfcs
                if mfc.call is Call.GENERATE}

    def rewrite(mfc: MFC) -> MFC:
        if mfc.call is Call.GENERATE:
            return dataclasses.replace(mfc, outputs=(*mfc.outputs, produced[mfc.outputs[0]]))
        read = [produced[k] for k in mfc.inputs if k in produced] if _reads_routes(mfc) else []
        return dataclasses.replace(mfc, inputs=(*mfc.inputs, *read)) if read else mfc

    return dataclasses.replace(algorithm, mfcs=tuple(map(rewrite, algorithm.mfcs)))
