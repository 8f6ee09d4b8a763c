"""On-policy RL for one tenant's action module: PPO (GAE) and GRPO (group-relative) updates.

The backbone is frozen, so RL trains only the tenant's head (policy + optional value head) and
the backbone's features of an iteration's observations are computed ONCE and reused by every
PPO epoch. One iteration, as the trainer runs it:

1. collect ``episodes_per_iteration`` episodes (:class:`Episode`, e.g. from ``RolloutBatch``
   messages via :meth:`Episode.from_rollout`) under the current policy version;
2. encode all their ``N = sum(T)`` observations in one (possibly multi-tenant) backbone forward,
   in episode order then step order, giving one :class:`~vla.feature.VLAFeature`;
3. :func:`build_rollout_data` -> advantages (GAE for ``"ppo"``, group-relative for ``"grpo"``)
   and value targets, flattened to ``N`` rows;
4. :func:`ppo_update` -> ``epochs`` passes of shuffled minibatches of the clipped objective.

Conventions:

* A transition is one policy query. A chunked head's ``C`` actions are one macro-action whose
  log-probability is the head's ``log_prob`` over the whole chunk (shape ``(B,)``).
* ``slot.step`` counts optimizer steps (one per minibatch), exactly as supervised training does,
  so the slot's LR schedule (``lr_at(optim_config, slot.step)``) and ``total_steps`` are in
  optimizer steps: an iteration takes ``epochs * ceil(N / minibatch_size)`` of them.
* An update is atomic: if any minibatch yields a non-finite loss or gradient (or anything else
  raises), the slot is restored to exactly its state before :func:`ppo_update` (parameters,
  optimizer moments, RNG, step) and the error propagates; the trainer drops the iteration.
* All randomness (the minibatch shuffle) comes from the slot's own generator, so a tenant's
  update is reproducible and independent of other tenants.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from schemas.tensor import Tensor
from schemas.train import PPOConfig, RolloutBatch
from vla.feature import VLAFeature
from vla.heads import ActionHead, DiscreteHead, FlowHead, OFTHead
from vla.slot import NonFiniteLossError, TenantSlot, lr_at

#: Added to the standard deviation when standardising advantages (avoids 0/0 for equal values).
ADV_EPS = 1e-8
_ALGORITHMS = ("ppo", "grpo")


# -- advantages ------------------------------------------------------------------------------


def compute_gae(
    rewards_T: torch.Tensor,
    values_T: torch.Tensor,
    terminated: bool,
    bootstrap_value: float,
    gamma: float,
    lam: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation for one episode of ``T`` transitions.

    ``values_T`` are the critic's values at collection time. After the last step the value is 0
    if the episode ``terminated`` (a true end) and ``bootstrap_value`` = V(s_T) otherwise (cut
    off by a time limit: the future it did not see still counts). Returns
    ``(advantages_T, returns_T)`` with ``returns_T = advantages_T + values_T`` (the value
    targets, i.e. TD(lambda) returns).
    """
    if rewards_T.shape != values_T.shape or rewards_T.dim() != 1:
        raise ValueError(
            f"rewards_T and values_T must both have shape (T,), got {tuple(rewards_T.shape)} "
            f"and {tuple(values_T.shape)}"
        )
    rewards = rewards_T.tolist()
    values = values_T.tolist()
    advantages = [0.0] * len(rewards)
    next_value = 0.0 if terminated else float(bootstrap_value)
    last_gae = 0.0
    for t in reversed(range(len(rewards))):
        delta = rewards[t] + gamma * next_value - values[t]
        last_gae = delta + gamma * lam * last_gae
        advantages[t] = last_gae
        next_value = values[t]
    advantages_T = torch.tensor(advantages, dtype=values_T.dtype, device=values_T.device)
    return advantages_T, advantages_T + values_T


def discounted_returns(
    rewards_T: torch.Tensor, terminated: bool, bootstrap_value: float, gamma: float
) -> torch.Tensor:
    """Discounted reward-to-go of one episode (bootstrapped from ``bootstrap_value`` unless
    ``terminated``): GAE with ``lambda = 1`` against a zero critic."""
    advantages_T, _ = compute_gae(
        rewards_T, torch.zeros_like(rewards_T), terminated, bootstrap_value, gamma, 1.0
    )
    return advantages_T


def group_relative_advantages(episode_returns_N: torch.Tensor) -> torch.Tensor:
    """GRPO advantages: each episode's return standardised over the episodes of one iteration.

    ``(R - mean) / (std + eps)`` with the population std, so a group of one (or of equal
    returns) gives zeros, not NaN: no contrast, no signal. No value function is involved.
    """
    if episode_returns_N.dim() != 1 or episode_returns_N.numel() == 0:
        raise ValueError(
            f"episode_returns_N must be a non-empty (N,) tensor, got shape "
            f"{tuple(episode_returns_N.shape)}"
        )
    mean = episode_returns_N.mean()
    std = episode_returns_N.std(correction=0)
    return (episode_returns_N - mean) / (std + ADV_EPS)


# -- the iteration batch ---------------------------------------------------------------------


@dataclass
class Episode:
    """One collected episode of ``T`` transitions (what a ``RolloutBatch`` carries, minus the
    observations, which the trainer encodes with the backbone).

    ``actions_T_C_A``: the executed (sampled) action chunks. ``log_probs_T``: their log-prob
    under the collecting policy. ``values_T``: the critic's values at collection (zeros
    without a value head). ``rewards_T``: rewards (a chunk's rewards summed). ``terminated``:
    ended for real (no bootstrap). ``bootstrap_value``: V(s_T) when cut off by a time limit.
    """

    actions_T_C_A: torch.Tensor
    log_probs_T: torch.Tensor
    values_T: torch.Tensor
    rewards_T: torch.Tensor
    terminated: bool
    bootstrap_value: float = 0.0

    @property
    def length(self) -> int:
        return int(self.rewards_T.shape[0])

    @classmethod
    def from_rollout(cls, batch: RolloutBatch) -> Episode:
        """The arrays of a ``RolloutBatch`` message as float32 tensors (copied: the wire
        buffers are read-only)."""

        def tensor(t: Tensor) -> torch.Tensor:
            return torch.from_numpy(np.array(t.to_numpy(), dtype=np.float32))

        return cls(
            actions_T_C_A=tensor(batch.actions),
            log_probs_T=tensor(batch.log_probs),
            values_T=tensor(batch.values),
            rewards_T=tensor(batch.rewards),
            terminated=batch.terminated,
            bootstrap_value=batch.bootstrap_value,
        )


@dataclass
class RolloutData:
    """One iteration's transitions, flattened to ``N`` rows (episode order, then step order).

    ``features``: backbone features of the ``N`` observations, computed once per iteration and
    reused by every epoch (the backbone is frozen). ``old_log_probs_N`` / ``old_values_N``: the
    collecting policy's log-probs and values. ``advantages_N``: (normalised) advantages.
    ``returns_N``: value targets.
    """

    features: VLAFeature
    actions_N_C_A: torch.Tensor
    old_log_probs_N: torch.Tensor
    old_values_N: torch.Tensor
    advantages_N: torch.Tensor
    returns_N: torch.Tensor

    @property
    def size(self) -> int:
        return int(self.advantages_N.shape[0])

    def select(self, idx_M: torch.Tensor) -> RolloutData:
        """The rows ``idx_M`` (a minibatch)."""
        f = self.features
        return RolloutData(
            features=VLAFeature(f.prefix_B_T_D[idx_M], f.mask_B_T[idx_M], f.proprio_B_P[idx_M]),
            actions_N_C_A=self.actions_N_C_A[idx_M],
            old_log_probs_N=self.old_log_probs_N[idx_M],
            old_values_N=self.old_values_N[idx_M],
            advantages_N=self.advantages_N[idx_M],
            returns_N=self.returns_N[idx_M],
        )


def build_rollout_data(
    features: VLAFeature, episodes: Sequence[Episode], config: PPOConfig
) -> RolloutData:
    """Advantages and value targets for one iteration, flattened to match ``features``.

    ``features`` holds the ``N = sum(T)`` observations in episode order, then step order.

    * ``"ppo"``: per-episode GAE(``gamma``, ``gae_lambda``) against the collection-time values;
      targets are the TD(lambda) returns. With ``normalize_advantages`` the advantages are
      standardised over the whole iteration (not per minibatch: small minibatches would make
      the scale noisy).
    * ``"grpo"``: each episode's undiscounted return, standardised over the iteration's episodes
      (:func:`group_relative_advantages`) and given to every step of the episode. That is
      already standardised over episodes, so it is not re-normalised per step (that would
      weight long episodes more and could flip the sign of some). The group mean is a fair
      baseline when the group's episodes start alike (one reset seed / task per iteration:
      the env worker's choice). ``returns_N`` is the discounted reward-to-go, only reported
      (GRPO trains no critic).
    """
    if config.algorithm not in _ALGORITHMS:
        raise ValueError(
            f"PPOConfig.algorithm must be one of {_ALGORITHMS}, got {config.algorithm!r}"
        )
    if not episodes:
        raise ValueError("episodes is empty: an iteration needs at least one episode")
    N = sum(ep.length for ep in episodes)
    if features.batch_size != N:
        raise ValueError(
            f"features hold {features.batch_size} observations but the episodes have {N} steps"
        )
    for i, ep in enumerate(episodes):
        T = ep.length
        shapes = (ep.log_probs_T.shape, ep.values_T.shape, ep.rewards_T.shape)
        if ep.actions_T_C_A.dim() != 3 or ep.actions_T_C_A.shape[0] != T or shapes != ((T,),) * 3:
            raise ValueError(
                f"episodes[{i}]: expected actions (T, C, A) and log_probs/values/rewards (T,) "
                f"with T = {T}, got {tuple(ep.actions_T_C_A.shape)} and "
                f"{[tuple(s) for s in shapes]}"
            )

    device = features.prefix_B_T_D.device
    if config.algorithm == "ppo":
        parts = [
            compute_gae(
                ep.rewards_T.float(),
                ep.values_T.float(),
                ep.terminated,
                ep.bootstrap_value,
                config.gamma,
                config.gae_lambda,
            )
            for ep in episodes
        ]
        advantages_N = torch.cat([adv for adv, _ in parts])
        returns_N = torch.cat([ret for _, ret in parts])
        if config.normalize_advantages and N > 1:
            advantages_N = (advantages_N - advantages_N.mean()) / (advantages_N.std() + ADV_EPS)
    else:
        episode_returns = torch.stack([ep.rewards_T.float().sum() for ep in episodes])
        per_episode = group_relative_advantages(episode_returns)
        advantages_N = torch.cat(
            [a.expand(ep.length) for a, ep in zip(per_episode, episodes, strict=True)]
        )
        returns_N = torch.cat(
            [
                discounted_returns(
                    ep.rewards_T.float(), ep.terminated, ep.bootstrap_value, config.gamma
                )
                for ep in episodes
            ]
        )

    return RolloutData(
        features=features,
        actions_N_C_A=torch.cat([ep.actions_T_C_A for ep in episodes]).float().to(device),
        old_log_probs_N=torch.cat([ep.log_probs_T for ep in episodes]).float().to(device),
        old_values_N=torch.cat([ep.values_T for ep in episodes]).float().to(device),
        advantages_N=advantages_N.to(device),
        returns_N=returns_N.to(device),
    )


# -- the loss --------------------------------------------------------------------------------


def log_prob_and_entropy(
    module: ActionHead, feature: VLAFeature, actions_B_C_A: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(log_prob_B, entropy_B)`` of the head's policy, with one head forward.

    * ``oft`` and ``flow``: diagonal Gaussians with a state-independent learned std (for flow,
      the documented surrogate Gaussian around the deterministic Euler sample), so the entropy
      is closed-form: ``C * sum_A(log std_A + 0.5 * log(2 pi e))``.
    * ``discrete``: the categorical entropy of every (chunk step, action dim), summed.
    """
    B = feature.batch_size
    if isinstance(module, OFTHead | FlowHead):
        log_prob_B = module.log_prob(feature, actions_B_C_A)
        per_dim_A = module.policy.std_A().log() + 0.5 * math.log(2 * math.pi * math.e)
        return log_prob_B, (module.chunk_len * per_dim_A.sum()).expand(B)
    if isinstance(module, DiscreteHead):
        module.check_actions(feature, actions_B_C_A)
        logp_B_C_A_K = torch.log_softmax(module.logits(feature), dim=-1)
        idx_B_C_A = module.bin_index(module.normalise_actions(module._as_param(actions_B_C_A)))
        log_prob_B = logp_B_C_A_K.gather(-1, idx_B_C_A.unsqueeze(-1)).sum(dim=(1, 2, 3))
        entropy_B = -(logp_B_C_A_K.exp() * logp_B_C_A_K).sum(dim=(1, 2, 3))
        return log_prob_B, entropy_B
    raise TypeError(f"no policy entropy for head type {type(module).__name__}")


@dataclass
class PPOLoss:
    """The minibatch objective (``total`` has grad) and its parts (detached)."""

    total: torch.Tensor
    policy: torch.Tensor
    value: torch.Tensor
    entropy: torch.Tensor
    approx_kl: torch.Tensor
    clip_fraction: torch.Tensor


def uses_critic(module: ActionHead, config: PPOConfig) -> bool:
    """Whether the value loss is trained: PPO with a value head (GRPO needs no critic)."""
    return config.algorithm == "ppo" and module.value_head is not None


def ppo_loss(module: ActionHead, batch: RolloutData, config: PPOConfig) -> PPOLoss:
    """Clipped-surrogate PPO loss on ``batch``: ``policy + value_coef * value - entropy_coef *
    entropy``.

    The value loss is plain ``0.5 * (V - R)^2``: value clipping ties the critic's step to the
    policy's ``clip`` in reward units and was found not to help (Andrychowicz et al., 2021).
    It is 0 when the critic is not trained (:func:`uses_critic`).
    """
    new_log_probs_N, entropy_N = log_prob_and_entropy(module, batch.features, batch.actions_N_C_A)
    log_ratio_N = new_log_probs_N - batch.old_log_probs_N
    ratio_N = log_ratio_N.exp()
    adv_N = batch.advantages_N
    # Pessimistic bound: the clipped ratio removes any incentive to move it outside 1 +- clip.
    surrogate_N = torch.max(
        -adv_N * ratio_N, -adv_N * ratio_N.clamp(1.0 - config.clip, 1.0 + config.clip)
    )
    policy_loss = surrogate_N.mean()
    if uses_critic(module, config):
        value_loss = 0.5 * (module.value(batch.features) - batch.returns_N).square().mean()
    else:
        value_loss = torch.zeros((), device=adv_N.device)
    entropy = entropy_N.mean()
    total = policy_loss + config.value_coef * value_loss - config.entropy_coef * entropy
    with torch.no_grad():
        # k3 estimator of KL(old || new): unbiased and always >= 0 (Schulman, "Approximating KL").
        approx_kl = ((ratio_N - 1.0) - log_ratio_N).mean()
        clip_fraction = ((ratio_N - 1.0).abs() > config.clip).float().mean()
    return PPOLoss(
        total=total,
        policy=policy_loss.detach(),
        value=value_loss.detach(),
        entropy=entropy.detach(),
        approx_kl=approx_kl,
        clip_fraction=clip_fraction,
    )


# -- the update ------------------------------------------------------------------------------


@dataclass
class _SlotSnapshot:
    """What :func:`ppo_update` restores on failure."""

    module: dict[str, torch.Tensor]
    optimizer: dict[str, Any]
    rng: torch.Tensor
    step: int

    @classmethod
    def take(cls, slot: TenantSlot) -> _SlotSnapshot:
        return cls(
            module=copy.deepcopy(slot.module.state_dict()),
            optimizer=copy.deepcopy(slot.optimizer.state_dict()),
            rng=slot.generator.get_state(),
            step=slot.step,
        )

    def restore(self, slot: TenantSlot) -> None:
        slot.module.load_state_dict(self.module)
        slot.optimizer.load_state_dict(self.optimizer)
        slot.optimizer.zero_grad(set_to_none=True)
        slot.generator.set_state(self.rng)
        slot.step = self.step


def explained_variance(values_N: torch.Tensor, returns_N: torch.Tensor) -> float:
    """``1 - Var(R - V) / Var(R)``: 1 for a perfect critic, 0 for a constant one; 0 when the
    returns do not vary (undefined, and NaN would poison metric streams)."""
    var_returns = float(returns_N.var(correction=0))
    if var_returns == 0.0:
        return 0.0
    return 1.0 - float((returns_N - values_N).var(correction=0)) / var_returns


def ppo_update(
    slot: TenantSlot,
    data: RolloutData,
    config: PPOConfig,
    schedule_step: int | None = None,
) -> dict[str, float]:
    """``config.epochs`` passes over ``data`` in shuffled minibatches, one optimizer step each.

    Minibatches split each epoch's permutation (drawn from ``slot.generator``) into
    ``ceil(N / minibatch_size)`` near-equal parts, so no tiny remainder batch takes a full
    step. Each step: :func:`ppo_loss`, backward, global-norm clipping to
    ``slot.optim_config.grad_clip`` (0 = off), AdamW at ``lr_at(slot.optim_config, slot.step)``
    — or, with ``schedule_step`` (a schedule sized in iterations), at
    ``lr_at(slot.optim_config, schedule_step)`` for every minibatch — then ``slot.step += 1``.
    The policy version is not bumped here: publishing is the caller's.

    Raises :class:`NonFiniteLossError` for a non-finite input batch, loss or gradient; then (and
    on any other exception) the slot is restored to its state before the call.

    Returns the means over all minibatches of ``policy_loss``, ``value_loss``, ``entropy``,
    ``approx_kl`` and ``clip_fraction``; ``explained_variance`` of the collection-time values;
    the last ``lr``; and ``optimizer_steps``.
    """
    if config.epochs < 1 or config.minibatch_size < 1:
        raise ValueError(
            f"PPOConfig.epochs and minibatch_size must be >= 1, got {config.epochs} and "
            f"{config.minibatch_size}"
        )
    module = slot.module
    N = data.size
    if N == 0:
        raise ValueError("data has no transitions")
    for name in ("advantages_N", "returns_N", "old_log_probs_N"):
        t = getattr(data, name)
        if not bool(torch.isfinite(t).all()):
            raise NonFiniteLossError(slot.tenant, slot.step, name, float(t.sum()))
    num_minibatches = math.ceil(N / config.minibatch_size)
    max_norm = slot.optim_config.grad_clip if slot.optim_config.grad_clip > 0 else math.inf

    snapshot = _SlotSnapshot.take(slot)
    sums = dict.fromkeys(
        ("policy_loss", "value_loss", "entropy", "approx_kl", "clip_fraction"), 0.0
    )
    # The schedule counts what the job's optimizer config counts: RL jobs size it in
    # iterations (``schedule_step``), so every minibatch of one update shares that update's lr.
    lr = lr_at(slot.optim_config, slot.step if schedule_step is None else schedule_step)
    module.train()
    try:
        for _epoch in range(config.epochs):
            perm_N = torch.randperm(N, generator=slot.generator, device=slot.device)
            for idx_M in torch.tensor_split(perm_N.to(data.advantages_N.device), num_minibatches):
                loss = ppo_loss(module, data.select(idx_M), config)
                loss_value = float(loss.total.detach())
                if not math.isfinite(loss_value):
                    raise NonFiniteLossError(slot.tenant, slot.step, "ppo loss", loss_value)
                slot.optimizer.zero_grad(set_to_none=True)
                loss.total.backward()
                grad_norm = float(torch.nn.utils.clip_grad_norm_(module.parameters(), max_norm))
                if not math.isfinite(grad_norm):
                    raise NonFiniteLossError(slot.tenant, slot.step, "grad norm", grad_norm)
                if schedule_step is None:
                    lr = lr_at(slot.optim_config, slot.step)
                for group in slot.optimizer.param_groups:
                    group["lr"] = lr
                slot.optimizer.step()
                slot.step += 1
                sums["policy_loss"] += float(loss.policy)
                sums["value_loss"] += float(loss.value)
                sums["entropy"] += float(loss.entropy)
                sums["approx_kl"] += float(loss.approx_kl)
                sums["clip_fraction"] += float(loss.clip_fraction)
    except BaseException:
        snapshot.restore(slot)
        raise
    finally:
        # Grads only live during a step (the slot's memory accounting assumes so).
        slot.optimizer.zero_grad(set_to_none=True)

    steps = config.epochs * num_minibatches
    metrics = {name: total / steps for name, total in sums.items()}
    metrics["explained_variance"] = explained_variance(data.old_values_N, data.returns_N)
    metrics["lr"] = lr
    metrics["optimizer_steps"] = float(steps)
    return metrics
