"""Safe-RLHF (Dai et al. 2023): PPO-Lagrangian with a reward and a cost.

Graph:
    actor_gen ─► reward ───────────┐
              ├► cost ─────────────┤
              ├► ref_inf ──────────┼► actor_train
              ├► critic_inf ───────┼► critic_train
              └► cost_critic_inf ──┴► cost_critic_train

Two models score each response: the reward (helpfulness) and the cost (harm); each has its own
critic (Role.CRITIC for the reward, Role.COST_CRITIC for the cost — Role.COST is the cost
model itself, frozen or a host rule). The actor maximises reward subject to
E[cost] ≤ cost_limit through a Lagrange multiplier λ: its advantage is (A_r − λ·A_c) / (1 + λ),
where A_r is PPO's GAE of the KL-shaped reward and A_c the GAE of the cost. λ lives in the
algorithm's controller state (as log λ) and takes one dual-ascent step per training step on
the step's mean cost, so it grows while the constraint is violated and decays once it holds.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from jaxrlhf.algorithms import advantages as adv_lib
from jaxrlhf.algorithms import kl as kl_lib
from jaxrlhf.algorithms import losses, ppo
from jaxrlhf.algorithms.registry import (
    Built, Capability, Registration, Request, Section, from_section,
)
from jaxrlhf.algorithms.spec import (
    GEN_KEYS, PROMPT_KEYS, SEQ_KEYS, Algorithm, TrainSpec, model_inputs, policy_readout,
)
from jaxrlhf.mfc import MFC, Call, Role
from jaxrlhf.schema import REWARD_KINDS, enum_value

# What every trainer of the step reads.
TRAIN_KEYS = GEN_KEYS + ("ref_logp_bn", "scores_b", "costs_b", "values_bn", "cost_values_bn")


@dataclasses.dataclass(frozen=True)
class SafeRLHFConfig:
    """Safe-RLHF hyper-parameters.

    Attributes:
      ppo: the PPO part (GAE, KL controller, policy and value losses, updates per step); both
        critics use its value loss, and its whitening applies to the combined advantage.
      lagrange: cost limit and the multiplier's initial value, step size and bound.
    """

    ppo: ppo.PPOConfig = ppo.PPOConfig()
    lagrange: losses.LagrangeConfig = losses.LagrangeConfig()


def mfcs(reward_model: bool, cost_model: bool) -> tuple[MFC, ...]:
    """The Safe-RLHF graph; reward and cost are each a model call or a host function."""
    return (
        MFC("actor_gen", Role.ACTOR, Call.GENERATE, PROMPT_KEYS, GEN_KEYS),
        MFC("reward", Role.REWARD, Call.INFERENCE, SEQ_KEYS + ("answer",), ("scores_b",),
            host=not reward_model),
        MFC("cost", Role.COST, Call.INFERENCE, SEQ_KEYS + ("answer",), ("costs_b",),
            host=not cost_model),
        MFC("ref_inf", Role.REF, Call.INFERENCE, SEQ_KEYS, ("ref_logp_bn",)),
        MFC("critic_inf", Role.CRITIC, Call.INFERENCE, SEQ_KEYS, ("values_bn",)),
        MFC("cost_critic_inf", Role.COST_CRITIC, Call.INFERENCE, SEQ_KEYS, ("cost_values_bn",)),
        MFC("actor_train", Role.ACTOR, Call.TRAIN_STEP, TRAIN_KEYS, ("actor_stats",)),
        MFC("critic_train", Role.CRITIC, Call.TRAIN_STEP, TRAIN_KEYS, ("critic_stats",)),
        MFC("cost_critic_train", Role.COST_CRITIC, Call.TRAIN_STEP, TRAIN_KEYS,
            ("cost_critic_stats",)),
    )


def cost_advantages_and_returns(buf, cfg: SafeRLHFConfig):
    """GAE of the cost (charged at the last response token) with the cost critic's values.

    Returns:
      (advantages_bn, returns_bn), [b, n] float32, 0 where masked.
    """
    mask_bn = buf["response_mask_bn"].astype(jnp.float32)
    cost_rewards_bn = buf["costs_b"].astype(jnp.float32)[:, None] * kl_lib.last_token_one_hot(
        mask_bn)
    return adv_lib.gae(cost_rewards_bn, buf["cost_values_bn"], mask_bn, cfg.ppo.gamma,
                       cfg.ppo.lam)


def actor_targets(buf, controller, cfg: SafeRLHFConfig):
    """The Lagrangian advantage of every response token, and the step's stats.

    Args:
      buf: step buffer (TRAIN_KEYS).
      controller: {"kl_coef": β, "log_lambda": log λ}.
      cfg: the Safe-RLHF config.

    Returns:
      ({"advantages_bn": [b, n]}, stats): PPO's stats (score, kl, response_length, returns,
      values) plus cost, cost_values and lambda.
    """
    mask_bn = buf["response_mask_bn"].astype(jnp.float32)
    reward_cfg = dataclasses.replace(cfg.ppo, whiten_advantages=False)
    reward_targets, stats = ppo.advantages_and_returns(buf, controller, reward_cfg)
    cost_advantages_bn, _ = cost_advantages_and_returns(buf, cfg)
    advantages_bn = adv_lib.lagrangian_advantages(
        reward_targets["advantages_bn"], cost_advantages_bn, mask_bn, controller["log_lambda"])
    if cfg.ppo.whiten_advantages:
        advantages_bn = adv_lib.masked_whiten(advantages_bn, mask_bn)
    stats.update(cost=jnp.mean(buf["costs_b"]),
                 cost_values=adv_lib.masked_mean(buf["cost_values_bn"], mask_bn),
                 **{"lambda": jnp.exp(controller["log_lambda"])})
    return {"advantages_bn": advantages_bn}, stats


def _common(buf, controller) -> dict:
    batch = model_inputs(buf["seq_tokens_bs"], buf["seq_mask_bs"])
    batch.update(mask_bn=buf["response_mask_bn"].astype(jnp.float32),
                 old_logp_bn=buf["behav_logp_bn"], ref_logp_bn=buf["ref_logp_bn"],
                 kl_coef=jnp.full(buf["scores_b"].shape, controller["kl_coef"], jnp.float32))
    return batch


def _actor_batch(buf, controller, cfg: SafeRLHFConfig):
    targets, stats = actor_targets(buf, controller, cfg)
    return {**_common(buf, controller), **targets}, stats


def _critic_batch(buf, controller, cfg: SafeRLHFConfig):
    targets, _ = ppo.advantages_and_returns(buf, controller, cfg.ppo)
    batch = _common(buf, controller)
    batch.update(returns_bn=targets["returns_bn"], old_values_bn=buf["values_bn"])
    return batch, {}


def _cost_critic_batch(buf, controller, cfg: SafeRLHFConfig):
    _, returns_bn = cost_advantages_and_returns(buf, cfg)
    batch = _common(buf, controller)
    # The cost critic regresses its own returns with PPO's value loss, under the same keys.
    batch.update(returns_bn=returns_bn, old_values_bn=buf["cost_values_bn"])
    return batch, {}


def update_controller(controller, stats, cfg: SafeRLHFConfig, batch_size: int) -> dict:
    """β by the KL controller; log λ by one dual-ascent step on the step's mean cost."""
    new = kl_lib.update_controller(controller, stats, batch_size, cfg.ppo.kl)
    log_lambda = losses.lagrange_update(controller["log_lambda"], stats["cost"], cfg.lagrange)
    return {**new, "log_lambda": float(log_lambda)}


def make(cfg: SafeRLHFConfig, *, reward_model: bool, cost_model: bool,
         batch_size: int) -> Algorithm:
    p = cfg.ppo
    spec = lambda prepare, loss, readout=None: TrainSpec(
        lambda buf, c: prepare(buf, c, cfg), loss, p.mini_batches, p.epochs, readout)
    return Algorithm(
        name="safe_rlhf",
        mfcs=mfcs(reward_model, cost_model),
        train={
            Role.ACTOR: spec(_actor_batch, ppo.actor_loss(p), policy_readout(p.temperature)),
            Role.CRITIC: spec(_critic_batch, ppo.critic_loss(p)),
            Role.COST_CRITIC: spec(_cost_critic_batch, ppo.critic_loss(p)),
        },
        controller_init={"kl_coef": p.kl.init_kl_coef,
                         "log_lambda": float(losses.lagrange_init(cfg.lagrange))},
        controller_update=lambda c, s: update_controller(c, s, cfg, batch_size),
        temperature=p.temperature,
    )


SECTIONS = (
    Section("safe_rlhf", {  # Lagrangian constraint E[cost] <= cost_limit
        "cost_limit": 0.0, "lambda_init": 1.0, "lambda_lr": 0.1,
        "lambda_max": 0.0,  # 0 = unbounded
    }),
    Section("cost", {  # the cost (higher = worse), like `reward`; model = models.cost
        "kind": "function",  # function | model
        "function": "jaxrlhf.data.costs:contains_nine",  # "module.path:function" etc.
        "timeout": 5.0,
        "workers": 1,
        "max_error_rate": 0.5,
    }, bounds=((">=", 0, ("max_error_rate",)), ("<=", 1, ("max_error_rate",)))),
)


def from_config(config) -> SafeRLHFConfig:
    """PPO's settings and the `safe_rlhf` section's constraint."""
    s = config.safe_rlhf
    lagrange = from_section(losses.LagrangeConfig, s, lambda_max=s.lambda_max or None)
    return SafeRLHFConfig(ppo=ppo.from_config(config), lagrange=lagrange)


def _build(request: Request) -> Built:
    cost_model = enum_value(REWARD_KINDS, request.config.cost.kind, "cost.kind")
    return Built(make(from_config(request.config), reward_model=request.reward_model,
                      cost_model=cost_model, batch_size=request.rows))


ALGORITHMS = (Registration("safe_rlhf", _build, sections=SECTIONS, reads=("ppo",),
                           capabilities=frozenset({Capability.CRITIC})),)
