"""Memory of trained models: the generation copy of the actor is freed once generation is
dispatched (not kept until the next train step), and `placement.offload_trainable` keeps the
actor's and critic's parameters and optimizer state in host memory while other models run,
without changing a single number of the run; the planner's memory model follows both.
"""

import collections
import contextlib
import gc
import math

import flax.linen as nn
import jax
import numpy as np
import pytest

from jaxrlhf.data import tasks
from jaxrlhf.data.encode import prompt_batch
from jaxrlhf.dataflow.runtime import ModelRuntime
from jaxrlhf.engine.generate import Generator
from jaxrlhf.engine.inference import InferenceFn
from jaxrlhf.engine.optimizer import OptimizerConfig
from jaxrlhf.engine.train_step import TrainStep, create_train_state
from jaxrlhf.mfc import Role
from jaxrlhf.models.sizes import abstract_params, get_size
from jaxrlhf.parallel.layout import init_params, make_layout
from jaxrlhf.plan.cluster import load_cluster
from jaxrlhf.plan.memory import plan_memory
from jaxrlhf.run import build
from jaxrlhf.run.check import check_config
from jaxrlhf.schema import base_config

ROWS = 8
CPU_8 = "meshes/cpu_8.py"
ALLOCATION = ("actor_gen=0-7:d4t2,ref_inf=0-7:d8,critic_inf=0-7:d8,actor_train=0-7:d8,"
              "critic_train=0-7:d8")


def test_a_copy_lives_until_its_last_reader():
    model = get_size("tiny")
    home, gen = make_layout("0-7:d8", model=model), make_layout("0-7:d4t2", model=model)
    params = init_params(model, home, jax.random.key(0))
    runtime = ModelRuntime(Role.ACTOR, model, home, readers={gen: 2},
                           state=create_train_state(params, model, home, OptimizerConfig()))
    runtime.params_on(gen)
    copied = runtime.counters.realloc_bytes
    runtime.done_reading(gen)
    runtime.params_on(gen)  # the second reader of the step: the same copy
    assert runtime.counters.realloc_bytes == copied > 0
    runtime.done_reading(gen)
    runtime.params_on(gen)  # the copy was dropped after its last reader: copied again
    assert runtime.counters.realloc_bytes == 2 * copied


def gen_copies_alive(gen_layout, model) -> int:
    """Live device arrays laid out as the actor's generation copy of its embedding."""
    boxed = abstract_params(model)
    embed = gen_layout.param_shardings(boxed)["embed_tokens"]["embedding"]
    shape = (model.vocab_size, model.hidden_size)
    return sum(1 for x in jax.live_arrays()
               if x.shape == shape and x.sharding.is_equivalent_to(embed, 2)
               and x.sharding.memory_kind == "device")


def device_bytes(excluded: set[int]) -> int:
    """The most bytes of live arrays in device memory on any one device (arrays in
    `excluded`, by id, left out)."""
    per = collections.Counter()
    for x in jax.live_arrays():
        if id(x) in excluded or x.is_deleted() or x.sharding.memory_kind != "device":
            continue
        nbytes = math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize
        for device in x.sharding.device_set:
            per[device.id] += nbytes
    return max(per.values(), default=0)


@contextlib.contextmanager
def watching_engine_calls(on_call):
    """Calls on_call(engine) as every engine call starts (observes; the call then runs)."""
    originals = {cls: cls.__call__ for cls in (Generator, InferenceFn, TrainStep)}

    def watched(original):
        def call(self, *args, **kwargs):
            on_call(self)
            return original(self, *args, **kwargs)
        return call

    try:
        for cls, original in originals.items():
            cls.__call__ = watched(original)
        yield
    finally:
        for cls, original in originals.items():
            cls.__call__ = original


def run_two_steps(tmp_path, offload_trainable: bool):
    """Two PPO steps; returns (metrics per step, what a probe saw as ref_inf was dispatched in
    step 2 (before its memory policy ran), the most device bytes live as each MFC's engine call
    started, the job, runner)."""
    config = base_config()
    for role in ("actor", "ref", "critic"):  # parameters well above the batch's activations
        config.models[role].size = "small"
    config.rollout.update(batch_size=ROWS, max_prompt_len=8, max_new_tokens=4)
    config.placement.update(kind="manual", allocation=ALLOCATION,
                            offload_trainable=offload_trainable)
    job = check_config(config, str(tmp_path))
    rows = tasks.make_reverse_task(tasks.ReverseTask(num_train=ROWS, num_eval=8, num_sft=8))
    batch = prompt_batch(rows.train, job.tokenizer, 8)
    seen, live, names = {}, collections.defaultdict(int), {}
    gc.collect()
    before = {id(x) for x in jax.live_arrays()}  # other tests' arrays

    def on_call(engine):
        name = names[id(engine)]
        live[name] = max(live[name], device_bytes(before))

    with build.host_pools(job.spec) as pools, watching_engine_calls(on_call):
        runner = build.fresh_runner(job, pools)
        names.update({id(engine): name for name, engine in runner.engines.items()})
        ref_inf = runner.scheduler.executors["ref_inf"]

        def probe(buf):  # observes, then runs the real executor
            runtimes = runner.runtimes
            seen.update(gen_copies=gen_copies_alive(job.plan.layouts["actor_gen"],
                                                    job.spec.models[Role.ACTOR].config),
                        live_after_gen=device_bytes(before),  # before ref_inf onloads the ref
                        actor_on_host=runtimes[Role.ACTOR].on_host,
                        critic_on_host=runtimes[Role.CRITIC].on_host)
            return ref_inf(buf)

        runner.scheduler.executors["ref_inf"] = probe
        metrics = [runner.step(batch).metrics for _ in range(2)]
        runner.close()
    return metrics, seen, dict(live), job, runner


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return {flag: run_two_steps(tmp_path_factory.mktemp(f"offload_{flag}"), flag)
            for flag in (False, True)}


def gen_copy_bytes(job) -> int:
    """Bytes per device of the actor's parameters on its generation layout."""
    model = job.spec.models[Role.ACTOR].config
    boxed = abstract_params(model)
    shardings = job.plan.layouts["actor_gen"].param_shardings(boxed)
    leaves = jax.tree.leaves(nn.unbox(boxed))
    return sum(math.prod(s.shard_shape(x.shape)) * x.dtype.itemsize
               for x, s in zip(leaves, jax.tree.leaves(shardings)))


@pytest.mark.parametrize("offload_trainable", [False, True])
def test_generation_copy_is_freed_after_generation(runs, offload_trainable):
    """No array of the copy is left when ref_inf is dispatched, and the step's device memory
    shows it: from generation's start to ref_inf's dispatch (before the frozen ref comes back
    from host memory) the live bytes per device drop by the copy's size, less the generated
    sequences (a few KB); they would stay flat with the copy kept."""
    _, seen, live, job, _ = runs[offload_trainable]
    assert seen["gen_copies"] == 0
    copy = gen_copy_bytes(job)
    freed = live["actor_gen"] - seen["live_after_gen"]
    print(f"offload_trainable={offload_trainable}: gen copy {copy} B/device, live at actor_gen "
          f"{live['actor_gen']} B, after it {seen['live_after_gen']} B, freed {freed} B")
    assert 0.95 * copy <= freed <= copy, (freed, copy)


def test_offload_trainable_keeps_trained_models_on_host_between_their_calls(runs):
    (plain, seen_plain, *_), (offloaded, seen_off, *_) = runs[False], runs[True]
    assert seen_off["actor_on_host"] and seen_off["critic_on_host"]
    assert not (seen_plain["actor_on_host"] or seen_plain["critic_on_host"])
    for before, after in zip(plain, offloaded):
        for key in ("actor/loss", "critic/loss", "reward", "actor/kl"):
            np.testing.assert_allclose(after[key], before[key], rtol=1e-6, atol=1e-7)
        assert after["actor/offload_bytes"] > 0 and after["critic/offload_bytes"] > 0
        assert before["actor/offload_bytes"] == 0


@pytest.mark.parametrize("offload_trainable", [False, True])
def test_planner_peak_follows_the_runtime(runs, offload_trainable):
    """The planner's peak per MFC against what is live on the devices as the MFC's call starts
    plus XLA's temporaries of its compiled call (`memory_analysis`), within 20%."""
    _, _, live, job, runner = runs[offload_trainable]
    experiment = job.spec.experiment()  # placement.offload_trainable reaches the planner
    assert experiment.offload_trainable == offload_trainable
    predicted = plan_memory(experiment, job.plan.plan, load_cluster(CPU_8)).peak
    for name, engine in runner.engines.items():
        temp = max(c.memory_analysis().temp_size_in_bytes
                   for c in engine.compile_cache.executables())
        measured = live[name] + temp
        print(f"offload_trainable={offload_trainable} {name}: predicted {predicted[name]} B, "
              f"live {live[name]} + temp {temp} = {measured} B, "
              f"ratio {predicted[name] / measured:.3f}")
        assert 0.8 <= predicted[name] / measured <= 1.2, (name, predicted[name], measured)
    if offload_trainable:  # the trained models' states are off the devices at generation
        plain = runs[False][2]
        assert live["actor_gen"] < plain["actor_gen"] / 3
