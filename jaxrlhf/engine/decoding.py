"""What every decode loop shares: the sampling settings, the prefill of a KV cache, one sampled
token per row, the cache's sharding, and the model a layout decodes with.

Used by the rollout engine (`engine.rollout`, where every generation runs) and by the
static-batch decode of `engine.generate` (pipelined layouts and the reference the engine is
tested against).
"""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax.numpy as jnp

from jaxrlhf.engine import replay
from jaxrlhf.engine.decode_layers import LayerByLayer
from jaxrlhf.engine.sampling import SamplingParams, sample, token_logprobs
from jaxrlhf.models.config import ModelConfig
from jaxrlhf.models import decode_kv
from jaxrlhf.models.decode_kv import DecodeKV
from jaxrlhf.models.mixed_cache import MixedKVCache, PeriodScan, splits_cache
from jaxrlhf.models.transformer import KVCache, Transformer
from jaxrlhf.parallel.layout import Layout, Platform
from jaxrlhf.parallel.pipeline import layer_stack

# KVCache [l, b, s, k, d]; a pipeline keeps each stage's layers on its own devices.
CACHE_AXES = ("layers", "batch", None, "act_kv_heads", "head_dim")


@dataclasses.dataclass(frozen=True)
class GenerateConfig:
    """Static generation settings (hashable; closed over by the jitted function).

    Attributes:
      max_new_tokens: response slots N per row.
      eos_token_id: a row is finished after emitting it, or any of them when a tuple (Llama-3
        instruct has several stop ids); the EOS itself is part of the response.
      pad_token_id: fills prompt padding and response slots after a row finished.
      temperature: 0 = greedy; log-probs are then reported at temperature 1.
      top_k: 0 = off.
      top_p: 1.0 = off.
      force_max_length: ignore EOS and always emit N tokens (benchmarks measure this way).
    """

    max_new_tokens: int
    eos_token_id: int | tuple[int, ...]
    pad_token_id: int
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    force_max_length: bool = False

    def __post_init__(self):
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        _ = self.sampling  # validates temperature / top_k / top_p
        # Normalise lists (JSON configs) and numpy ints so the config stays hashable.
        eos = self.eos_token_id
        eos = tuple(int(t) for t in eos) if isinstance(eos, (list, tuple)) else int(eos)
        object.__setattr__(self, "eos_token_id", eos)

    @property
    def sampling(self) -> SamplingParams:
        return SamplingParams(self.temperature, self.top_k, self.top_p)

    @property
    def stop_ids(self) -> tuple[int, ...]:
        eos = self.eos_token_id
        return eos if isinstance(eos, tuple) else (eos,)


def draw(logits_bv, keys_b, active_b, cfg: GenerateConfig):
    """One token per row: (token_b (pad_token_id where not active), its log-prob logp_b,
    stopped_b: an active row emitted a stop id (never with force_max_length))."""
    token_b = sample(logits_bv, keys_b, cfg.sampling)
    logp_b = token_logprobs(logits_bv, token_b, cfg.sampling.logprob_temperature)
    token_b = jnp.where(active_b, token_b, cfg.pad_token_id)
    stopped_b = active_b & jnp.isin(token_b, jnp.asarray(cfg.stop_ids))
    return token_b, logp_b, stopped_b & (not cfg.force_max_length)


DECODE_AXES = decode_kv.AXES  # each DecodeKV array's logical axes


def constrain_cache(cache: KVCache | MixedKVCache | tuple[DecodeKV, ...]):
    """The stacked cache (one stack, or a `MixedKVCache`'s two), or each layer's own
    (`decode_layers.split_cache`), sharded alike."""
    if isinstance(cache, MixedKVCache):
        return MixedKVCache(*map(constrain_cache, cache))
    if isinstance(cache, KVCache):
        return KVCache(*(nn.with_logical_constraint(x, CACHE_AXES) for x in cache))
    return tuple(DecodeKV(*(nn.with_logical_constraint(x, axes)
                            for x, axes in zip(c, DECODE_AXES))) for c in cache)


def fresh_cache(model: Transformer, batch: int, length: int) -> KVCache | MixedKVCache:
    """Zeros of a stacked cache of `length` slots in every layer, for `model` to run many
    tokens into at once (a prefill, a recomputation): a `MixedKVCache` whose sliding stack
    holds every slot too where the model runs over its layer pattern's periods (`PeriodScan`;
    `rollout.state.write_prompts` then takes each row's latest slots into the rings)."""
    if isinstance(model.layer_stack, PeriodScan):
        return MixedKVCache.zeros(model.config, batch, length, rings=False)
    return KVCache.zeros(model.config, batch, length)


def prefill(apply, model: Transformer, prompt_tokens_bp, prompt_mask_bp, kv_segment_ids_bs,
            record_routes: bool = False):
    """Runs left-padded prompts [b, P] through `model` (`apply`: its apply on its
    parameters), filling a stacked cache as long as `kv_segment_ids_bs` [b, S]
    (`fresh_cache`); returns (logits_bv float32 [b, vocab]: every row's prediction
    of its first response token, the cache, and with `record_routes` (a model with experts on
    the plain layer scan) the experts every prompt token chose, [b, P, L, k] in
    `replay.route_dtype` (NO_ROUTE on padding), else None)."""
    batch, _ = prompt_tokens_bp.shape
    config = model.config
    positions_bp = jnp.maximum(jnp.cumsum(prompt_mask_bp, axis=1, dtype=jnp.int32) - 1, 0)
    cache = constrain_cache(fresh_cache(model, batch, kv_segment_ids_bs.shape[1]))
    out = apply(prompt_tokens_bp, positions_bp, prompt_mask_bp.astype(jnp.int32), cache, 0,
                kv_segment_ids_bs, last_only=True,
                **({"mutable": ["intermediates"]} if record_routes else {}))
    (logits_b1v, cache), routes_bplk = out if record_routes else (out, None)
    if record_routes:
        routes_bplk = jnp.where(prompt_mask_bp[:, :, None, None],
                                replay.sown_routes(routes_bplk, replay.route_dtype(
                                    config.moe.num_experts)), replay.NO_ROUTE)
    # Left padding: every row's last prompt token is at the last position.
    return logits_b1v[:, 0], constrain_cache(cache), routes_bplk


def decodes_layer_by_layer(platform: Platform, pipelined: bool, fsdp: int,
                           records_routes: bool = False) -> bool:
    """Whether a generate call on such a layout decodes with `decode_layers.LayerByLayer`
    (`decode_model`); `plan.memory` counts the weight copy it holds by the same rule.

    Why: inside the token loop the scanned stack slices every layer's weights and cache out
    of their [L, ...] stacks once per token, and XLA copies each slice (a dot cannot read a
    dynamic slice in place); layer by layer, on weights sliced out once per call, each layer's
    cache is read where it lies (`engine.decode_layers`). Measured faster on XLA:CPU (W-cpu)
    and on XLA:GPU (one H200, Llama-3.2-1B bf16, prompt 512 + 256 decode steps: 1.87 ms a
    step at batch 64 against the scanned stack's 3.68, 4.44 ms at batch 256 against 7.91;
    `benchmarks/gpu_kernels.py --stack=scan,layers`). On TPU not measured: it stays scanned
    there. With fsdp every token all-gathers each layer's weights anyway, and unrolled the
    gathered layers would all be live at once; a pipeline keeps its stages apart. A model
    with experts (`records_routes`, `config_records_routes`) decodes on the plain layer scan:
    it records each token's experts as its layers sow them (routing replay, `engine.replay`),
    which the scan keeps and a LayerStack does not."""
    return (platform in (Platform.CPU, Platform.GPU) and not pipelined and fsdp == 1
            and not records_routes)


def config_records_routes(model_config: ModelConfig) -> bool:
    """Whether generation records each token's experts (`engine.replay`): a model with
    experts."""
    return model_config.moe is not None


def decode_model(model_config: ModelConfig, layout: Layout) -> Transformer:
    """The model a generate call runs on `layout`: its layout's layer stack (a pipeline keeps
    stages apart); `decode_layers.LayerByLayer` where `decodes_layer_by_layer` says so, else
    the scanned stack (on XLA:CPU whatever `scan_layers` says; the parameter tree is the
    same), over periods of the layer pattern where the layers differ in their window
    (`mixed_cache.PeriodScan`: its sliding layers' stack of rings apart from its global
    ones')."""
    stack = layer_stack(layout)
    if decodes_layer_by_layer(layout.platform, stack is not None, layout.strategy.fsdp,
                              config_records_routes(model_config)):
        return Transformer(model_config, LayerByLayer())
    if stack is None and layout.platform is Platform.CPU:  # both stacks copy there: the scan
        model_config = model_config.replace(scan_layers=True)  # keeps one gathered layer live
    if stack is None and splits_cache(model_config):
        stack = PeriodScan.of(model_config)
    return Transformer(model_config, stack)
