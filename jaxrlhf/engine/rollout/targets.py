"""Where a fill's rows go, planned on the host: each distinct prompt prefilled once (a GRPO
group's n rows share its prefill), on one device, and its rows written into their target slots
on their own devices; the row moves of a compaction (module `engine.routes`). Powers of two
keep the shapes, and so the compiles, few.
"""

from __future__ import annotations

import numpy as np

from jaxrlhf.engine import routes
from jaxrlhf.engine.rollout.state import INTS
from jaxrlhf.parallel.layout import Layout


def pow2(n: int) -> int:
    return 1 << (max(int(n), 1) - 1).bit_length()


def _rank(sorted_x: np.ndarray) -> np.ndarray:
    """Each entry's rank among the equal ones before it (`sorted_x` sorted)."""
    return np.arange(len(sorted_x)) - np.searchsorted(sorted_x, sorted_x)


def _by_device(ints_k5: np.ndarray, device_k: np.ndarray, per_device: int, dp: int
               ) -> tuple[np.ndarray, np.ndarray, int]:
    """A fill's k targets dealt to their slots' devices: (ints int32 [dp * m, 5], device i's m
    targets in rows [i * m, (i + 1) * m) with their own slot indices, padding aimed at local
    slot `per_device`, out of range (its writes are dropped); at_k: each target's row in it;
    m, a power of two: few compiles)."""
    m = pow2(np.bincount(device_k, minlength=dp).max())
    ints = np.zeros((dp * m, len(INTS)), np.int32)
    ints[:, INTS.slot] = per_device
    order = np.argsort(device_k, kind="stable")
    at_k = np.empty(len(device_k), np.int64)
    at_k[order] = device_k[order] * m + _rank(device_k[order])
    ints[at_k] = ints_k5
    ints[at_k, INTS.slot] -= device_k * per_device
    return ints, at_k, m


def _homes(device_k: np.ndarray, src_k: np.ndarray, prompts: int, dp: int, room: int
           ) -> np.ndarray:
    """Where each of `prompts` distinct prompts is prefilled (an SPMD fill's k targets on
    devices `device_k`, of prompts `src_k`), at most `room` on a device: on one of its targets'
    devices where one has room, so that its rows move to its other targets' devices only (none
    where all lie on one), the one that prefills the fewest so far (a GRPO group's rows take
    turns over the devices, `Rollout.spread`); else on the device that prefills the fewest."""
    pairs = np.unique(src_k * dp + device_k)  # distinct (prompt, device), in order of prompt
    prompt_v, device_v = pairs // dp, pairs % dp
    first_g = np.searchsorted(prompt_v, np.arange(prompts))
    spans_g = np.diff(np.append(first_g, len(pairs)))
    home_g = device_v[first_g]
    # A prompt whose targets lie on one device goes there while it has room (all of them, in
    # a PPO fill, whose targets take turns over the devices); the others in turn.
    alone = spans_g == 1
    order = np.argsort(home_g[alone], kind="stable")
    rank_a = np.empty(int(alone.sum()), np.int64)
    rank_a[order] = _rank(home_g[alone][order])
    placed = np.flatnonzero(alone)[rank_a < room]
    load = np.bincount(home_g[placed], minlength=dp)
    for g in np.setdiff1d(np.arange(prompts), placed):
        options = device_v[first_g[g]:first_g[g] + spans_g[g]]
        options = options[load[options] < room]
        pool = options if len(options) else np.arange(dp)
        home_g[g] = pool[np.argmin(load[pool])]
        load[home_g[g]] += 1
    return home_g


def distinct_prompts(tokens_kp: np.ndarray, mask_kp: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(first_u: the index of each distinct prompt's first row, src_k: each row's distinct
    prompt) of k left-padded prompts [k, P]: rows with equal tokens and mask share a prefill."""
    key_kp = np.where(mask_kp, np.asarray(tokens_kp, np.int64) + 1, 0)
    _, first_u, src_k = np.unique(key_kp, axis=0, return_index=True, return_inverse=True)
    return first_u, src_k.reshape(-1)




def spmd(layout: Layout, slots: int, ints_k5: np.ndarray, prompts_k2p: np.ndarray):
    """`fill`'s inputs for one SPMD program: ((ints [dp * m, 5], the routes' send_dq),
    prompts [dp * u, 2, P], their shardings, their compile-key part). Each distinct prompt
    is prefilled once, on one of its targets' devices (`_homes`), and its rows go to its
    other targets' devices (`Rollout._routed_writes`); each device takes its own m targets
    (`_by_device`), whose src is the row of their prompt among its own and received ones.
    u, m and the routes' width are powers of two: few compiles.
    """
    dp = layout.dp_size
    per_device = slots // dp
    device_k = ints_k5[:, INTS.slot] // per_device
    first_g, src_k = distinct_prompts(prompts_k2p[:, 0], prompts_k2p[:, 1])
    # As many prompts on each device as dealing them out evenly would put there: the
    # prefill's shapes (and so its numbers) are the same wherever a prompt goes.
    u = pow2(-(-len(first_g) // dp))
    home_g = _homes(device_k, src_k, len(first_g), dp, u)
    order = np.argsort(home_g, kind="stable")
    place_g = np.empty(len(first_g), np.int64)  # its row on its device
    place_g[order] = _rank(home_g[order])
    pick_u = np.zeros(dp * u, np.int64)  # distinct prompt -> input row (padding: row 0)
    pick_u[home_g * u + place_g] = first_g
    moves = routes.plan(home_g[src_k], place_g[src_k], device_k, u, dp)
    ints, at_k, m = _by_device(ints_k5, device_k, per_device, dp)
    ints[at_k, INTS.src] = moves.at_j
    rows = layout.batch_sharding(2)
    return ((ints, moves.send_dq), prompts_k2p[pick_u],
            ((rows, rows), layout.batch_sharding(3)), (u, m, moves.width))

def on_each_device(layout: Layout, slots: int, ints_k5: np.ndarray, prompts_k2p: np.ndarray):
    """`spmd`'s parts with each prompt prefilled on its slot's own device
    (`shard_map`), so that no rows move (ints [dp * m, 5], without routes).

    Why: SPMD, the prompts lie spread over the devices whatever slots they go to, so the
    fill gathered them (five all-gathers per call) for the slot writes.

    Each device takes m targets and prefills its u distinct prompts (powers of two: few
    compiles), padding targets aimed at a local slot out of range, whose writes are
    dropped.
    """
    dp = layout.dp_size
    per_device = slots // dp
    device_k = ints_k5[:, INTS.slot] // per_device
    # Each device's distinct prompts: the distinct (device, prompt) pairs, found with one
    # search over all rows (not one per device), in order of device.
    first_g, src_k = distinct_prompts(prompts_k2p[:, 0], prompts_k2p[:, 1])
    pairs, first_q, local_k = np.unique(device_k * len(first_g) + src_k, return_index=True,
                                        return_inverse=True)
    pair_device_q = pairs // len(first_g)
    local_k = local_k.reshape(-1) - np.searchsorted(pair_device_q, device_k)
    u = pow2(np.bincount(pair_device_q, minlength=dp).max())
    ints, at_k, m = _by_device(ints_k5, device_k, per_device, dp)
    ints[at_k, INTS.src] = local_k
    pick_u = np.zeros(dp * u, np.int64)  # distinct prompt -> input row
    pick_u[pair_device_q * u + _rank(pair_device_q)] = first_q
    shardings = layout.batch_sharding(2), layout.batch_sharding(3)
    return ints, prompts_k2p[pick_u], shardings, (u, m)



def send_width(own: int, dp: int) -> int:
    """Rows a device of `own` slots sends each other device when a compaction moves rows
    dealt out in `spread`'s order (`spread_moves`): at most ceil(own / dp) + 1, a power of
    two, at most `own`; none with one data-parallel device."""
    return 0 if dp == 1 else min(pow2(-(-own // dp) + 1), own)


def spread_moves(layout: Layout, slots: int, size: int) -> routes.Routes:
    """Row moves (their shapes: the indices are zeros) as wide as compacting a state of
    `slots` into `size` can need when the kept rows are dealt out in `spread`'s order, as
    `generate.decode_rows` does (`lowered_programs`): each device's kept rows, live and
    not, are two runs of that order, which deals rows to the devices in turn, so a device
    sends another at most ceil(slots / dp / dp) + 1 rows."""
    dp = layout.dp_size
    width = send_width(slots // dp, dp)
    return routes.Routes(np.zeros((dp, dp * width), np.int32), np.zeros(size, np.int32),
                         width)

