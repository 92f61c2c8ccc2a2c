"""The `Rollout` engine of one model on one layout: its slot states (module
`engine.rollout.state`) transformed by the device programs (module `engine.rollout.programs`),
each compiled once per shape bucket and counted in a compile cache. The package docstring
describes the engine; the scheduler (module `engine.rollout.scheduler`) drives it.
"""

from __future__ import annotations

import collections
import functools

import flax.linen as nn
import jax
import numpy as np
from jax.sharding import PartitionSpec

from jaxrlhf.engine import routes
from jaxrlhf.engine.buckets import CompileCache
from jaxrlhf.engine.call import abstract
from jaxrlhf.engine.decode_layers import LayerByLayer
from jaxrlhf.engine.decoding import CACHE_AXES, DECODE_AXES, GenerateConfig, decode_model
from jaxrlhf.engine.rollout import programs, targets
from jaxrlhf.engine.rollout.state import (
    INTS, Rows, SlotState, Vacant, cache_len, capacity_for, empty_state, read_poll, read_rows,
    ring_holds_all, zeros_stacked,
)
from jaxrlhf.models.config import HeadKind, ModelConfig
from jaxrlhf.models.mixed_cache import MixedKVCache
from jaxrlhf.models.transformer import DecodeKV, KVCache, Transformer, decode_lengths
from jaxrlhf.parallel.layout import Layout, check_batch_divisible
from jaxrlhf.parallel.pipeline import Pipeline
from jaxrlhf.parallel.reshard import fetch, transfer

_REPLICATED = PartitionSpec()


class Rollout:
    """The rollout engine of one model on one layout (the package docstring).

    Args:
      model_config: an LM-head model.
      gen_config: sampling settings (as for `make_generate_fn`).
      layout: where generation runs; not a pipeline (its stages decode all rows at one slot).
      prompt_len: the (bucketed) prompt length P every prompt is padded to.
      slots: rows decoded at once by default (a multiple of the layout's data-parallel size);
        `empty` and `compact` make states of other sizes.
      compile_cache: where its executables are kept and counted (default: its own).
    """

    def __init__(self, model_config: ModelConfig, gen_config: GenerateConfig, layout: Layout,
                 prompt_len: int, slots: int, compile_cache: CompileCache | None = None):
        if model_config.head is not HeadKind.LM:
            raise ValueError(f"generate needs an LM head, got {model_config.head}")
        self.model = decode_model(model_config, layout)  # as Generator's
        if isinstance(self.model.layer_stack, Pipeline):
            raise ValueError(f"the rollout engine decodes each row at its own position, which a "
                             f"pipelined layout ({layout}) cannot: give actor_gen a layout "
                             "without pipeline stages")
        check_batch_divisible(layout, slots, "rollout slots")
        self.cfg, self.layout = gen_config, layout
        self.prompt_len, self.slots = prompt_len, slots
        self.by_layer = isinstance(self.model.layer_stack, LayerByLayer)
        # Prompts (a fill, a reload) run many tokens through each layer once: the scanned stack
        # slices one layer's weights at a time, where layer by layer holds a copy of them all
        # (worth it only inside the token loop, `engine.decode_layers`).
        self.prefill_model = (Transformer(model_config.replace(scan_layers=True))
                              if self.by_layer else self.model)
        self.compile_cache = CompileCache("rollout") if compile_cache is None else compile_cache
        self._scalar = layout.replicated()
        self._scalars: dict[int, jax.Array] = {}
        # Each data-parallel device can decode its own slots alone when it holds all weights
        # (then each stops a chunk on its own: see `advance`'s stop_busy). An expert rank
        # holds 1/e of the experts and its tokens meet them by all-to-all, every device in
        # every step (models/expert_parallel.py): SPMD.
        strategy = layout.strategy
        self.per_device = strategy.fsdp == 1 and strategy.tensor == 1 and strategy.expert == 1
        self._rows = jax.jit(functools.partial(read_rows, gen_config))
        self._poll = jax.jit(read_poll)
        self._collect = jax.jit(lambda s: (read_poll(s), read_rows(gen_config, s)))

    @property
    def compiles(self) -> int:
        return self.compile_cache.compiles

    def size(self, state: SlotState | Vacant) -> tuple[int, int]:
        """(slots S, cache capacity C) of a state."""
        if isinstance(state, Vacant):
            return state.slots, state.capacity
        return (state.step_b.shape[0],
                cache_len(self.model.config, state) - state.prompt_tokens_bp.shape[1])

    def _shardings(self, slots: int, capacity: int) -> SlotState:
        """Out-shardings of a state: rows over the data axes, the cache as generate's."""
        lay, c = self.layout, self.model.config
        length = self.prompt_len + capacity
        if self.by_layer:
            cache = tuple(
                DecodeKV(*(lay.sharding(axes, shape) for axes, shape in zip(
                    DECODE_AXES, DecodeKV.shapes(slots, c.num_kv_heads, c.head_dim, n))))
                for n in decode_lengths(c, length))
        else:
            cache = jax.tree.map(lambda x: lay.sharding(CACHE_AXES, x.shape),
                                 jax.eval_shape(functools.partial(zeros_stacked, c, slots, length)))
        rows1, rows2 = lay.batch_sharding(1), lay.batch_sharding(2)
        routes = None if c.moe is None else lay.batch_sharding(4)
        return SlotState(rows1, rows2, rows1, rows1, cache, rows2, rows2, rows2,
                         rows2, rows2, rows2, rows1, rows1, rows1, rows1, rows1, routes)

    def _run(self, key: tuple, build, *args, donate: tuple[int, ...] = ()):
        """Runs the executable of `key`, compiled on its first use from `build()` -> (fn, its
        out-shardings) under the layout's context; the arguments `donate` (the state: it is
        replaced by the result) lend their buffers to the result.

        Why `build` is a thunk: a call that hits the cache (every call after warm-up) then
        makes no jit wrapper, shard_map or shardings (~1 ms of host time per call on the main
        job's shape)."""
        lower = lambda: self._lower(build, *args, donate=donate)
        # The prompt length in the key: a Generator's engines share its compile cache.
        return self.compile_cache.get((self.prompt_len, *key), lower)(*args)

    def _lower(self, build, *args, donate: tuple[int, ...] = ()) -> jax.stages.Lowered:
        """`build()`'s function lowered for `args` (arrays or abstract values) under the
        layout's context."""
        with self.layout.activation_context():
            fn, out_shardings = build()
            jitted = jax.jit(fn, out_shardings=out_shardings, donate_argnums=donate)
            return jitted.lower(*args)

    def _state_out(self, fn, slots: int, capacity: int):
        """`_run`'s build of `fn`, whose result is a state of (slots, capacity)."""
        return lambda: (fn, self._shardings(slots, capacity))

    def _scalar_on_devices(self, value: int) -> jax.Array:
        """An int32 scalar on every device, uploaded once per value (a version, a step
        count): each call would otherwise upload it again."""
        if value not in self._scalars:
            if len(self._scalars) >= 64:  # a worker's versions keep counting up
                self._scalars.clear()
            self._scalars[value] = transfer(np.int32(value), self._scalar)
        return self._scalars[value]

    def empty(self, slots: int | None = None, capacity: int | None = None) -> SlotState:
        """Every slot free: `slots` (default the engine's) rows with a cache of `capacity`
        response slots (default the smallest bucket)."""
        vacant = self.vacant(slots, capacity)
        return self._run(("empty", *vacant),
                         self._state_out(self._empty_fn(vacant, local=False), *vacant))

    def vacant(self, slots: int | None = None, capacity: int | None = None) -> Vacant:
        """`empty`'s state, not built until the first `fill` builds it in its own executable."""
        slots = self.slots if slots is None else slots
        check_batch_divisible(self.layout, slots, "rollout slots")
        capacity = capacity_for(1, self.cfg.max_new_tokens) if capacity is None else capacity
        return Vacant(slots, capacity)

    def _empty_fn(self, vacant: Vacant, local: bool):
        """`empty_state` of `vacant`'s size (`local`: each data-parallel device's own slots)."""
        slots = vacant.slots // self.layout.dp_size if local else vacant.slots
        return functools.partial(empty_state, self.model.config, self.by_layer, self.cfg, slots,
                                 self.prompt_len, vacant.capacity)

    def fill(self, state: SlotState | Vacant, params, version: int, slots_k, prompt_tokens_kp,
             prompt_mask_kp, keys, rows_k, limits_k=None) -> SlotState:
        """Prefills k left-padded prompts [k, P] into free slots `slots_k` under `params` (of
        policy `version`) and samples their first tokens; equal prompts are prefilled once.

        Args:
          state: the slots, or a `Vacant` one (built by this fill).
          slots_k: int [k] free slots.
          prompt_tokens_kp, prompt_mask_kp: [k, P] host arrays.
          keys: k PRNG keys on the layout's devices (replicated): each row's (micro-)batch key.
          rows_k: int [k] each row's index in its (micro-)batch.
          limits_k: int [k] the most response tokens of each row (default N: up to EOS).
        """
        key, build, args, donate = self._fill_program(state, params, version, slots_k,
                                                      prompt_tokens_kp, prompt_mask_kp, keys,
                                                      rows_k, limits_k)
        return self._run(key, build, *args, donate=donate)

    def _fill_program(self, state, params, version: int, slots_k, prompt_tokens_kp,
                      prompt_mask_kp, keys, rows_k, limits_k, put=transfer, scalar=None):
        """`fill`'s (compile key, build, arguments, donated ones), its inputs placed by `put`
        and its scalars made by `scalar` (as `_at_once_program`)."""
        scalar = scalar or self._scalar_on_devices
        slots, capacity = self.size(state)
        ints, prompts, table, specs, compile_key = self._fill_inputs(
            slots, slots_k, prompt_tokens_kp, prompt_mask_kp, keys, rows_k, limits_k, put)
        vacant = isinstance(state, Vacant)

        def build():
            fn = functools.partial(programs.fill, self.prefill_model, self.cfg,
                                   self._empty_fn(state, self.per_device) if vacant else None,
                                   self._writes())
            if vacant:  # no state argument: the fill builds it
                fn = functools.partial(programs.without_state, fn)
            if self.per_device:
                state_specs = self._state_specs(slots, capacity)
                fn = self._on_each_device(
                    fn, (_REPLICATED, *(() if vacant else (state_specs,)), *specs, _REPLICATED,
                         _REPLICATED), state_specs)
            return fn, self._shardings(slots, capacity)

        state_args = () if vacant else (state,)
        return (("fill", vacant, slots, capacity, *compile_key, len(table)), build,
                (params, *state_args, ints, prompts, table, scalar(version)),
                () if vacant else (1,))

    def _fill_inputs(self, slots: int, slots_k, prompt_tokens_kp, prompt_mask_kp, keys, rows_k,
                     limits_k, put=transfer):
        """A fill's device inputs (`fill`'s arguments): (ints, prompts, the key table, the
        partition specs of ints and prompts, their compile-key part), placed by `put`
        (`transfer`; `engine.call.abstract` to lower with nothing placed)."""
        k, prompt_len = np.shape(prompt_tokens_kp)
        if prompt_len != self.prompt_len:
            raise ValueError(f"rollout prompts must be padded to {self.prompt_len}, got "
                             f"{prompt_len}")
        prompts_k2p = np.stack([np.asarray(prompt_tokens_kp, np.int32),
                                np.asarray(prompt_mask_kp, np.int32)], axis=1)
        n_max = self.cfg.max_new_tokens
        limits_k = np.full(k, n_max, np.int32) if limits_k is None else np.minimum(
            np.asarray(limits_k, np.int32), n_max)
        # The rows' keys as indices into a table of the distinct ones (a synchronous call has
        # one, a worker one per batch), stacked on the device: no key per row on the host.
        distinct = {id(key): key for key in keys}
        where = {ident: i for i, ident in enumerate(distinct)}
        table = list(distinct.values())
        table = tuple(table + table[-1:] * (targets.pow2(len(table)) - len(table)))
        ints_k5 = np.zeros((k, len(INTS)), np.int32)
        ints_k5[:, INTS.slot] = slots_k
        ints_k5[:, INTS.key] = [where[id(key)] for key in keys]
        ints_k5[:, INTS.row] = rows_k
        ints_k5[:, INTS.limit] = limits_k
        place = targets.on_each_device if self.per_device else targets.spmd
        ints, prompts, shardings, compile_key = place(self.layout, slots, ints_k5, prompts_k2p)
        ints, prompts, table = put((ints, prompts, table),
                                   (*shardings, (self._scalar,) * len(table)))
        specs = jax.tree.map(lambda sharding: sharding.spec, shardings)
        return ints, prompts, table, specs, compile_key

    def _writes(self):
        """`programs.fill`'s `write` on this layout."""
        if self.per_device:  # the whole fill runs on each device
            return functools.partial(programs.write_targets, self.cfg)
        return self._routed_writes

    def _routed_writes(self, s: SlotState, ints, tokens_up, mask_up, logits_uv,
                       new: KVCache | MixedKVCache, keys, routes_uplk=None) -> SlotState:
        """`programs.write_targets` of an SPMD fill on each device (shard_map): its own
        targets, from its own prompts' rows and those the other devices sent it (`ints`: the
        targets and the routes' send_dq, as `targets.spmd` made them).

        Why: as one SPMD program, the writes' indices (the same on every device) gave every
        device every prompt's prefilled cache (each device's rows added up over the data axes,
        module `engine.routes`): 70B on v5p d16t4, 21.6 GB of temporaries per chip for a fill,
        1.5 GB here.
        """
        lay, axes = self.layout, routes.data_axes(self.layout)
        rows = lambda x: lay.batch_sharding(x.ndim).spec
        # The logits stay split over the vocabulary as the model made them: the sampling after
        # the writes then reduces over the vocabulary as it did when the writes were SPMD (the
        # same log-probs to the bit), and no device holds a whole vocabulary before it must.
        vocab = lambda x: lay.spec(("batch", "act_vocab"), x.shape)
        state_specs = self._state_specs(*self.size(s))._replace(logits_bv=vocab(s.logits_bv))

        def local(s, ints, tokens_up, mask_up, logits_uv, new, keys, *routes_uplk):
            ints_k5, send_1q = ints
            take = functools.partial(routes.take, send_q=send_1q[0], axes=axes)
            return programs.write_targets(self.cfg, s, ints_k5, tokens_up, mask_up, logits_uv,
                                          new, keys, *(routes_uplk or (None,)), take=take)

        recorded = () if routes_uplk is None else (routes_uplk,)  # a model with experts
        in_specs = (state_specs, tuple(map(rows, ints)), rows(tokens_up), rows(mask_up),
                    vocab(logits_uv), jax.tree.map(lambda x: lay.spec(CACHE_AXES, x.shape), new),
                    _REPLICATED, *map(rows, recorded))
        return self._on_each_device(local, in_specs, state_specs)(
            s, ints, tokens_up, mask_up, logits_uv, new, keys, *recorded)

    def decode_at_once(self, params, version: int, prompt_tokens_kp, prompt_mask_kp, keys,
                       rows_k, limits_k, finish):
        """Every row decoded to its end in one executable, row i in slot i: the fill, the token
        loop and `finish` of the final state, with no look from the host in between.

        For a batch that fits in the slots and ends within one chunk of tokens (the main job's
        shape): `fill`, `advance` and `collect` would run the same steps with two more
        dispatches, a sync on the host, and the rows fetched to the host and back.

        Args:
          prompt_tokens_kp, prompt_mask_kp, keys, rows_k, limits_k: as `fill`'s, for k rows (a
            multiple of the data-parallel size); the cache holds the longest limit.
          finish: `f(state) -> pytree` of arrays [k, ...] (a module-level function: it is part
            of the compile key), computed on the device.

        Returns:
          (finish(state), work_k2 int32 [k, 2]: each slot's decode steps and tokens sampled in
          them, as `poll`'s counts), on the device, rows split as the state's.
        """
        key, build, args = self._at_once_program(params, version, prompt_tokens_kp,
                                                 prompt_mask_kp, keys, rows_k, limits_k, finish)
        return self._run(key, build, *args)

    def _at_once_program(self, params, version: int, prompt_tokens_kp, prompt_mask_kp, keys,
                         rows_k, limits_k, finish, put=transfer, scalar=None):
        """`decode_at_once`'s (compile key, build, arguments), its inputs placed by `put` and
        its scalars made by `scalar` (default `_scalar_on_devices`)."""
        scalar = scalar or self._scalar_on_devices
        k = len(prompt_tokens_kp)
        check_batch_divisible(self.layout, k, "rollout slots")
        n_max = self.cfg.max_new_tokens
        reach = n_max if limits_k is None else min(int(np.max(limits_k)), n_max)
        vacant = Vacant(k, capacity_for(reach, n_max))
        ints, prompts, table, specs, compile_key = self._fill_inputs(
            k, np.arange(k), prompt_tokens_kp, prompt_mask_kp, keys, rows_k, limits_k, put)
        args = (params, ints, prompts, table, scalar(version), scalar(reach - 1))

        def build():
            fill = functools.partial(programs.fill, self.prefill_model, self.cfg,
                                     self._empty_fn(vacant, self.per_device), self._writes())
            advance = functools.partial(programs.advance, self.model, self.cfg, True)
            fn = functools.partial(programs.fill_and_decode, fill, advance, finish)
            if self.per_device:
                fn = self._on_each_device(fn, (_REPLICATED, *specs) + (_REPLICATED,) * 3,
                                          self.layout.batch_sharding(1).spec)
            rows = lambda x: self.layout.batch_sharding(x.ndim)
            return fn, jax.tree.map(rows, jax.eval_shape(fn, *args))

        return ("at once", *vacant, *compile_key, len(table), finish), build, args

    def lowered_programs(self, params, prompt_tokens_kp, prompt_mask_kp, key, finish,
                         at_once: bool, compact_to: int | None = None
                         ) -> dict[str, jax.stages.Lowered]:
        """The programs a generate call of k prompts in k slots runs, lowered with nothing
        placed (`params` and the PRNG `key` abstract, module `engine.call`): with `at_once`,
        `decode_at_once`'s one program (`finish` as there); else, as `generate.decode_rows`
        runs them, a fill of every slot, a chunk of decode steps at the largest cache
        (`advance`) and, with `compact_to`, a compaction of that state into so many slots.

        Args:
          prompt_tokens_kp, prompt_mask_kp: [k, P] host arrays (distinct prompts are
            prefilled once: give the call's real repetition, a GRPO group's n copies).
        """
        k = len(prompt_tokens_kp)
        rows_k, keys = np.arange(k, dtype=np.int32), [key] * k
        scalar = lambda value: abstract(np.int32(value), self._scalar)
        if at_once:
            _, build, args = self._at_once_program(params, 0, prompt_tokens_kp, prompt_mask_kp,
                                                   keys, rows_k, None, finish, abstract, scalar)
            return {"decode at once": self._lower(build, *args)}
        _, build, args, donate = self._fill_program(
            self.vacant(k), params, 0, rows_k, prompt_tokens_kp, prompt_mask_kp, keys, rows_k,
            None, abstract, scalar)
        out = {"fill": self._lower(build, *args, donate=donate)}
        largest = Vacant(k, capacity_for(self.cfg.max_new_tokens, self.cfg.max_new_tokens))
        full = abstract(jax.eval_shape(self._empty_fn(largest, local=False)),
                        self._shardings(*largest))
        _, build, args = self._advance_program(full, params, 0, 1, False, 0, scalar)
        out["decode chunk"] = self._lower(build, *args, donate=(1,))
        if compact_to is not None:
            moves = targets.spread_moves(self.layout, k, compact_to)
            _, build, args = self._compact_program(full, moves, abstract)
            out["compaction"] = self._lower(build, *args)
        return out

    def spread(self, free: list[int], slots: int | None = None) -> list[int]:
        """Free slots in the order to fill them: taking turns over the devices (a fill
        prefills as many rows on every device as on its busiest)."""
        per_device = (self.slots if slots is None else slots) // self.layout.dp_size
        taken = collections.Counter()
        order = []
        for slot in sorted(free):
            device = slot // per_device
            order.append((taken[device], device, slot))
            taken[device] += 1
        return [slot for *_, slot in sorted(order)]

    def fit(self, state: SlotState, needed: int) -> SlotState:
        """The state with the capacity bucket of `needed` response slots: grown when it holds
        fewer, cut when it holds more than twice as many (long rows have left); as it is
        otherwise."""
        slots, capacity = self.size(state)
        want = self._fitted(capacity, needed)
        if want == capacity:
            return state
        fn = functools.partial(programs.resize, self.model.config,
                               length=self.prompt_len + want)
        return self._run(("resize", slots, capacity, want), self._state_out(fn, slots, want),
                         state)

    def _fitted(self, capacity: int, needed: int) -> int:
        """`fit`'s capacity for a state of `capacity` whose rows need `needed` slots."""
        n_max = self.cfg.max_new_tokens
        want = capacity_for(needed, n_max)
        if ring_holds_all(self.model.config, self.prompt_len + want):
            want = n_max  # the window's ring holds every slot in the same bytes
        return capacity if want <= capacity <= 2 * want else want

    def chunk_steps(self, state: SlotState, longest: int, num_steps: int) -> int:
        """How many of `num_steps` tokens to `advance` from `longest` (>= 1): up to where the
        busy rows outgrow the cache that holds their next token (the capacity bucket above
        it, or the state's own where `fit` keeps that); the next chunk grows it. The
        synchronous call's chunks (`decode_rows`) end there.

        Why: a cache grown for the whole chunk up front is read at the larger size by every
        step of the chunk. On W-cpu d1 (64 rows, 512 forced tokens, chunks of 32) ending
        chunks at the buckets' ends reads 8% fewer cache slots (1.15x the live ones, not
        1.25x), where a step of 64 slots costs about 10.5 ms + 0.024 ms per cache slot
        (process time of a 16-step `advance` of a filled state at capacities 48 to 1024)."""
        longest = max(int(longest), 1)
        room = self._fitted(self.size(state)[1], longest + 1)
        return max(1, min(num_steps, room - longest))

    def reload(self, state: SlotState, params, longest: int | None = None) -> SlotState:
        """Every slot's cache recomputed under new weights (an interruption).

        Args:
          longest: at least every busy slot's response length so far (`poll`'s third count);
            the cache is recomputed that far, rounded up to a capacity bucket. None: all of
            the state's cache.
        """
        slots, capacity = self.size(state)
        n_new = capacity if longest is None else min(
            capacity_for(longest, self.cfg.max_new_tokens), capacity)
        fn = functools.partial(programs.recompute_cache, self.prefill_model, n_new)
        return self._run(("reload", slots, capacity, n_new),
                         self._state_out(fn, slots, capacity), params, state,
                         donate=(1,))

    def abort(self, state: SlotState, slots: list[int]) -> tuple[SlotState, jax.Array]:
        """The rows of `slots` dropped, their slots free; (the state, int32 on the device: the
        tokens those rows had sampled)."""
        size = self.size(state)
        abort_b = transfer(np.isin(np.arange(size[0]), slots), self.layout.batch_sharding(1))
        build = lambda: (programs.abort, (self._shardings(*size), self._scalar))
        return self._run(("abort", *size), build, state, abort_b, donate=(0,))

    def advance(self, state: SlotState, params, version: int, num_steps: int,
                longest: int | None = None, lockstep: bool = False,
                stop_busy: int = 0) -> SlotState:
        """Up to `num_steps` more tokens in every busy slot under `params` (of policy `version`,
        the weights its cache was computed with: `reload` first after new weights).

        Args:
          longest: at least every busy slot's response length so far (`poll`'s third count;
            a slot filled since has 1): the cache is first fitted to what such rows reach in
            this call (`fit`; `chunk_steps` says how many steps stay within the cache bucket
            holding their next token). None: all max_new_tokens response slots.
          lockstep: every busy slot is at the same step (filled together, none since).
          stop_busy: stop as soon as at most this many slots are busy (0: when all are done):
            the caller can then refill the freed slots or compact the state, rather than
            decode finished rows' slots to the end of the chunk. Decoding each device's own
            slots, each device stops when its share (stop_busy / data-parallel size) is met.
        """
        n_max = self.cfg.max_new_tokens
        needed = n_max if longest is None else max(int(longest), 1) + num_steps
        state = self.fit(state, needed)
        key, build, args = self._advance_program(state, params, version, num_steps, lockstep,
                                                 stop_busy)
        return self._run(key, build, *args, donate=(1,))

    def _advance_program(self, state, params, version: int, num_steps: int, lockstep: bool,
                         stop_busy: int, scalar=None):
        """`advance`'s (compile key, build, arguments) on a state already fitted, its scalars
        made by `scalar` (as `_at_once_program`); the state is donated."""
        scalar = scalar or self._scalar_on_devices
        slots, capacity = self.size(state)

        def build():
            fn = functools.partial(programs.advance, self.model, self.cfg, lockstep)
            if self.per_device:
                state_specs = self._state_specs(slots, capacity)
                fn = self._on_each_device(fn, (_REPLICATED, state_specs) + (_REPLICATED,) * 3,
                                          state_specs)
            return fn, self._shardings(slots, capacity)

        if self.per_device:
            stop_busy //= self.layout.dp_size
        return (("advance", slots, capacity, lockstep), build,
                (params, state, scalar(num_steps), scalar(stop_busy), scalar(version)))

    def compact(self, state: SlotState, keep: list[int]) -> SlotState:
        """The slots `keep` only, in that order, as a state of len(keep) slots (a multiple of
        the data-parallel size); `poll`'s decode counts restart at 0."""
        slots, _ = self.size(state)
        check_batch_divisible(self.layout, len(keep), "compacted slots")
        dp, keep = self.layout.dp_size, np.asarray(keep)
        own = slots // dp
        moves = routes.plan(keep // own, keep % own, np.arange(len(keep)) // (len(keep) // dp),
                            own, dp)
        key, build, args = self._compact_program(state, moves)
        return self._run(key, build, *args)

    def _compact_program(self, state, moves: routes.Routes, put=transfer):
        """`compact`'s (compile key, build, arguments) for the row moves `moves`, its inputs
        placed by `put` (as `_fill_inputs`)."""
        slots, capacity = self.size(state)
        size = len(moves.at_j)
        shardings = self.layout.batch_sharding(2), self.layout.batch_sharding(1)
        send, at = put((moves.send_dq, moves.at_j), shardings)

        def build():
            fn = functools.partial(programs.compact, routes.data_axes(self.layout))
            in_specs = (self._state_specs(slots, capacity), *(x.spec for x in shardings))
            fn = self._on_each_device(fn, in_specs, self._state_specs(size, capacity))
            return fn, self._shardings(size, capacity)

        return ("compact", slots, capacity, size, moves.width), build, (state, send, at)

    def _state_specs(self, slots: int, capacity: int) -> SlotState:
        """The partition specs of a state's arrays."""
        return jax.tree.map(lambda sharding: sharding.spec, self._shardings(slots, capacity))

    def _on_each_device(self, fn, in_specs: tuple, out_specs):
        """`fn` run by each device on its own slots (`shard_map`), its arguments and result
        split as `in_specs` and `out_specs` say (the weights, where it takes them, replicated).

        Why: SPMD, advance's loop condition (are all slots done?) is an all-reduce across the
        data-parallel devices every decode step, where a device that got ahead waits for the
        other; on XLA:CPU that rendezvous cost more than the step itself (tiny model, 16 slots,
        2 devices): each device's own loop stops when its own slots are done. A fill gathered
        its prompts (five all-gathers per call) for the slot writes. On every layout, the
        compaction and an SPMD fill's slot writes run here too, moving rows between devices
        only where the host planned it (module `engine.routes`).
        """
        def local(*args):
            with nn.logical_axis_rules(()):  # local shapes: no sharding constraints inside
                return fn(*args)

        # check_vma off: a scanned prefill's fresh cache (zeros, the same on every device)
        # would have to be cast to varying before it may carry each device's own keys.
        return jax.shard_map(local, mesh=self.layout.mesh, in_specs=in_specs,
                             out_specs=out_specs, check_vma=False)

    def poll(self, state: SlotState) -> tuple[np.ndarray, np.ndarray]:
        """(done_b bool [S], counts int32 [3]: slot-steps decoded, tokens sampled in them, the
        longest busy slot's response so far) on the host (a sync point on small arrays)."""
        return tuple(np.asarray(x) for x in fetch(self._poll(state)))

    def rows(self, state: SlotState) -> Rows:
        """Every slot's sequence so far, on the host."""
        return Rows(*fetch(self._rows(state))).map(np.asarray)

    def collect(self, state: SlotState) -> tuple[np.ndarray, np.ndarray, Rows]:
        """`poll` and `rows` in one fetch (where the caller expects every row done)."""
        (done_b, counts), rows = fetch(self._collect(state))
        return np.asarray(done_b), np.asarray(counts), Rows(*rows).map(np.asarray)
