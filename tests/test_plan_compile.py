"""`python -m jaxrlhf.plan --compile`: every call of a plan compiled for a TPU slice that libtpu
describes (v5p 2×2×1, `meshes/tpu_v5p_8.py`), here, without a TPU.

The tiny configs' calls under colocate, split and a pipelined manual plan must all compile for
TPU (a change that breaks TPU lowering fails here), with the Pallas (Mosaic) attention kernels
`attention=auto` picks there, and fit; the command's last line is the JSON the issue asks for.
Compiling the tiny calls takes a few seconds each.
"""

import dataclasses
import json
import math
import os
import re
import subprocess
import sys

import flax.linen as nn
import jax
import numpy as np
import pytest

from jaxrlhf.calibration import aot, targets
from jaxrlhf.mfc import Role
from jaxrlhf.parallel.strategy import parse_strategy
from jaxrlhf.plan.choice import CallChoice
from jaxrlhf.plan.cluster import load_cluster
from jaxrlhf.run.layouts import execution_plan, searched_plan
from jaxrlhf.spec import run_spec
from jaxrlhf.configs import grpo_moe_tiny, grpo_qwen3_30b_a3b, grpo_tiny, ppo_tiny

pytestmark = pytest.mark.tpu_compile

PIPELINED = {  # 4 devices: pipelined train, inference and generation (a static batch)
    "ppo": "actor_gen=0-3:d2p2,actor_train=0-3:d2p2,critic_inf=0-3:d4,critic_train=0-3:p2t2,"
           "ref_inf=0-3:p2d2",
    "grpo": "actor_gen=0-3:d2p2,actor_train=0-3:p2t2,ref_inf=0-3:d2p2",
}


@pytest.fixture(scope="module")
def v5p_8(libtpu):
    cluster = load_cluster("meshes/tpu_v5p_8.py")
    return cluster, targets.topology_devices(cluster)


def _config(module, placement: str):
    config = module.get_config()
    config.placement.kind = placement
    if placement == "manual":
        config.placement.allocation = PIPELINED[config.algorithm]
    return config


# ppo under each placement, grpo colocated in the default suite (its calls are ppo's without
# the critic's); grpo's split and pipelined plans with -m slow.
@pytest.mark.parametrize("module,placement", [
    *[(ppo_tiny, p) for p in ("colocate", "split", "manual")], (grpo_tiny, "colocate"),
    *[pytest.param(grpo_tiny, p, marks=pytest.mark.slow) for p in ("split", "manual")]],
    ids=lambda v: getattr(v, "__name__", v).rsplit(".", 1)[-1].removesuffix("_tiny"))
def test_every_call_compiles_for_tpu(v5p_8, module, placement):
    cluster, devices = v5p_8
    spec = run_spec(_config(module, placement))
    plan = execution_plan(spec, cluster.num_devices)
    reports = aot.compile_plan(spec, cluster, plan, devices, cluster.usable_hbm_bytes)
    assert [r.name for r in reports] == [n for n in spec.graph.order if n in plan]
    for r in reports:
        assert r.compiled, r.error
        assert r.fits and 0 < r.xla_bytes <= r.limit_bytes
        assert r.model_bytes > 0 and r.xla_flops > 0 and r.model_flops > 0
        # attention=auto on TPU: the Mosaic kernels, in every call (train, inference, generate)
        assert r.kernels == ("Mosaic",), (r.name, r.kernels)
    generate = next(r for r in reports if r.name == "actor_gen")
    pipelined = plan["actor_gen"].pipeline > 1
    assert [p.name for p in generate.programs] == (["generate"] if pipelined
                                                   else ["decode at once"])


def test_generate_flops_count_each_distinct_prompts_prefill_once(v5p_8):
    """grpo_tiny's generation (8 prompts x 4 responses on d4, prefill and one decode step):
    the rollout engine prefills each distinct prompt once, and the cost model prices that
    (`Workload.prompts_per_device`): within 15% of XLA's matmul FLOPs (+10% measured; priced
    per response it read 3.75x XLA's)."""
    cluster, devices = v5p_8
    spec = run_spec(_config(grpo_tiny, "colocate"))
    assert spec.rollout.group_size > 1
    plan = execution_plan(spec, cluster.num_devices)
    (report,) = aot.compile_plan(spec, cluster, plan, devices, cluster.usable_hbm_bytes,
                                 calls={"actor_gen"})
    assert [p.name for p in report.programs] == ["decode at once"]
    assert abs(report.model_flops / report.xla_flops - 1) < 0.15, (report.model_flops,
                                                                   report.xla_flops)


def test_pipelined_generate_flops_match_xla(v5p_8):
    """ppo_tiny's static pipelined generation (d2p2): its token loop runs to a bound XLA knows,
    so it counts every token, as the cost model does (+7.7%); where the loop stops at a
    runtime bound (ReaL's 70B plans on h100_16x8) both count its prefill and one token."""
    cluster, devices = v5p_8
    spec = run_spec(_config(ppo_tiny, "manual"))
    plan = execution_plan(spec, cluster.num_devices)
    (report,) = aot.compile_plan(spec, cluster, plan, devices, cluster.usable_hbm_bytes,
                                 calls={"actor_gen"})
    (program,) = report.programs
    assert program.name == "generate" and program.unbounded_loops == 0
    assert abs(program.model_flops / program.flops - 1) < 0.10, (program.model_flops,
                                                                 program.flops)


def test_command_prints_tables_and_ends_with_one_json_line(libtpu, tmp_path):
    """... and with `--explain`, what XLA holds at each call's peak, by source (its live
    ranges): a train step's parameters and optimizer state among them; and the heap its buffer
    assignment packs the temporaries into."""
    out = subprocess.run(
        [sys.executable, "-m", "jaxrlhf.plan", "--config=configs/grpo_tiny.py",
         "--cluster=meshes/tpu_v5p_8.py", "--compile", "--config.placement.kind=colocate",
         "--explain"],
        capture_output=True, text=True, timeout=600, env=os.environ | {"CI": ""})
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.strip().splitlines()
    assert any(line.startswith("MFC") and "XLA GiB" in line for line in lines)
    result = json.loads(lines[-1])["compile"]
    assert (result["platform"], result["topology"], result["plan"]) == ("tpu", "v5p:2x2x1",
                                                                        "colocate")
    # libtpu's own figure for a v5p chip, and the cluster file's usable share below it
    assert result["reported_bytes"] > 95 * 2**30
    assert result["limit_bytes"] == load_cluster("meshes/tpu_v5p_8.py").usable_hbm_bytes
    assert set(result["calls"]) == {"actor_gen", "ref_inf", "actor_train"}
    for call in result["calls"].values():
        assert {"compiled", "xla_bytes", "model_bytes", "limit_bytes", "xla_flops",
                "model_flops", "seconds"} <= set(call)
        assert call["compiled"] and call["seconds"] > 0
    explained = [line for line in lines if "GiB live at XLA's peak" in line]
    assert [line.split(" ")[0] for line in explained] == ["actor_gen", "ref_inf", "actor_train"]
    step = result["calls"]["actor_train"]["programs"]["train step"]
    assert 0 < sum(step["peak_sources"].values()) <= step["peak_live_bytes"] <= step["xla_bytes"]
    # the heap XLA's buffer assignment packs the temporaries into, at most memory_analysis's
    assert 0 < step["peak_heap_bytes"] <= step["temporary_bytes"]
    assert any(source.startswith("state") for source in step["peak_sources"])


def test_a_cluster_without_a_topology_is_one_line(libtpu):
    with pytest.raises(targets.CompileError, match="names no devices to compile for"):
        targets.topology_devices(load_cluster("meshes/cpu_8.py"))


def test_a_topology_that_is_not_the_clusters_is_refused(libtpu, tmp_path):
    path = tmp_path / "wrong.py"
    path.write_text(
        "from jaxrlhf.plan.cluster import Cluster, Platform\n"
        "def get_cluster():\n"
        "    return Cluster(name='wrong', hosts=2, devices_per_host=4, hbm_bytes=95 * 10**9,\n"
        "                   peak_bf16_flops=459e12, hbm_bandwidth=2.765e12,\n"
        "                   intra_host_bandwidth=200e9, inter_host_bandwidth=200e9,\n"
        "                   host_link_bandwidth=25e9, platform=Platform.TPU,\n"
        "                   topology='v5p:2x2x1')\n")
    with pytest.raises(targets.CompileError, match="has 1 hosts and 4 devices"):
        targets.topology_devices(load_cluster(str(path)))


def test_the_compile_flag_is_refused_beside_another_mode():
    out = subprocess.run(
        [sys.executable, "-m", "jaxrlhf.plan", "--config=configs/grpo_tiny.py",
         "--cluster=meshes/tpu_v5p_8.py", "--compile", "--validate"],
        capture_output=True, text=True, timeout=300)
    assert out.returncode != 0
    assert out.stderr.strip().splitlines()[-1].endswith(
        "--calibrate, --validate and --compile are separate runs")
    out = subprocess.run(
        [sys.executable, "-m", "jaxrlhf.plan", "--config=configs/grpo_tiny.py",
         "--cluster=meshes/tpu_v5p_8.py", "--explain"],
        capture_output=True, text=True, timeout=300)
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [
        "error: --explain: says what XLA holds at each call's peak; it needs --compile"]


def test_v5e_compiles_one_chip_or_the_whole_slice(libtpu):
    """libtpu compiles a v5e slice's programs for one chip or all 256, never for part of it
    (`Cluster.whole_slice`): the planner places every call so (`tests/test_plan_search.py`)."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec

    cluster = load_cluster("meshes/tpu_v5e_256.py")
    devices = targets.topology_devices(cluster)
    assert cluster.whole_slice and len(devices) == cluster.num_devices

    def compile_on(n):
        mesh = jax.sharding.Mesh(np.asarray(devices[:n]), ("x",))
        x = jax.ShapeDtypeStruct((8 * n, 128), jnp.float32,
                                 sharding=NamedSharding(mesh, PartitionSpec("x")))
        jax.jit(lambda x: x.sum(0), out_shardings=NamedSharding(mesh, PartitionSpec())).lower(
            x).compile()

    compile_on(1)
    compile_on(256)
    with pytest.raises(Exception, match="all slice devices"):
        compile_on(4)


def test_reported_hbm_is_libtpus_own_figure(v5p_8):
    _, devices = v5p_8
    assert 95 * 2**30 < targets.reported_hbm_bytes(devices) < 96 * 2**30



def test_matmul_flops_count_each_loop_as_often_as_it_runs(v5p_8):
    """hlo_counts on a program compiled for TPU: a scan of 6 layers inside a loop of 3 (batched
    matmuls, which XLA:TPU writes as convolutions) counts 18 layers, where cost_analysis
    counts one; a loop bounded by a runtime value counts once and is reported."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec

    from jaxrlhf.calibration import hlo_counts

    _, devices = v5p_8
    mesh = jax.sharding.Mesh(np.asarray(devices), ("x",))
    rows = NamedSharding(mesh, PartitionSpec("x"))

    def layers(x_bmk, w_lkk):
        step = lambda x, w: (jnp.tanh(jnp.einsum("bmk,kn->bmn", x, w)), None)
        return jax.lax.scan(step, x_bmk, w_lkk)[0]

    def repeated(x_bmk, w_lkk):
        return jax.lax.fori_loop(0, 3, lambda _, x: layers(x, w_lkk), x_bmk)

    def until(x_bmk, w_lkk, n):
        return jax.lax.while_loop(lambda c: c[1] < n, lambda c: (layers(c[0], w_lkk), c[1] + 1),
                                  (x_bmk, 0))[0]

    x = jax.ShapeDtypeStruct((8, 32, 256), jnp.bfloat16, sharding=rows)
    w = jax.ShapeDtypeStruct((6, 256, 256), jnp.bfloat16,
                             sharding=NamedSharding(mesh, PartitionSpec()))
    per_layer = 2 * (8 // 4) * 32 * 256 * 256  # per device: a quarter of the rows
    compiled = jax.jit(repeated).lower(x, w).compile()
    assert hlo_counts.program_flops(compiled.as_text()) == hlo_counts.Flops(18 * per_layer, 0)
    assert compiled.cost_analysis()["flops"] < 2 * per_layer  # XLA's own: the body once
    n = jax.ShapeDtypeStruct((), jnp.int32, sharding=NamedSharding(mesh, PartitionSpec()))
    text = jax.jit(until).lower(x, w, n).compile().as_text()
    assert hlo_counts.program_flops(text) == hlo_counts.Flops(6 * per_layer, 1)


def test_matmul_flops_of_a_windowed_einsum_count_its_loop_steps(libtpu):
    """On 8 v5p chips XLA:TPU runs a matmul over an fsdp-sharded weight as a windowed einsum:
    a loop whose unrolled body adds 2 to its counter, two shards a step. Its trip count is
    the counter's steps to the bound (4 / 2), not the bound: read as 4 it counted every
    fsdp-sharded matmul twice (ppo_7b's f8 inference at 2x the cost model's FLOPs)."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec

    from jaxrlhf.calibration import hlo_counts

    devices = targets.topology_devices(load_cluster("meshes/tpu_v5p_16.py"))
    fsdp = NamedSharding(jax.sharding.Mesh(np.asarray(devices), ("f",)), PartitionSpec("f"))
    x = jax.ShapeDtypeStruct((16, 2048, 1024), jnp.bfloat16, sharding=fsdp)
    w = jax.ShapeDtypeStruct((1024, 1024), jnp.bfloat16, sharding=fsdp)
    product = jax.jit(lambda x, w: jnp.einsum("btk,kn->btn", x, w), out_shardings=fsdp)
    text = product.lower(x, w).compile().as_text()
    assert "windowed_dot_general" in text
    assert hlo_counts.program_flops(text) == hlo_counts.Flops(2 * 2 * 2048 * 1024 * 1024, 0)


def test_matmul_flops_of_attention_einsums_written_as_dilated_convolutions(v5p_8):
    """XLA:TPU writes the GQA score and value products ([b, k, g, t, d] × [b, k, s, d]) as
    convolutions over batch dims dilated by their window: one tap of each window counts."""
    import jax
    import jax.numpy as jnp

    from jaxrlhf.calibration import hlo_counts

    one = jax.sharding.SingleDeviceSharding(v5p_8[1][0])
    shaped = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.bfloat16, sharding=one)
    for equation, lhs, rhs in [("bkgtd,bksd->bkgts", shaped(2, 4, 8, 256, 128),
                                shaped(2, 4, 512, 128)),
                               ("bkgts,bksd->bkgtd", shaped(2, 4, 8, 256, 512),
                                shaped(2, 4, 512, 128))]:
        product = lambda a, b, e=equation: jnp.einsum(e, a, b,
                                                      preferred_element_type=jnp.float32)
        text = jax.jit(product).lower(lhs, rhs).compile().as_text()
        assert hlo_counts.program_flops(text).flops == 2 * 2 * 4 * 8 * 256 * 512 * 128


def _compile_llama_1b(v5p_8, roles, batch_size, calls, trained=False, **layouts):
    """ppo_tiny with `roles` of Llama-3.2-1B's shape (bf16; `trained`: as the big configs
    train, full remat and an fp32 master) over 2,048-token rows, every call on d4 but for
    `layouts` (MFC -> degrees); (its spec, the reports of `calls` compiled for v5p 2x2x1)."""
    cluster, devices = v5p_8
    config = ppo_tiny.get_config()
    for role in roles:
        config.models[role].update(size="llama-3.2-1b", dtype="bfloat16", param_dtype="bfloat16",
                                   **({"remat": "full"} if trained else {}))
        if trained:
            config.optimizer[role].fp32_master = True
    config.rollout.update(batch_size=batch_size, max_prompt_len=1024, max_new_tokens=1024)
    degrees = {name: "d4" for name in ("actor_gen", "actor_train", "critic_inf", "critic_train",
                                       "ref_inf")} | layouts
    config.placement.update(kind="manual", allocation=",".join(
        f"{name}=0-3:{d}" for name, d in degrees.items()))
    spec = run_spec(config)
    plan = execution_plan(spec, cluster.num_devices)
    return spec, aot.compile_plan(spec, cluster, plan, devices, cluster.usable_hbm_bytes,
                                  calls=calls)


def test_memory_and_flops_of_a_flash_attention_call_match_xla(v5p_8):
    """A value model of Llama-3.2-1B's shape (bf16, no vocabulary logits: attention is its
    largest activation) over 2,048-token rows on d4, attention=auto (Pallas on TPU): the
    memory model is within 15% of XLA's peak (it counted fp32 [heads, query, slot] scores that
    the flash kernel never writes: twice XLA's), and its FLOPs within 1% of XLA's matmuls."""
    _, (report,) = _compile_llama_1b(v5p_8, ("critic",), 8, {"critic_inf"})
    assert report.kernels == ("Mosaic",)
    assert abs(report.memory_error) < 0.15, (report.model_bytes, report.xla_bytes)
    assert abs(report.model_flops / report.xla_flops - 1) < 0.01


def test_log_probs_read_the_head_out_in_row_chunks_on_tpu(v5p_8):
    """Llama-3.2-1B's log-probs of 2,048-token rows on d4 (4 rows a chip): the head reads its
    128,256-id logits out a row at a time (1 GiB of fp32 each, `head_row_chunks`), so XLA's
    peak stays below the parameters and one call's whole logits (10.19 GiB in one piece,
    4.78 GiB in rows); the memory model, which prices the same chunks, within 15% of it."""
    from jaxrlhf.engine.inference import head_row_chunks

    spec, (report,) = _compile_llama_1b(v5p_8, ("actor", "ref"), 16, {"ref_inf"})
    vocab = spec.models[Role.REF].config.vocab_size
    assert head_row_chunks(4, 2048, vocab) == 4
    (program,) = report.programs
    logits = 4 * 2048 * vocab * 4
    assert report.xla_bytes < program.argument_bytes + logits, report.xla_bytes
    assert abs(report.memory_error) < 0.15, (report.model_bytes, report.xla_bytes)


@pytest.mark.slow  # two train steps of a 1B model: about two minutes on 2 cores
def test_train_steps_memory_within_10_percent_of_xla_on_tpu(v5p_8):
    """Llama-3.2-1B trained as the big configs train (bf16 parameters, an fp32 master, full
    remat) on 2,048-token rows: the actor on d2f2 (its peak the head's fp32 logits), the
    critic on d4 with a loop of two micro-batches (its peak the optimizer step's fp32
    gradient trees, `train_memory.gradient_phases`). The memory model within 10% of XLA's peak
    (it priced a CPU's gradient trees, all beside the activations: the critic +35%)."""
    _, reports = _compile_llama_1b(v5p_8, ("actor", "critic"), 16,
                                   {"actor_train", "critic_train"}, trained=True,
                                   actor_train="d2f2", critic_train="d4@2")
    for report in reports:
        assert abs(report.memory_error) < 0.10, (report.name, report.model_bytes,
                                                 report.xla_bytes)


@pytest.mark.slow  # a train step of 16 layers of 70B's shape: about two minutes on 2 cores
def test_a_zero1_train_step_with_fsdp_and_tensor_parallelism_within_10_percent_on_tpu(
        libtpu, monkeypatch):
    """ppo_70b's actor cut to 16 of its layers, trained on d2f2t2 of a v5p-16 with one
    micro-batch (4 rows of 2,048 tokens a chip): XLA:TPU holds a copy of the largest layer
    stack through the step and lays the step's fp32 gradient stacks above the saved
    activations' space (`train_memory.zero1_step_heap_bytes`); the memory model within 10% of XLA's
    peak (-11.6% before, 58.22 GiB by XLA; the full 70B on d8f2t4 of a v5p-128 -21.2% before,
    -6.6% now)."""
    from jaxrlhf.configs import ppo_70b
    from jaxrlhf.models import sizes

    cluster = load_cluster("meshes/tpu_v5p_16.py")
    monkeypatch.setitem(sizes.SIZES, "llama3-70b-16", dataclasses.replace(
        sizes.SIZES["llama3-70b"], num_layers=16))
    config = ppo_70b.get_config()
    config.require_model_paths = False
    for role in ("actor", "ref"):
        config.models[role].size = "llama3-70b-16"
    config.rollout.batch_size = 16 * config.ppo.mini_batches
    config.placement.update(kind="manual", cluster="meshes/tpu_v5p_16.py", allocation=",".join(
        f"{name}=0-7:{'d2f2t2' if name == 'actor_train' else 'd8'}" for name in
        ("actor_gen", "actor_train", "critic_inf", "critic_train", "ref_inf", "reward")))
    spec = run_spec(config)
    (report,) = aot.compile_plan(spec, cluster, execution_plan(spec, 8),
                                 targets.topology_devices(cluster), cluster.usable_hbm_bytes,
                                 calls={"actor_train"})
    assert report.compiled, report.error
    assert abs(report.memory_error) < 0.10, (report.model_bytes, report.xla_bytes)


def compiled_call_text(spec, plan, devices, name: str):
    """(The optimized HLO of MFC `name`'s one program, a train step's or an inference call's,
    as `plan --compile` compiles it for `devices`; the call's layout)."""
    from jaxrlhf.run import build
    from jaxrlhf.run.layouts import run_plan

    layout = run_plan(spec, plan, devices).layouts[name]
    mfc, choice = spec.graph.mfc(name), plan[name]
    engine = build.engine_call(
        mfc, spec.models[mfc.role].config, layout, build.train_micro(spec, choice.micro_batches),
        spec.rollout, aot.stand_in_tokenizer(spec.base.config.vocab_size), spec.algorithm,
        spec.optimizers.get(mfc.role))
    (lower,) = aot._programs(spec, mfc, engine, layout, choice.micro_batches,
                             aot.step_buffer(spec)).values()
    return lower().compile().as_text(), layout


def gathered_elements(text: str) -> list[int]:
    """Elements of every array an all-gather writes in an optimized HLO module's text (an
    asynchronous all-gather-start's result lists its operands, then what it gathers them into;
    XLA:GPU combines several gathers into one)."""
    shapes = []
    for line in text.splitlines():
        head, gather, _ = line.partition(" all-gather")
        if not gather or "=" not in head:
            continue
        result = [[int(d) for d in dims.split(",") if d]
                  for dims in re.findall(r"[a-z]+\d*\[([\d,]*)\]", head.split("=", 1)[1])]
        start = line.partition(" all-gather")[2].startswith("-start(")
        shapes += result[len(result) // 2:] if start else result
    return [math.prod(dims) for dims in shapes]


def largest_parameter_shard(spec, role: Role, layout) -> int:
    """Elements of a device's largest parameter shard of `role`'s model on `layout`."""
    from jaxrlhf.models.sizes import abstract_params

    boxed = abstract_params(spec.models[role].config)
    leaves = jax.tree.leaves(nn.meta.unbox(boxed))
    shardings = jax.tree.leaves(layout.param_shardings(boxed))
    return max(math.prod(s.shard_shape(a.shape)) for a, s in zip(leaves, shardings))


def test_a_pipelined_backward_pass_gathers_no_activations(v5p_8):
    """ppo_tiny's critic trained on d2p2 with two micro-batches: the only all-gathers are
    ZeRO-1's of parameter-shaped updates. The pipeline's stage S-1 output was an index into the
    stage-sharded dim, whose transpose (a pad over that dim) XLA's partitioner formed by
    gathering the whole [M, b, t, d] gradient of the streamed activations over the
    data-parallel devices in every backward iteration (`Pipeline.last_stage`; on ReaL's 70B
    plans for H100s 8 GiB live at the peak)."""
    cluster, devices = v5p_8
    config = ppo_tiny.get_config()
    config.placement.update(kind="manual", allocation=PIPELINED["ppo"].replace(
        "critic_train=0-3:p2t2", "critic_train=0-3:d2p2@2"))
    spec = run_spec(config)
    plan = execution_plan(spec, cluster.num_devices)
    text, layout = compiled_call_text(spec, plan, devices, "critic_train")
    assert layout.pipeline == 2 and layout.dp_size == 2
    gathered = gathered_elements(text)
    assert gathered, "ZeRO-1 gathers the updated parameters"
    assert max(gathered) <= largest_parameter_shard(spec, Role.CRITIC, layout), sorted(gathered)


def test_parameter_movements_compile_and_move_what_the_planner_counts(v5p_8):
    """The pipelined manual plan moves the critic from its train layout (p2t2) to its
    inference one (d4): one collective hop, compiled; the bytes its collectives bring from
    other devices are the planner's within 5% (the planner counts the pipeline axis as cutting
    the embedding and head too, which each device holds a tensor slice of: 4.3% more here)."""
    cluster, devices = v5p_8
    spec = run_spec(_config(ppo_tiny, "manual"))
    plan = execution_plan(spec, cluster.num_devices)
    (move,) = aot.compile_reallocations(spec, cluster, plan, devices)
    assert (move.role, move.src, move.dst) == ("critic", "0-3:p2t2@1", "0-3:d4@1")
    assert not move.error and move.programs == 1
    assert move.planned_bytes > 0
    assert move.xla_bytes == pytest.approx(move.planned_bytes, rel=0.05)


@pytest.mark.parametrize("name", ["tpu_v5p_8", "tpu_v5p_16", "tpu_v5p_128", "tpu_v5e_256",
                                  "tpu_v6e_256"])
def test_cluster_files_usable_hbm_is_below_libtpus(libtpu, name):
    """Every TPU cluster file's topology is its hosts × devices, and the memory it lets a plan
    use is below what libtpu lets a program use on that chip (and within 20% of it)."""
    cluster = load_cluster(f"meshes/{name}.py")
    reported = targets.reported_hbm_bytes(targets.topology_devices(cluster))
    assert 0.8 * reported < cluster.usable_hbm_bytes < reported



def test_a_mixture_of_experts_compiles_for_tpu_expert_parallel(v5p_8):
    """grpo_moe_tiny's calls on d2e2 of a v5p-8: generation, inference and the train step
    compile with the experts' ragged_dot (libtpu's grouped matmul) and the all-to-all, under
    the suite's "highest" matmul precision, which libtpu's kernel refused for bf16 operands
    ("Bad lhs type")."""
    cluster, devices = v5p_8
    config = grpo_moe_tiny.get_config()
    config.placement.strategy = "d2e2"
    for role in ("actor", "ref"):
        config.models[role].dtype = "bfloat16"  # as a TPU run computes
    spec = run_spec(config)
    plan = execution_plan(spec, cluster.num_devices)
    reports = aot.compile_plan(spec, cluster, plan, devices, cluster.usable_hbm_bytes)
    assert {r.name for r in reports} == {"actor_gen", "ref_inf", "actor_train"}
    for r in reports:
        assert r.compiled, r.error
        assert r.fits and r.model_bytes > 0


# grpo_qwen3_30b_a3b's calls on a v5p-64 (v5p:2x4x4) as measured (model against XLA, GiB):
# generation with the experts' ragged_dot 21.72 against 22.35 (-2.8%); expert-parallel
# inference e2f16 10.37 against 12.15 (-14.6%) and d4e4f2 22.59 against 24.16 (-6.5%), where
# XLA's heap peaks at an exchange: T*k rows in expert order beside the send and receive
# buffers (`memory._mlp_bytes`). The train steps, the searched d4e2f4@2 among them, are strict
# xfails that fail once fixed: XLA's memory_analysis puts them over the limit. The live-range
# dump's peak breakdown (`peaks`) totals less (70.99 GiB for d4e8@4, 69.18 for d4e2f4@2), but
# it is the values live at one point, not the heap: the preallocated temporary buffer in XLA's
# buffer assignment is memory_analysis's figure (a 2-layer, 16-expert train step on f2t2@2 of
# a v5p-8: 29.47 GiB allocated, 30.82 by memory_analysis, 11.31 live in the breakdown), and
# libtpu refuses the searched d8f2t2@2 (98.33 GiB of temporaries) by it.
_QWEN3_30B_CALLS = [
    ("actor_gen", "0-31:d8e4@1"),
    ("ref_inf", "0-31:e2f16@1"),
    ("ref_inf", "0-31:d4e4f2@1"),
    pytest.param("actor_train", "0-31:d4e8@4", marks=pytest.mark.xfail(
        strict=True, reason="model -13.6% of XLA (81.97 against 94.91 GiB), XLA's does not fit")),
    pytest.param("actor_train", "0-31:d4e2f4@2", marks=pytest.mark.xfail(
        strict=True, reason="model -10.4% of XLA (79.39 against 88.59 GiB), XLA's does not fit")),
]


@pytest.mark.slow  # a 30B mixture of experts: 3 to 5 minutes a call on 2 loaded cores
@pytest.mark.parametrize("call,layout", _QWEN3_30B_CALLS)
def test_qwen3_30b_a3b_calls_compile_for_v5p_64_within_15_percent(libtpu, call, layout):
    """configs/grpo_qwen3_30b_a3b.py's calls on a v5p-64 (32 chips): each compiles, fits, and
    the memory model is within 15% of XLA's peak (see `_QWEN3_30B_CALLS`)."""
    config = grpo_qwen3_30b_a3b.get_config()
    cluster = load_cluster(config.placement.cluster)
    spec = run_spec(config)
    strategy, micro = layout.split("@")
    plan = searched_plan(spec).replace(**{call: CallChoice.of(parse_strategy(strategy),
                                                              int(micro))})
    (report,) = aot.compile_plan(spec, cluster, plan, targets.topology_devices(cluster),
                                 cluster.usable_hbm_bytes, calls={call})
    assert report.compiled, report.error
    assert report.fits, (report.xla_bytes, report.limit_bytes)
    assert abs(report.memory_error) < 0.15, (call, report.model_bytes, report.xla_bytes)


def _small_qwen3_moe(monkeypatch, layers: int, experts: int, batch_size: int, layout: str,
                     prompt_len: int = 1024, new_tokens: int = 2048):
    """grpo_qwen3_30b_a3b with models of Qwen3-30B-A3B's shape cut to `layers` layers of
    `experts` experts, every call on `layout` of a v5p-8, rows of `prompt_len` +
    `new_tokens`."""
    from jaxrlhf.models import sizes

    qwen3 = sizes.SIZES["qwen3-30b-a3b"]
    monkeypatch.setitem(sizes.SIZES, "qwen3-moe-small", dataclasses.replace(
        qwen3, num_layers=layers, moe=dataclasses.replace(qwen3.moe, num_experts=experts)))
    config = grpo_qwen3_30b_a3b.get_config()
    for role in ("actor", "ref"):
        config.models[role].size = "qwen3-moe-small"
    config.rollout.update(batch_size=batch_size, max_prompt_len=prompt_len,
                          max_new_tokens=new_tokens)
    config.placement.update(kind="manual", cluster="meshes/tpu_v5p_8.py", allocation=",".join(
        f"{name}=0-3:{layout}" for name in ("actor_gen", "actor_train", "ref_inf")))
    return run_spec(config)


@pytest.mark.slow  # a mixture of experts of 2,048 wide: 20-55 s on 2 loaded cores
def test_expert_order_and_gathered_projections_of_t_cut_experts_are_priced(v5p_8, monkeypatch):
    """Qwen3-30B-A3B's shape with 2 layers of 16 experts, its log-probs on f2t2 of a v5p-8:
    with t cutting each expert's width (D > 3F/t) the sparse block peaks while its T*k rows
    are put into expert order, the rows and their permuted copy at model width
    (`expert_memory.expert_order_bytes`), and fsdp gathers all three projections before the
    block's shard_map (`expert_memory.projections_gathered`): the model within 15% of XLA's peak
    (-19.3% before, -1.8% now; the searched f16t2 of a v5p-64 -28.7% before, -12.5%)."""
    cluster, devices = v5p_8
    spec = _small_qwen3_moe(monkeypatch, 2, 16, 4, "f2t2")
    (report,) = aot.compile_plan(spec, cluster, execution_plan(spec, 4), devices,
                                 cluster.usable_hbm_bytes, calls={"ref_inf"})
    assert report.compiled, report.error
    assert abs(report.memory_error) < 0.15, (report.model_bytes, report.xla_bytes)


@pytest.mark.slow  # 8 layers of 64 experts of 2,048 wide: 4 minutes on 2 loaded cores
def test_a_loops_gradient_sum_is_priced_beside_the_heads_phase(v5p_8, monkeypatch):
    """Qwen3-30B-A3B's shape with 8 layers of 64 experts, its train step on f2t2 of a v5p-8
    with two micro-batches of 6,144 tokens (768-token rows): the loop's fp32 gradient sum is
    live through each micro-batch's backward pass, beside the head's logits, where the step
    peaks (`train_memory.gradient_sum_bytes`): the model within 10% of XLA's peak (-20.2% before,
    -7.7% now; the same step on f2t2@1 was +9.8%: the gap was the loop, not the experts)."""
    cluster, devices = v5p_8
    spec = _small_qwen3_moe(monkeypatch, 8, 64, 4, "f2t2@2", prompt_len=256, new_tokens=512)
    (report,) = aot.compile_plan(spec, cluster, execution_plan(spec, 4), devices,
                                 cluster.usable_hbm_bytes, calls={"actor_train"})
    assert report.compiled, report.error
    assert abs(report.memory_error) < 0.10, (report.model_bytes, report.xla_bytes)


@pytest.mark.slow  # a mixture of experts of 2,048 wide: 20-55 s on 2 loaded cores
def test_a_decode_loops_copy_of_t_cut_expert_stacks_is_priced(v5p_8, monkeypatch):
    """Qwen3-30B-A3B's shape with 4 layers of 64 experts, generating on t4 of a v5p-8 (each
    expert's width 768/4 = 192, off the 128 lanes): the decode loop holds its gate and up
    stacks copied into the grouped matmul's layout, lane-padded
    (`expert_memory.decode_expert_copy_bytes`); the model within 15% of XLA's peak (-30.3% before,
    -8.3% now; the searched d4e2t4 of a v5p-64 -28.5% before, -4.4%)."""
    cluster, devices = v5p_8
    spec = _small_qwen3_moe(monkeypatch, 4, 64, 2, "t4")
    (report,) = aot.compile_plan(spec, cluster, execution_plan(spec, 4), devices,
                                 cluster.usable_hbm_bytes, calls={"actor_gen"})
    assert report.compiled, report.error
    assert abs(report.memory_error) < 0.15, (report.model_bytes, report.xla_bytes)


# Moves of a "small" model (4.2M parameters: each layout's shards are MiBs, so the 15% binds,
# not the 1 MiB) over the 4 chips: gathers, exchanges, slices and into a pipeline.
MOVES = [("f4", "d4"), ("d2t2", "d4"), ("f4", "t4"), ("d2f2", "d2t2"), ("d4", "f4"),
         ("d2t2", "p2t2")]


def test_a_parameter_moves_peak_is_priced_within_15_percent_of_xla(v5p_8):
    """`plan --compile` compiles a move's collective hops chunk by chunk, as `reshard` runs
    them; the memory model's peak of the move (`moves.move_memory`: both layouts and the
    chunk's buffers) is within 15% or 1 MiB of XLA's (arguments + outputs + the largest
    chunk's temporaries); the planner priced no move's peak before. A move out of a pipelined layout, which XLA re-slices along the layer axis, is not held
    to it (up to 37% more by XLA on this topology)."""
    cluster, devices = v5p_8
    for src, dst in MOVES:
        config = grpo_tiny.get_config()
        config.models.actor.size = "small"
        config.placement.update(kind="manual", allocation=(
            f"actor_gen=0-3:{dst},actor_train=0-3:{src},ref_inf=0-3:{src}"))
        spec = run_spec(config)
        (move,) = aot.compile_reallocations(spec, cluster, execution_plan(spec, 4), devices)
        assert not move.error and move.programs == 1, (src, dst, move.error)
        assert abs(move.model_peak_bytes - move.xla_peak_bytes) <= max(
            0.15 * move.xla_peak_bytes, 2**20), (src, dst, move.model_peak_bytes,
                                                 move.xla_peak_bytes)
    assert "peak model GiB" in aot.realloc_table([move]).splitlines()[0]


def _llama3_7b_cut(monkeypatch, layers: int, batch_size: int, allocation: str):
    """ppo_7b with every model of Llama-3 7B's shape cut to `layers` layers, all calls on
    `allocation` of a v5p-8 (its 1,024-token prompts and responses)."""
    from jaxrlhf.configs import ppo_7b
    from jaxrlhf.models import sizes

    monkeypatch.setitem(sizes.SIZES, "llama3-7b-cut", dataclasses.replace(
        sizes.SIZES["llama3-7b"], num_layers=layers))
    config = ppo_7b.get_config()
    for role in config.models:
        config.models[role].size = "llama3-7b-cut"
    config.rollout.batch_size = batch_size
    config.placement.update(kind="manual", cluster="meshes/tpu_v5p_8.py", allocation=",".join(
        f"{name}=0-3:{allocation}" for name in ("actor_gen", "reward", "ref_inf", "critic_inf",
                                                 "actor_train", "critic_train")))
    return run_spec(config)


@pytest.mark.slow  # 50 s of compiling on 2 quiet cores
def test_rollout_engines_programs_are_priced_within_10_percent_of_xla(v5p_8, monkeypatch):
    """Llama-3 7B's shape cut to 4 layers generating 128 rows a device on d2t2 (as 7B's on
    d4t2 of a v5p-16: the same prefill activations a device, an eighth of the cache): the
    fill holds its fresh prompt cache and its output state at the fill's capacity (P + 16
    slots), not the full state; the decode chunk the full state; the compaction, which takes
    no parameters, the state and its compacted copy, beside the parameters the devices keep
    (XLA's peak leaves them out; the call's peak counts them). The memory model prices each
    program so, the largest within 10% of XLA's peak (+28.7% before: it priced the fill's
    buffers beside the full state; ppo_7b on d4t2 of a v5p-16 +28.2% before)."""
    cluster, devices = v5p_8
    spec = _llama3_7b_cut(monkeypatch, 4, 256, "d2t2")
    (report,) = aot.compile_plan(spec, cluster, execution_plan(spec, 4), devices,
                                 cluster.usable_hbm_bytes, calls={"actor_gen"})
    fill, decode, compaction = report.programs
    assert [p.name for p in report.programs] == ["fill", "decode chunk", "compaction"]
    # The compaction takes the state alone; the parameters, the decode chunk's other argument
    # beside its batch, stay on the devices beside it and count in its peak.
    params = decode.argument_bytes - decode.batch_bytes - compaction.argument_bytes
    assert (fill.resident_bytes, decode.resident_bytes) == (0, 0)
    assert abs(compaction.resident_bytes - params) <= 2**20, (compaction.resident_bytes, params)
    assert abs(report.memory_error) < 0.10, (report.model_bytes, report.xla_bytes)
