"""RL iterations on the trainer: turn a job's collected RolloutBatch episodes into one PPO
(or GRPO) update.

All the observations of all the jobs whose iteration is complete go through ONE backbone
forward per compatibility key (the backbone is frozen, so the features are computed once per
iteration and every PPO epoch reuses them); then each job's update runs on its own slot.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import numpy as np
import torch

from schemas.train import PPOConfig, RolloutBatch
from vla.feature import ModelInputs
from vla.grouping import FeatureEncoder, encode_each
from vla.normalize import Normaliser
from vla.rl import Episode, RolloutData, build_rollout_data, ppo_update
from vla.slot import TenantSlot


@dataclass
class Iteration:
    """One job's complete iteration, ready for its update."""

    key: str
    slot: TenantSlot
    normaliser: Normaliser
    config: PPOConfig
    episodes: list[RolloutBatch]
    policy_version: int
    #: Iterations the job has finished: where its learning-rate schedule stands.
    iteration: int = 0


def rollout_stats(episodes: list[RolloutBatch], current_version: int) -> dict[str, float]:
    """What the iteration's rollouts achieved (reported with the update's metrics)."""
    returns = [float(e.rewards.to_numpy().sum()) for e in episodes]
    return {
        "return_mean": float(np.mean(returns)),
        "return_std": float(np.std(returns)),
        "success_rate": float(np.mean([e.success for e in episodes])),
        "episode_length": float(np.mean([e.rewards.shape[0] for e in episodes])),
        "policy_lag_max": float(max(current_version - e.policy_version for e in episodes)),
        "episodes": float(len(episodes)),
    }


def model_inputs(it: Iteration) -> ModelInputs:
    """The iteration's observations (episode order, then step order) as model inputs."""
    images = np.concatenate([e.images.to_numpy() for e in it.episodes])
    proprio = np.concatenate([e.proprio.to_numpy() for e in it.episodes]).astype(np.float32)
    instructions = [e.instruction for e in it.episodes for _ in range(e.rewards.shape[0])]
    if images.shape[0] != len(instructions) or proprio.shape[0] != len(instructions):
        raise ValueError(
            f"rollout observations do not match their transitions: images {images.shape}, "
            f"proprio {proprio.shape}, {len(instructions)} rewards"
        )
    return it.normaliser.normalise_arrays(images, instructions, proprio)


def behaviour_gap(slot: TenantSlot, data: RolloutData) -> float:
    """Mean |log pi(a|s) - recorded log-prob| under the weights the rollouts were collected
    with, before the update: ~0 unless the serving and training paths disagree (features,
    weights, or a stale policy)."""
    with torch.no_grad():
        log_prob_N = slot.module.log_prob(data.features, data.actions_N_C_A)
    return float((log_prob_N - data.old_log_probs_N).abs().mean())


def update_iterations(
    encoder: FeatureEncoder, iterations: list[Iteration]
) -> dict[str, dict[str, float] | Exception]:
    """Grouped features (``encoder``: the backbone, or the backbone role's
    :class:`vla.wire.WireEncoder`), then one PPO update per job. A job's failure is its
    own result."""
    results: dict[str, dict[str, float] | Exception] = {}
    prepared: dict[str, ModelInputs] = {}
    for it in iterations:
        try:
            prepared[it.key] = model_inputs(it)
        except (ValueError, TypeError) as exc:
            results[it.key] = exc
    by_key: dict[object, list[Iteration]] = defaultdict(list)
    for it in iterations:
        if it.key in prepared:
            by_key[prepared[it.key].key].append(it)
    for group in by_key.values():
        # A shared forward that fails is retried one job at a time: only the job whose
        # rollouts are at fault fails.
        features = encode_each(encoder, [prepared[it.key] for it in group])
        for it, feature in zip(group, features, strict=True):
            if isinstance(feature, Exception):
                results[it.key] = feature
                continue
            try:
                episodes = [Episode.from_rollout(e) for e in it.episodes]
                data = build_rollout_data(feature, episodes, it.config)
                gap = behaviour_gap(it.slot, data)
                metrics = ppo_update(it.slot, data, it.config, schedule_step=it.iteration)
                metrics["behaviour_log_prob_gap"] = gap
                metrics.update(rollout_stats(it.episodes, it.policy_version))
                results[it.key] = metrics
            except (ValueError, RuntimeError, FloatingPointError) as exc:
                results[it.key] = exc
    return results
