"""The rollout engine: rows decoded in slots, each at its own position, refilled as rows finish,
compacted as they thin out, over a KV cache sized to what the live rows can reach.

Every generation runs here: the synchronous `generate` call kind (jaxrlhf/engine/generate.py:
`decode_rows`, or `decode_at_once`), the asynchronous rollout workers
(jaxrlhf/run/rollout_worker.py) and multi-turn trajectories (jaxrlhf/dataflow/trajectories.py),
each handing its rows to the one scheduler (`scheduler.Scheduler`) as `Request`s. The engine
keeps S rows ("slots") on the device, each at its own response position, and offers (to the
scheduler alone, `tests/test_layers.py`):

  empty(slots, capacity)                      every slot free
  fill(state, params, version, slots, rows)   prefills prompts into free slots (each distinct
                                              prompt once: a GRPO group's n rows share its
                                              prefill) and samples their first tokens
  advance(state, params, version, k, longest) up to k more tokens in every busy slot
  compact(state, keep)                        the slots `keep` only, as a smaller state
  poll(state) / rows(state)                   which slots are done / every slot's row (host)
  reload(state, params, longest)              every cache recomputed under new weights
  abort(state, slots)                         the rows of `slots` dropped (their slots free)
  decode_at_once(params, version, rows, ...)  a batch that fits in the slots and ends within
                                              a chunk: fill, token loop and read-out in one
                                              executable (no host look in between)

The package's modules: `state` (the slot state `SlotState`, what the host reads of it, the
cache's capacity buckets), `programs` (the device programs over a state, pure functions),
`targets` (where a fill's prompts are prefilled and its rows go, planned on the host), `engine`
(the `Rollout` class: compiles, places and runs the programs), `scheduler` (requests served in
the slots: fill, chunk, look, read-out, compaction, reload on new weights, continuations).

Slot s's response token i sits in cache slot P + i of row s; a decode step writes each row at
its own slot and attends causally from there, so a refilled slot never sees its predecessor's
keys (they lie after its own position until it overwrites them).

Why the cache has a capacity: a decode step's XLA products read the whole cache array, a
static shape (on XLA:CPU the C++ kernel reads each row only up to its slot,
`kernels/cpu_decode_attention.py`; there the capacity bounds memory and copies). The state's
cache holds P + C slots, C a bucket (`capacity_buckets`: two per octave) just above
what the busy rows reach in the next `advance`; `advance` grows it (or shrinks it, when long
rows have left) before decoding, one copy each time; the synchronous call ends a chunk where
the busy rows outgrow that bucket (`chunk_steps`), rather than read a larger cache for the
whole chunk. A step then reads at most ~1.5x the live slots, and the engine compiles one
`advance` per (slots, capacity) bucket. On XLA:CPU each layer keeps its own cache laid out for one-query attention (`models.decode_kv.DecodeKV`,
`engine.decode_layers`); elsewhere the stacked [L, S, P + C, k, d] cache is written by scatter.

New weights recompute every slot's cache from its prompt and response so far (`reload`, an
"interruption") before `advance` decodes with them: keys and values of the old policy must not
be mixed with the new one's. Whether a busy row goes on so, restarts (`abort`, then a fill) or
finishes under its old weights is the scheduler's choice (`scheduler.OnNewVersion`). Every
sampled token records the policy version whose logits it was drawn from, so a sequence's
versions can change part-way.

Sampling keys are the synchronous `generate` call's: a row with key `rng` and index r in its
(micro-)batch samples token i with fold_in(fold_in(rng, i), r), whatever slot it sits in and
whenever it starts, so the engine computes what one static-batch `generate` call computes.
"""

from jaxrlhf.engine.rollout.engine import Rollout
from jaxrlhf.engine.rollout.state import (
    NO_VERSION, Rows, SlotState, Vacant, capacity_buckets, capacity_for,
)
from jaxrlhf.engine.rollout.targets import distinct_prompts

__all__ = ["NO_VERSION", "Rollout", "Rows", "SlotState", "Vacant", "capacity_buckets",
           "capacity_for", "distinct_prompts"]
