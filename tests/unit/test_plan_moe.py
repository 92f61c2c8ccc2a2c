"""The planner's figures for mixture-of-experts models against hand-computed counts: all E
experts held (parameters, optimizer state), top_k of them and the router run (FLOPs, the grouped
matmuls' rows), and configs/grpo_qwen3_30b_a3b.py planned on its two clusters."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest

from jaxrlhf.configs import grpo_qwen3_30b_a3b
from jaxrlhf.mfc import Call
from jaxrlhf.models.config import RematPolicy
from jaxrlhf.models.sizes import abstract_params, get_size
from jaxrlhf.parallel.layout import Platform, make_layout
from jaxrlhf.parallel.strategy import DeviceRange, parse_strategy
from jaxrlhf.plan import cost, memory, space, train_memory
from jaxrlhf.plan.choice import CallChoice
from jaxrlhf.plan.cluster import load_cluster
from jaxrlhf.plan.evaluate import Evaluator
from jaxrlhf.plan.experiment import Workload
from jaxrlhf.plan.profile import profile_of
from jaxrlhf.plan.search import heuristic, search
from jaxrlhf.spec import run_spec


def _qwen3_30b_counts():
    """(total, active, active matmul) parameters of Qwen3-30B-A3B from its shapes."""
    d, layers, vocab, e, k, f = 2048, 48, 151936, 128, 8, 768
    q, kv, head_dim = 32, 4, 128
    attention = d * q * head_dim * 2 + d * kv * head_dim * 2  # q, o; k, v
    qk_norms, layer_norms = 2 * head_dim, 2 * d
    router, expert = d * e, 3 * d * f
    per_layer = attention + qk_norms + layer_norms + router
    embedding = head = vocab * d
    total = layers * (per_layer + e * expert) + embedding + head + d  # + final norm
    active = layers * (per_layer + k * expert) + embedding + head + d
    matmul = layers * (attention + router + k * expert) + head
    return total, active, matmul


def test_qwen3_30b_a3b_holds_all_experts_and_runs_top_k():
    p = profile_of(get_size("qwen3-30b-a3b"))
    total, active, matmul = _qwen3_30b_counts()
    assert (p.num_params, p.active_params, p.matmul_params) == (total, active, matmul)
    assert (total, active) == (30_532_122_624, 3_353_032_704)  # the published 30.5B and 3.3B
    assert p.expert_matmul_params == 48 * (2048 * 128 + 8 * 3 * 2048 * 768)


def test_mixtral_counts_are_the_published_ones():
    p = profile_of(get_size("mixtral-8x7b"))
    assert round(p.num_params / 1e9, 1) == 46.7 and round(p.active_params / 1e9, 1) == 12.9
    # 32 layers of 6 experts a token does not run, 3 x 4096 x 14336 each
    assert p.num_params - p.active_params == 32 * 6 * 3 * 4096 * 14336


def test_forward_flops_follow_top_k_and_experts_split_over_tensor():
    p = profile_of(get_size("qwen3-30b-a3b"))
    context = 1024
    _, _, matmul = _qwen3_30b_counts()
    attention = 4 * 48 * 32 * 128 * context
    assert p.forward_flops_per_token(context) == 2 * matmul + attention
    # The rules cut each expert's width F = 768 4 ways, as a dense MLP's: the experts' FLOPs
    # split 4 ways with the rest; the router runs whole on every tensor rank.
    router = 2 * 48 * 2048 * 128
    experts = 2 * 48 * 8 * 3 * 2048 * 768
    dense = 2 * matmul + attention - router - experts
    assert p.expert_tensor_ways(4) == 4
    assert cost.tensor_split_flops(p, context, 4) == pytest.approx(
        dense / 4 + router + experts / 4, rel=1e-12)
    dense_p = profile_of(get_size("qwen3-8b"))
    assert cost.tensor_split_flops(dense_p, context, 4) == pytest.approx(
        dense_p.forward_flops_per_token(context) / 4, rel=1e-12)


def test_sparse_block_output_is_summed_over_tensor_as_a_dense_mlps():
    """Two all-reduces over t a layer (attention's, the feed-forward's), dense or sparse;
    where t does not cut the experts' width (tiny-moe's F = 128 on t = 3) the sparse block
    sums nothing, but a mixed model's scanned layers still run their dense MLP."""
    moe, dense = get_size("qwen3-30b-a3b"), get_size("qwen3-8b")
    assert [cost.tensor_reduces_per_layer(profile_of(m), 4) for m in (moe, dense)] == [2, 2]
    tiny = get_size("tiny-moe")
    assert profile_of(tiny).expert_tensor_ways(3) == 1
    assert cost.tensor_reduces_per_layer(profile_of(tiny), 3) == 1
    mixed = tiny.replace(moe=tiny.moe.replace(dense_layers=(0,)))
    assert cost.tensor_reduces_per_layer(profile_of(mixed), 3) == 2
    cluster = load_cluster("meshes/h100_8.py")
    t4 = CallChoice.of(parse_strategy("0-3:t4"))
    tokens = 4096
    one = cost.all_reduce(tokens * 2048 * 2, 4, (cluster.intra_host_bandwidth,
                                                 cluster.intra_host_latency))
    forward = cost._forward(profile_of(moe), cluster, t4, tokens, 1024)
    assert forward.comm == pytest.approx(2 * 48 * one.comm, rel=1e-12)


def test_decode_reads_only_the_experts_its_rows_route_to():
    p = profile_of(get_size("qwen3-30b-a3b"))
    assert cost.expert_read_fraction(p, 1) == pytest.approx(8 / 128)
    assert cost.expert_read_fraction(p, 2) == pytest.approx(1 - (120 / 128) ** 2)
    assert cost.expert_read_fraction(p, 512) > 0.999
    assert cost.expert_read_fraction(profile_of(get_size("qwen3-8b")), 64) == 0.0
    expert_bytes = 48 * 128 * 3 * 2048 * 768 * 4  # fp32 parameters (the size's default)
    assert p.expert_shard_bytes(1, 1) == expert_bytes
    assert p.expert_shard_bytes(1, 2) == expert_bytes // 2  # fsdp cuts their embed dimension


def test_sparse_block_activations_follow_t_times_k_rows():
    """tiny-moe (D 64, E 8, k 2, F 128; `intermediate_size` 256 unused), fp32 parameters and
    bf16 compute (a = 2 bytes), 10 tokens."""
    p = profile_of(get_size("tiny-moe", remat=RematPolicy.DOTS))
    d, e, k, f, a, tokens = 64, 8, 2, 128, 2, 10
    assert p.attn_dim == 64 and p.kv_dim == 32  # 4 query heads of 16, 2 key/value heads
    # The MLP half of a forward: the layer input, [T*k] rows of the gathered tokens, gate, up
    # and their product, two fp32 [T, E] router arrays.
    mlp = a * d + k * a * (3 * f + d) + 2 * 4 * e
    attention_half = 4 * d + a * (2 * d + 2 * 64 + 2 * 32)  # no scores over 0 slots
    assert mlp > attention_half
    assert memory.forward_peak_bytes(p, tokens, 0, 1) == tokens * max(mlp, attention_half)
    # DOTS keeps the grouped matmuls' outputs (gate, up at F, down at D, T*k rows) and the
    # router's fp32 logits beside the attention projections and the layer input.
    per_token = a * (3 * d + 64 + 2 * 32) + k * a * (2 * f + d) + 4 * e
    assert memory.saved_activation_bytes(p, tokens, 0, 1) == 2 * tokens * per_token
    # One projection of all E experts is sliced out of the scanned stack (fp32) and cast.
    one = CallChoice(DeviceRange(0, 0))
    assert memory._gathered_bytes(p, one, scanned=True) == e * d * f * (4 + a)


def test_train_state_counts_every_expert():
    p = profile_of(get_size("qwen3-30b-a3b", param_dtype=jnp.bfloat16))
    f8 = CallChoice(DeviceRange(0, 7), fsdp=8)
    params, optimizer = train_memory.train_state_bytes(p, f8, fp32_master=True)
    # Every leaf's embed dimension is cut 8 ways, but the q/k norm scales [L, head_dim].
    qk_norms = 48 * 2 * 128
    sharded = p.num_params - qk_norms
    assert params == 2 * (sharded // 8 + qk_norms)
    assert optimizer == 12 * (sharded // 8 + qk_norms)  # ZeRO-1 over d = 1
    work = Workload(batch_size=64, prompt_len=1024, new_tokens=2048, mini_batches=1)
    f8_k8 = CallChoice(DeviceRange(0, 7), fsdp=8, micro_batches=8)
    mem = memory.call_memory(p, Call.TRAIN_STEP, work, f8_k8, True, platform=Platform.GPU)
    assert mem.arguments == params + optimizer


@pytest.mark.parametrize("variant,cluster", [(None, "tpu_v5p_64"), ("h100", "h100_8")])
def test_grpo_qwen3_30b_a3b_plans_on_its_clusters(variant, cluster):
    """Both clusters get a plan; on the v5p-64 its generation is expert-parallel (fewer weight
    bytes a chip, and a decode step reads 1/e of the experts)."""
    config = grpo_qwen3_30b_a3b.get_config(variant)
    assert config.placement.cluster == f"meshes/{cluster}.py"
    spec = run_spec(config)
    report = search(spec.experiment(), load_cluster(config.placement.cluster))
    plan = report.searched.plan
    assert plan is not None, report.searched.reason
    assert report.searched.step_seconds > 0
    assert all(128 % choice.expert == 0 for _, choice in plan.items())
    if variant is None:
        assert plan["actor_gen"].expert > 1


# --- expert parallelism (strategy letter e) ------------------------------------------------


def test_the_space_offers_e_to_mixtures_only_and_e_divides_the_experts():
    cluster = load_cluster("meshes/h100_8.py")
    moe = {e for *_, e in space.degrees(8, cluster, get_size("tiny-moe"))}
    assert moe == {1, 2, 4, 8}  # 8 experts
    assert {e for *_, e in space.degrees(8, cluster, get_size("tiny"))} == {1}
    six = get_size("tiny-moe").replace(moe=get_size("tiny-moe").moe.replace(num_experts=6))
    assert {e for *_, e in space.degrees(8, cluster, six)} == {1, 2}


def test_an_expert_rank_is_a_data_rank_holding_one_eth_of_the_experts():
    choice = CallChoice.of(parse_strategy("0-7:d2e4"), 2)
    assert (choice.dp_size, choice.expert, str(choice)) == (8, 4, "0-7:d2e4@2")
    assert choice.param_layout != CallChoice.of(parse_strategy("0-7:d8"), 2).param_layout
    p = profile_of(get_size("qwen3-30b-a3b", param_dtype=jnp.bfloat16))
    experts = 2 * 48 * 128 * 3 * 2048 * 768
    assert p.expert_shard_bytes(1, 1, 1, 4) == experts // 4
    assert p.shard_bytes(1, 1, 1, 4) == p.shard_bytes(1, 1) - experts + experts // 4
    # t cuts each expert's width too: 1/(e*t) of the experts a device, and so of their
    # gradients and optimizer state.
    assert p.expert_shard_bytes(4, 1, 1, 2) == experts // 8
    rest = p.shard_bytes(4, 1) - p.expert_shard_bytes(4, 1)
    assert p.shard_bytes(4, 1, 1, 2) == rest + experts // 8
    e2t4 = CallChoice.of(parse_strategy("0-7:e2t4"))
    params, optimizer = train_memory.train_state_bytes(p, e2t4, fp32_master=True)
    assert (params, optimizer) == (rest + experts // 8, 6 * (rest + experts // 8))


@pytest.mark.devices(8)
@pytest.mark.parametrize("spec", ["0-1:t2", "0-3:e2t2", "0-7:d2e2t2", "0-7:f2e2t2"])
def test_expert_shard_bytes_equal_compiled_arguments(spec):
    """The planner's per-device parameter bytes are what XLA holds for tiny-moe's parameters
    on the layout: the experts 1/(e*t) (and their embed dim 1/f) on each device."""
    cfg = get_size("tiny-moe")
    layout = make_layout(spec, model=cfg)
    compiled = jax.jit(lambda params: params, in_shardings=(
        layout.param_shardings(abstract_params(cfg)),)).lower(
        nn.unbox(abstract_params(cfg))).compile()
    s = layout.strategy
    p = profile_of(cfg)
    assert p.shard_bytes(s.tensor, s.fsdp, 1, s.expert) == \
        compiled.memory_analysis().argument_size_in_bytes
    experts = 2 * 8 * 3 * 64 * 128 * 4  # L, E, gate/up/down of D x F, fp32
    assert p.expert_shard_bytes(s.tensor, s.fsdp, 1, s.expert) == \
        experts // (s.expert * s.tensor * s.fsdp)


def test_all_to_all_and_gradient_reduction_follow_the_hand_count():
    p = profile_of(get_size("qwen3-30b-a3b", param_dtype=jnp.bfloat16))
    cluster = load_cluster("meshes/h100_8.py")
    d2e4 = CallChoice.of(parse_strategy("0-7:d2e4"))
    tokens = 4096
    # Per sparse layer, dispatch and return: a buffer of e*T*k rows of D bf16, 3/4 of it sent.
    buffer = 4 * tokens * 8 * 2048 * 2
    one = 3 / 4 * buffer / cluster.intra_host_bandwidth
    a2a = cost.expert_all_to_all(p, cluster, d2e4, tokens)
    assert a2a.comm == pytest.approx(2 * 48 * one, rel=1e-12)
    assert a2a.fixed == pytest.approx(2 * 48 * 3 * cluster.intra_host_latency, rel=1e-12)
    assert cost.expert_all_to_all(p, cluster, CallChoice.of(parse_strategy("0-7:d8")),
                                  tokens) == cost.ZERO
    # Gradients: the experts' quarter over the 2 data ranks, the rest over all 8.
    experts = 2 * 48 * 128 * 3 * 2048 * 768 // 4
    rest = p.shard_bytes(1, 1, 1, 4) - experts
    grads = cost._reduce_gradients(p, cluster, d2e4)
    ring = lambda nbytes, n: 2 * (n - 1) / n * nbytes / cluster.intra_host_bandwidth
    assert grads.comm == pytest.approx(ring(rest, 8) + ring(experts, 2), rel=1e-12)


def test_expert_parallel_buffers_hold_e_times_the_rows():
    """tiny-moe's sparse block on e = 4: the grouped matmuls' rows and the send, receive and
    return buffers are e*T*k rows (`models.expert_parallel`'s static dropless buffers); a
    train step's layer holds them all, a forward pass the larger of the matmuls' arrays and
    an exchange's T*k rows in expert order beside its send and receive buffers."""
    p = profile_of(get_size("tiny-moe"))
    d, e, k, f, a, tokens = 64, 8, 2, 128, 2, 10
    router = 2 * 4 * e
    matmuls = 4 * k * a * (3 * f + d)
    exchange = k * a * (2 * 4 + 1) * d
    mlp = a * d + max(matmuls, exchange) + router
    assert memory.forward_peak_bytes(p, tokens, 0, 1, expert=4) == tokens * mlp
    working = 4 * k * a * (4 * f + (2 + 3) * d) + 3 * 4 * e
    assert memory._mlp_bytes(p, 1, 4, 2, 3, expert=4) == working
    d2e4 = CallChoice.of(parse_strategy("0-7:d2e4"))
    assert memory._gathered_bytes(p, d2e4, scanned=True) == e * d * f * (4 + a) // 4



def test_accelerator_train_and_inference_of_experts_are_expert_parallel_or_one_rank():
    """XLA's partitioner does not split a grouped matmul's rows over the batch axes, so on a
    TPU or GPU a mixture's train step and inference are searched with e > 1, t > 1 (both a
    shard_map over the rows) or no data parallelism (`space._experts_partitioned`);
    generation (its own shard_map) and a CPU cluster keep every layout."""
    config = grpo_qwen3_30b_a3b.get_config()
    experiment = run_spec(config).experiment()
    model = experiment.model(experiment.graph.mfc("ref_inf").role)
    tpu, cpu = load_cluster("meshes/tpu_v5p_64.py"), load_cluster("meshes/cpu_8.py")
    options = space.SpaceOptions(micro_batches=(1,))
    for name in ("ref_inf", "actor_train", "actor_gen"):
        mfc = experiment.graph.mfc(name)
        on_tpu = {c.degrees for c in space.configs(mfc, 512, 32, tpu, model, options)}
        assert (1, 16, 1, 1, 2) in on_tpu  # e2f16
        assert (8, 1, 4, 1, 1) in on_tpu  # d8t4: t cuts the experts' width, a shard_map too
        if name == "actor_gen":
            assert (1, 32, 1, 1, 1) in on_tpu  # f32
        else:
            assert (1, 32, 1, 1, 1) not in on_tpu
            assert all(e > 1 or t > 1 or d * f == 1 for d, f, t, _, e in on_tpu)
        on_cpu = {c.degrees for c in space.configs(mfc, 512, 8, cpu, model, options)}
        assert (1, 8, 1, 1, 1) in on_cpu


def test_heuristic_proposes_no_pipeline_where_experts_train():
    """Megatron's rules on 8 H100s give Qwen3-30B-A3B t4 and the fewest stages that fit; a
    mixture of experts trains without a pipeline (`engine.train_step` refuses one), so the
    symmetric heuristic tries p1 only (d2t4, which does not fit) where it took p2t4."""
    config = grpo_qwen3_30b_a3b.get_config("h100")
    evaluator = Evaluator(run_spec(config).experiment(), load_cluster(config.placement.cluster))
    result = heuristic(evaluator, (1, 2, 4, 8, 16, 32, 64))
    assert result.plan is not None
    assert {(c.tensor, c.pipeline) for _, c in result.plan.items()} == {(4, 1)}
    assert not result.feasible and "actor_train does not fit" in result.reason
