"""DAPO (Yu et al. 2025): GRPO without the KL term, with decoupled clip ranges, dynamic sampling,
overlong reward shaping and a token-level loss.

Graph (no reference model: DAPO drops the KL term):
    actor_gen ─► reward ─► actor_train

  clip-higher        the ratio is clipped to [1 − ε_low, 1 + ε_high] with ε_high > ε_low, so
                     unlikely tokens can still gain probability (against entropy collapse).
  token-level loss   every token of the batch weighs the same (`LossAggregation.TOKEN_MEAN`):
                     long responses are not averaged down to one sequence's weight.
  overlong shaping   a response longer than L_max − L_cache tokens loses up to `penalty`:
                     (L_max − L_cache − |y|) / L_cache · penalty, down to −penalty at L_max
                     (L_max = the response budget, rollout.max_new_tokens).
  dynamic sampling   a group whose (shaped) rewards are all equal has zero advantage and gives
                     no gradient; such groups are dropped and the batch refilled with groups
                     that do carry signal. Shapes stay static: a step generates `oversample` ×
                     the groups it trains on (rollout.batch_size prompts, batch_size / oversample
                     groups trained); the informative groups fill the train batch first, in
                     order. When a step has fewer informative groups than the batch holds,
                     flat groups fill the rest with their tokens masked out of the loss (DAPO's
                     reference implementation generates again instead, without a bound).
"""

from __future__ import annotations

import dataclasses
import functools

import jax.numpy as jnp

from jaxrlhf.algorithms import advantages as adv_lib
from jaxrlhf.algorithms import decoupled, losses, ppo
from jaxrlhf.algorithms.registry import (
    Built, Capability, Registration, Request, Section, from_section,
)
from jaxrlhf.algorithms.spec import (
    GEN_KEYS, PPO_CLIP, PPO_UPDATES, PROMPT_KEYS, SEQ_KEYS,
    Algorithm, Metric, Proximal, TrainSpec, model_inputs, clipped_surrogate, policy_readout,
)
from jaxrlhf.mfc import MFC, Call, Role

_ROW_KEYS = ("seq_tokens_bs", "seq_mask_bs", "response_mask_bn", "behav_logp_bn")


@dataclasses.dataclass(frozen=True)
class DAPOConfig:
    """DAPO hyper-parameters.

    Attributes:
      group_size: responses per prompt (G >= 2), on consecutive rows.
      policy: the surrogate: clip_eps (ε_low), clip_eps_high (ε_high), token-level mean.
      overlong_buffer: L_cache in tokens; 0 turns the overlong shaping off.
      overlong_penalty: the shaping's largest penalty (at L_max).
      oversample: groups generated per group trained (1: flat groups are dropped, not refilled).
      mini_batches, epochs: updates per step.
      temperature: generation temperature.
    """

    group_size: int
    policy: losses.PPOLossConfig = losses.PPOLossConfig(clip_eps=0.2, clip_eps_high=0.28)
    overlong_buffer: int = 0
    overlong_penalty: float = 1.0
    oversample: int = 1
    mini_batches: int = 1
    epochs: int = 1
    temperature: float = 1.0

    def __post_init__(self):
        adv_lib.check_group_size("DAPO", self.group_size)
        if self.oversample < 1 or self.overlong_buffer < 0 or self.overlong_penalty < 0:
            raise ValueError(f"DAPO needs oversample >= 1, overlong_buffer >= 0 and "
                             f"overlong_penalty >= 0: {self}")


def mfcs(reward_model: bool) -> tuple[MFC, ...]:
    """The DAPO graph; the reward is a model call or a host function."""
    return (
        MFC("actor_gen", Role.ACTOR, Call.GENERATE, PROMPT_KEYS, GEN_KEYS),
        MFC("reward", Role.REWARD, Call.INFERENCE, SEQ_KEYS + ("answer",), ("scores_b",),
            host=not reward_model),
        MFC("actor_train", Role.ACTOR, Call.TRAIN_STEP, GEN_KEYS + ("scores_b",),
            ("actor_stats",)),
    )


def overlong_penalty(length_b, max_length: int, buffer: int, penalty: float):
    """[b] DAPO's soft overlong penalty: 0 up to max_length − buffer tokens, then falling
    linearly to −penalty at max_length (`buffer` 0: none)."""
    if buffer == 0:
        return jnp.zeros(length_b.shape, jnp.float32)
    over_b = (max_length - buffer - length_b.astype(jnp.float32)) / buffer
    return penalty * jnp.clip(over_b, -1.0, 0.0)


def select_groups(shaped_b, group_size: int, keep: int):
    """Dynamic sampling: `keep` groups, those whose scores differ first (in order), then flat.

    Args:
      shaped_b: [b] rewards; b = groups × group_size, groups on consecutive rows.
      group_size: G.
      keep: groups to return (<= groups).

    Returns:
      (rows [keep × G] int32, indices into b; informative_k [keep] bool, the chosen groups
      that carry signal; informative_frac, the share of all groups that do).
    """
    shaped_gk = shaped_b.reshape(-1, group_size)
    informative_g = jnp.any(shaped_gk != shaped_gk[:, :1], axis=1)
    order_g = jnp.argsort(~informative_g, stable=True)  # informative first, each in order
    chosen_k = order_g[:keep]
    rows = (chosen_k[:, None] * group_size + jnp.arange(group_size)[None, :]).reshape(-1)
    return rows, informative_g[chosen_k], jnp.mean(informative_g.astype(jnp.float32))


def dapo_targets(buf, cfg: DAPOConfig, extra_keys: tuple[str, ...] = ()):
    """The train rows and their advantages.

    Args:
      buf: step buffer: scores_b [b] and the generated rows (`_ROW_KEYS`, [b, ...]);
        b = groups × group_size.
      cfg: the DAPO config.
      extra_keys: more [b, ...] buffer keys to select with the rows (e.g. π_prox's log-probs).

    Returns:
      (rows: the selected rows' `_ROW_KEYS` and `extra_keys` plus advantages_bn and mask_bn
      ([b / oversample, n]; tokens of flat groups masked out), stats).
    """
    mask_bn = buf["response_mask_bn"].astype(jnp.float32)
    length_b = jnp.sum(mask_bn, axis=1)
    scores_b = buf["scores_b"].astype(jnp.float32)
    penalty_b = overlong_penalty(length_b, mask_bn.shape[1], cfg.overlong_buffer,
                                 cfg.overlong_penalty)
    shaped_b = scores_b + penalty_b
    groups = scores_b.shape[0] // cfg.group_size
    keep = groups // cfg.oversample
    rows, informative_k, informative_frac = select_groups(shaped_b, cfg.group_size, keep)
    out = {k: buf[k][rows] for k in _ROW_KEYS + extra_keys}
    advantages_b = adv_lib.group_normalized_advantages(shaped_b[rows], cfg.group_size)
    kept_bn = jnp.repeat(informative_k, cfg.group_size)[:, None] & (mask_bn[rows] > 0)
    out["mask_bn"] = kept_bn.astype(jnp.float32)
    out["advantages_bn"] = adv_lib.broadcast_to_tokens(advantages_b, out["mask_bn"])
    stats = {
        "score": jnp.mean(scores_b),
        "overlong_penalty": jnp.mean(penalty_b),
        "response_length": jnp.mean(length_b),
        "informative_group_frac": informative_frac,  # of the groups generated
        "filled_frac": jnp.mean(informative_k.astype(jnp.float32)),  # of the groups trained
    }
    return out, stats


def _train_batch(buf, controller, cfg: DAPOConfig, extra_keys: tuple[str, ...]):
    del controller  # DAPO has no KL controller
    rows, stats = dapo_targets(buf, cfg, extra_keys)
    batch = model_inputs(rows["seq_tokens_bs"], rows["seq_mask_bs"])
    batch.update({k: rows[k] for k in extra_keys})
    batch.update(advantages_bn=rows["advantages_bn"], mask_bn=rows["mask_bn"],
                 old_logp_bn=rows["behav_logp_bn"])
    return batch, stats


def actor_loss(cfg: DAPOConfig, proximal: Proximal | None = None):
    """The clip-higher surrogate, token-level; with `proximal`, the decoupled one."""
    return clipped_surrogate(cfg.policy, proximal)


def make(cfg: DAPOConfig, *, reward_model: bool, extra_keys: tuple[str, ...] = ()) -> Algorithm:
    """DAPO; `extra_keys`: buffer keys of the generated rows that the train batch carries on,
    selected with them (the mismatch correction's π_prox log-probs)."""
    prepare = lambda buf, controller: _train_batch(buf, controller, cfg, extra_keys)
    return Algorithm(
        name="dapo",
        mfcs=mfcs(reward_model),
        train={Role.ACTOR: TrainSpec(prepare, actor_loss(cfg), cfg.mini_batches, cfg.epochs,
                                     policy_readout(cfg.temperature))},
        temperature=cfg.temperature,
        shown=(Metric("reward"), Metric("filled_frac", Role.ACTOR)),
        oversample=cfg.oversample,
    )


SECTION = Section("dapo", {  # ε_low = ppo.clip_eps, no KL term
    "clip_eps_high": 0.28,  # clip-higher: the ratio's upper bound is 1 + this
    "overlong_buffer": 0,  # L_cache tokens before max_new_tokens; 0 = no overlong shaping
    "overlong_penalty": 1.0,  # the shaping's largest penalty, at max_new_tokens
    # dynamic sampling: rollout.batch_size prompts generated, batch_size / oversample
    # groups trained, those whose rewards are not all equal first (1 = drop, no refill)
    "oversample": 1,
}, bounds=((">=", 1, ("oversample",)), (">=", 0, ("overlong_buffer", "overlong_penalty")),
           (">", 0, ("clip_eps_high",))))


def from_config(config) -> DAPOConfig:
    """DAPO: ε_low, updates and temperature from `ppo`; the rest from `dapo`."""
    d, p, r = config.dapo, ppo.from_config(config), config.rollout
    if r.batch_size % d.oversample:
        raise ValueError(f"dapo.oversample={d.oversample} does not divide rollout.batch_size="
                         f"{r.batch_size} (the prompts generated per step)")
    if d.overlong_buffer >= r.max_new_tokens:
        raise ValueError(f"dapo.overlong_buffer={d.overlong_buffer}: must be < "
                         f"rollout.max_new_tokens={r.max_new_tokens} (the shaping penalises "
                         "the last overlong_buffer tokens: here every response)")
    trained = r.batch_size // d.oversample * r.group_size
    if trained % p.mini_batches:
        raise ValueError(f"ppo.mini_batches={p.mini_batches} does not divide the {trained} "
                         f"rows DAPO trains per step")
    policy = dataclasses.replace(p.policy, clip_eps_high=d.clip_eps_high,
                                 aggregation=losses.LossAggregation.TOKEN_MEAN)
    return from_section(DAPOConfig, d, group_size=r.group_size, policy=policy,
                        mini_batches=p.mini_batches, epochs=p.epochs, temperature=p.temperature)


def _build(request: Request) -> Built:
    cfg = from_config(request.config)
    extra = (decoupled.PROX_KEY,) if request.config.ppo.tis_cap > 0 else ()
    return Built(make(cfg, reward_model=request.reward_model, extra_keys=extra),
                 functools.partial(actor_loss, cfg))


ALGORITHMS = (Registration("dapo", _build, sections=(SECTION,), reads=(*PPO_UPDATES, *PPO_CLIP),
                           capabilities=frozenset({Capability.MISMATCH_CORRECTION})),)
