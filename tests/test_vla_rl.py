"""vla.rl: GAE / group-relative advantages, the PPO update's guarantees, and real learning.

The learning tests run the whole in-process loop on the real tiny backbone (frozen) and the
Reach2D env: lockstep envs -> one batched backbone forward per step -> ``slot.act`` -> episodes
-> :func:`build_rollout_data` -> :func:`ppo_update`, and compare deterministic-policy returns
on fixed evaluation seeds before and after.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import torch

from schemas.model import HeadConfig, OptimizerConfig
from schemas.tensor import Tensor
from schemas.train import PPOConfig, RolloutBatch
from services.envs.sims import REACH2D_ID, make_env
from vla.backbone import Backbone
from vla.feature import VLAFeature
from vla.heads import DiscreteHead, OFTHead
from vla.normalize import Normaliser
from vla.rl import (
    Episode,
    RolloutData,
    build_rollout_data,
    compute_gae,
    group_relative_advantages,
    log_prob_and_entropy,
    ppo_loss,
    ppo_update,
)
from vla.slot import NonFiniteLossError, TenantSlot

torch.set_num_threads(1)

#: Reach2D at its easiest that still needs an observation: one dot (no distractors). Faster
#: moves and a shorter time limit keep an episode at ~a dozen policy queries (each one a
#: backbone forward), which is what makes the learning test fit its time budget.
ENV_KWARGS: dict[str, Any] = {"num_distractors": 0, "max_speed": 0.2, "max_episode_steps": 20}
HEAD = HeadConfig(kind="oft", action_dim=2, chunk_len=1, proprio_dim=4, value_head=True)
TOKEN_BUDGET = 8  # "reach the <colour> dot" is 8 tokens with the tiny tokenizer
NUM_ENVS = 8
EVAL_SEEDS = list(range(10_000, 10_032))

#: PPO settings that learn within the budget (see the learning test's docstring).
LEARN_CONFIG = PPOConfig(
    algorithm="ppo",
    gamma=0.99,
    gae_lambda=0.8,
    epochs=10,
    minibatch_size=64,
    entropy_coef=0.0,
    episodes_per_iteration=NUM_ENVS,
)
LEARN_ITERATIONS = 20
LEARN_LR = 5e-5
INIT_LOG_STD = -0.5


@pytest.fixture(scope="module")
def backbone() -> Backbone:
    return Backbone.load("tiny")


@pytest.fixture(scope="module")
def normaliser(backbone: Backbone) -> Normaliser:
    return Normaliser(backbone, num_views=1, token_budget=TOKEN_BUDGET)


@pytest.fixture(autouse=True)
def deterministic() -> Iterator[None]:
    torch.use_deterministic_algorithms(True)
    yield
    torch.use_deterministic_algorithms(False)


# -- rollouts --------------------------------------------------------------------------------


@dataclass
class Step:
    """One policy query of one env: the act-time feature row and what the policy did."""

    feature: VLAFeature
    action_C_A: torch.Tensor
    log_prob: float
    value: float
    reward: float


@dataclass
class Rollouts:
    """Episodes collected in lockstep, with the act-time features of all their steps."""

    episodes: list[Episode]
    features: VLAFeature | None  # None for evaluation runs
    returns: list[float]
    successes: list[bool]


def encode(
    backbone: Backbone, normaliser: Normaliser, observations: list[dict[str, Any]]
) -> VLAFeature:
    images_B_V_H_W_3 = np.stack([o["image"] for o in observations])[:, None]
    proprio_B_P = np.stack([o["state"] for o in observations]).astype(np.float32)
    instructions = [str(o["instruction"]) for o in observations]
    return backbone.encode(normaliser.normalise_arrays(images_B_V_H_W_3, instructions, proprio_B_P))


def run_episodes(
    backbone: Backbone,
    normaliser: Normaliser,
    slot: TenantSlot,
    seeds: list[int],
    evaluation: bool = False,
    env_kwargs: dict[str, Any] = ENV_KWARGS,
) -> Rollouts:
    """One episode per seed, all envs in lockstep: per step ONE backbone forward over the
    still-running envs, then ``slot.act`` (sampling with the slot's generator).

    ``evaluation``: act deterministically (the policy's mean/mode, drawing nothing from the
    generator) and keep neither features nor bootstrap values.
    """
    envs = [make_env(REACH2D_ID, **env_kwargs) for _ in seeds]
    obs = [env.reset(seed=s)[0] for env, s in zip(envs, seeds, strict=True)]
    steps: list[list[Step]] = [[] for _ in seeds]
    done = [False] * len(seeds)
    terminated = [False] * len(seeds)
    successes = [False] * len(seeds)
    bootstrap = [0.0] * len(seeds)
    active = list(range(len(seeds)))
    while active:
        feature = encode(backbone, normaliser, [obs[i] for i in active])
        out = slot.act(feature, deterministic=evaluation)
        value_B = out.value_B if out.value_B is not None else torch.zeros(len(active))
        truncated_now = []
        for j, i in enumerate(active):
            # A chunk runs open-loop as one macro-action; its rewards are summed.
            reward = 0.0
            for action_A in out.actions_B_C_A[j]:
                obs[i], r, term, trunc, info = envs[i].step(action_A.numpy())
                reward += float(r)
                if term or trunc:
                    break
            row = VLAFeature(
                feature.prefix_B_T_D[j : j + 1],
                feature.mask_B_T[j : j + 1],
                feature.proprio_B_P[j : j + 1],
            )
            steps[i].append(
                Step(row, out.actions_B_C_A[j], float(out.log_prob_B[j]), float(value_B[j]), reward)
            )
            if term or trunc:
                done[i], terminated[i] = True, bool(term)
                successes[i] = bool(info["is_success"])
                if not term:
                    truncated_now.append(i)
        if truncated_now and not evaluation and slot.module.value_head is not None:
            # Cut off by the time limit: bootstrap from V(s_T) of the final observation.
            with torch.no_grad():
                final_B = slot.module.value(
                    encode(backbone, normaliser, [obs[i] for i in truncated_now])
                )
            for j, i in enumerate(truncated_now):
                bootstrap[i] = float(final_B[j])
        active = [i for i in active if not done[i]]

    episodes = [
        Episode(
            actions_T_C_A=torch.stack([s.action_C_A for s in ep]),
            log_probs_T=torch.tensor([s.log_prob for s in ep]),
            values_T=torch.tensor([s.value for s in ep]),
            rewards_T=torch.tensor([s.reward for s in ep]),
            terminated=terminated[i],
            bootstrap_value=bootstrap[i],
        )
        for i, ep in enumerate(steps)
    ]
    features = None
    if not evaluation:
        # Episode order, then step order: the layout build_rollout_data expects.
        rows = [s.feature for ep in steps for s in ep]
        features = VLAFeature(
            torch.cat([r.prefix_B_T_D for r in rows]),
            torch.cat([r.mask_B_T for r in rows]),
            torch.cat([r.proprio_B_P for r in rows]),
        )
    return Rollouts(
        episodes=episodes,
        features=features,
        returns=[float(ep.rewards_T.sum()) for ep in episodes],
        successes=successes,
    )


def evaluate(
    backbone: Backbone,
    normaliser: Normaliser,
    slot: TenantSlot,
    seeds: list[int],
    env_kwargs: dict[str, Any] = ENV_KWARGS,
) -> np.ndarray:
    """Returns of the deterministic policy on fixed seeds, one episode each, in lockstep."""
    rollouts = run_episodes(backbone, normaliser, slot, seeds, True, env_kwargs)
    return np.array(rollouts.returns)


def centre_seeker_returns(seeds: list[int], env_kwargs: dict[str, Any]) -> np.ndarray:
    """Returns of the best policy that ignores the target: full speed to the arena centre
    (where the target is on average), then stay."""
    returns = []
    for seed in seeds:
        env = make_env(REACH2D_ID, **env_kwargs)
        obs, _ = env.reset(seed=seed)
        total, done = 0.0, False
        while not done:
            to_centre = -obs["state"][:2] / env_kwargs["max_speed"]
            action = to_centre / max(1.0, float(np.abs(to_centre).max()))
            obs, reward, terminated, truncated, _ = env.step(action.astype(np.float32))
            total, done = total + float(reward), terminated or truncated
        returns.append(total)
    return np.array(returns)


def paired_t(after: np.ndarray, before: np.ndarray) -> float:
    """Paired t-statistic of ``after - before`` over the same seeds (0 when identical)."""
    diff = after - before
    se = diff.std(ddof=1) / math.sqrt(len(diff))
    return float(diff.mean() / se) if se > 0 else 0.0


def new_slot(
    backbone: Backbone, head: HeadConfig = HEAD, seed: int = 0, lr: float = 1e-4
) -> TenantSlot:
    return TenantSlot("t", head, OptimizerConfig(lr=lr), backbone.hidden_size, seed=seed)


def oft_head(slot: TenantSlot) -> OFTHead:
    assert isinstance(slot.module, OFTHead)
    return slot.module


def slot_state(slot: TenantSlot) -> dict[str, Any]:
    """Clones of everything an update may touch."""
    return {
        "module": {k: v.clone() for k, v in slot.module.state_dict().items()},
        "optimizer": {
            i: {k: v.clone() for k, v in s.items()}
            for i, s in slot.optimizer.state_dict()["state"].items()
        },
        "rng": slot.generator.get_state().clone(),
        "step": slot.step,
    }


def assert_same_state(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        if isinstance(a[k], dict):
            assert_same_state(a[k], b[k])
        elif isinstance(a[k], torch.Tensor):
            assert torch.equal(a[k], b[k]), k
        else:
            assert a[k] == b[k], k


# -- advantages ------------------------------------------------------------------------------

# By hand, gamma = 0.9, lambda = 0.8 (gamma * lambda = 0.72), rewards (1, 0, 2), values
# (0.5, 1.0, 1.5). Terminated: deltas = (1 + 0.9 - 0.5, 0 + 1.35 - 1, 2 + 0 - 1.5)
# = (1.4, 0.35, 0.5); A2 = 0.5, A1 = 0.35 + 0.72 * 0.5 = 0.71, A0 = 1.4 + 0.72 * 0.71 = 1.9112.
# Truncated with V(s_T) = 2: delta2 = 2 + 1.8 - 1.5 = 2.3; A1 = 0.35 + 0.72 * 2.3 = 2.006;
# A0 = 1.4 + 0.72 * 2.006 = 2.84432.
REWARDS = torch.tensor([1.0, 0.0, 2.0])
VALUES = torch.tensor([0.5, 1.0, 1.5])


def test_gae_matches_hand_computation_for_a_terminated_episode() -> None:
    adv, ret = compute_gae(REWARDS, VALUES, True, 5.0, gamma=0.9, lam=0.8)
    # bootstrap_value is ignored: a terminated episode has no future.
    torch.testing.assert_close(adv, torch.tensor([1.9112, 0.71, 0.5]))
    torch.testing.assert_close(ret, torch.tensor([2.4112, 1.71, 2.0]))


def test_gae_bootstraps_a_truncated_episode_from_the_final_value() -> None:
    adv, ret = compute_gae(REWARDS, VALUES, False, 2.0, gamma=0.9, lam=0.8)
    torch.testing.assert_close(adv, torch.tensor([2.84432, 2.006, 2.3]))
    torch.testing.assert_close(ret, adv + VALUES)


def test_gae_with_lambda_one_and_zero_critic_is_the_discounted_return() -> None:
    adv, _ = compute_gae(REWARDS, torch.zeros(3), True, 0.0, gamma=0.9, lam=1.0)
    torch.testing.assert_close(adv, torch.tensor([1.0 + 0.81 * 2.0, 1.8, 2.0]))


def test_group_relative_advantages_standardise_over_the_group() -> None:
    adv = group_relative_advantages(torch.tensor([1.0, 2.0, 3.0, 6.0]))
    std = math.sqrt(3.5)  # population std of (1, 2, 3, 6) around their mean 3
    torch.testing.assert_close(adv, torch.tensor([-2 / std, -1 / std, 0.0, 3 / std]))
    # No contrast, no signal (and no NaN) for equal returns or a group of one.
    assert torch.equal(group_relative_advantages(torch.full((4,), 7.0)), torch.zeros(4))
    assert torch.equal(group_relative_advantages(torch.tensor([3.0])), torch.zeros(1))


def toy_episode(rewards: list[float], terminated: bool = True) -> Episode:
    T = len(rewards)
    return Episode(
        actions_T_C_A=torch.zeros(T, 1, 2),
        log_probs_T=torch.zeros(T),
        values_T=torch.full((T,), 0.5),
        rewards_T=torch.tensor(rewards),
        terminated=terminated,
        bootstrap_value=0.0 if terminated else 1.0,
    )


def toy_features(n: int) -> VLAFeature:
    return VLAFeature(torch.zeros(n, 3, 8), torch.ones(n, 3), torch.zeros(n, 4))


def test_grpo_gives_every_step_its_episode_advantage_and_no_per_step_renormalisation() -> None:
    episodes = [toy_episode([1.0, 1.0]), toy_episode([0.0, 0.0, 0.0], terminated=False)]
    data = build_rollout_data(toy_features(5), episodes, PPOConfig(algorithm="grpo"))
    # Returns (2, 0): standardised to (+1, -1), broadcast over 2 and 3 steps.
    torch.testing.assert_close(data.advantages_N, torch.tensor([1.0, 1.0, -1.0, -1.0, -1.0]))
    assert data.size == 5 and data.actions_N_C_A.shape == (5, 1, 2)


def test_ppo_advantages_are_gae_normalised_over_the_iteration() -> None:
    episodes = [toy_episode([1.0, 0.0, 2.0]), toy_episode([0.5, 0.5], terminated=False)]
    config = PPOConfig(gamma=0.9, gae_lambda=0.8)
    data = build_rollout_data(toy_features(5), episodes, config)
    raw = torch.cat(
        [
            compute_gae(ep.rewards_T, ep.values_T, ep.terminated, ep.bootstrap_value, 0.9, 0.8)[0]
            for ep in episodes
        ]
    )
    torch.testing.assert_close(data.advantages_N, (raw - raw.mean()) / raw.std())
    torch.testing.assert_close(data.returns_N, raw + 0.5)  # targets are not normalised
    unnormalised = build_rollout_data(
        toy_features(5), episodes, PPOConfig(gamma=0.9, gae_lambda=0.8, normalize_advantages=False)
    )
    torch.testing.assert_close(unnormalised.advantages_N, raw)


def test_build_rollout_data_rejects_mismatched_inputs() -> None:
    episodes = [toy_episode([1.0, 0.0])]
    with pytest.raises(ValueError, match="features hold 3 observations"):
        build_rollout_data(toy_features(3), episodes, PPOConfig())
    with pytest.raises(ValueError, match="algorithm"):
        build_rollout_data(toy_features(2), episodes, PPOConfig(algorithm="a2c"))


def test_episode_from_rollout_batch_reads_the_wire_arrays() -> None:
    T = 3
    f32 = np.float32
    batch = RolloutBatch(
        tenant="t",
        job_id="j",
        iteration=0,
        episode=1,
        policy_version=0,
        images=Tensor.from_numpy(np.zeros((T, 1, 8, 8, 3), np.uint8)),
        instruction="reach the red dot",
        proprio=Tensor.from_numpy(np.zeros((T, 4), f32)),
        actions=Tensor.from_numpy(np.arange(T * 2, dtype=f32).reshape(T, 1, 2)),
        log_probs=Tensor.from_numpy(np.array([-1.0, -2.0, -3.0], f32)),
        values=Tensor.from_numpy(np.array([0.1, 0.2, 0.3], f32)),
        rewards=Tensor.from_numpy(np.array([0.0, 0.5, 1.0], f32)),
        terminated=False,
        truncated=True,
        bootstrap_value=0.7,
    )
    ep = Episode.from_rollout(batch)
    assert ep.length == T and ep.actions_T_C_A.shape == (T, 1, 2)
    assert ep.rewards_T.tolist() == [0.0, 0.5, 1.0] and ep.log_probs_T[2] == -3.0
    assert not ep.terminated and ep.bootstrap_value == pytest.approx(0.7)


# -- the update on real rollouts ---------------------------------------------------------------

UNIT_CONFIG = PPOConfig(epochs=4, minibatch_size=64, entropy_coef=0.01)
UNIT_SEEDS = list(range(500, 508))


@pytest.fixture(scope="module")
def oft_data(backbone: Backbone, normaliser: Normaliser) -> RolloutData:
    """One iteration of rollouts of a fresh seed-0 oft slot (what :func:`new_slot` rebuilds)."""
    rollouts = run_episodes(backbone, normaliser, new_slot(backbone), UNIT_SEEDS)
    assert rollouts.features is not None
    return build_rollout_data(rollouts.features, rollouts.episodes, UNIT_CONFIG)


@pytest.mark.parametrize(
    "head",
    [
        HEAD,
        HeadConfig(kind="discrete", action_dim=2, chunk_len=2, proprio_dim=4, num_bins=16),
        HeadConfig(kind="flow", action_dim=2, chunk_len=1, proprio_dim=4, flow_steps=4),
    ],
    ids=["oft+value", "discrete-chunk2", "flow"],
)
def test_ppo_update_lowers_the_clipped_loss_on_a_fixed_batch(
    backbone: Backbone, normaliser: Normaliser, head: HeadConfig
) -> None:
    # Full-batch steps (one minibatch per epoch): the objective is then one fixed function
    # that every step descends; with small minibatches a step may trade the batch's policy
    # term for its own noise.
    config = PPOConfig(epochs=4, minibatch_size=1024, entropy_coef=0.01)
    slot = new_slot(backbone, head, lr=LEARN_LR)
    rollouts = run_episodes(backbone, normaliser, slot, UNIT_SEEDS[:4])
    assert rollouts.features is not None
    data = build_rollout_data(rollouts.features, rollouts.episodes, config)
    with torch.no_grad():
        before = ppo_loss(slot.module, data, config)
    # Fresh data: the current policy is the collecting policy, so every ratio is 1 (up to the
    # summation order of the log-prob).
    assert float(before.approx_kl) == pytest.approx(0.0, abs=1e-6)
    assert float(before.clip_fraction) == 0.0

    metrics = ppo_update(slot, data, config)
    with torch.no_grad():
        after = ppo_loss(slot.module, data, config)
    assert float(after.total) < float(before.total)
    assert float(after.policy) < float(before.policy)
    assert slot.step == config.epochs and metrics["optimizer_steps"] == config.epochs
    assert metrics["lr"] == pytest.approx(LEARN_LR)
    assert all(math.isfinite(v) for v in metrics.values()), metrics
    assert (metrics["value_loss"] > 0) == (head.value_head is True)


def test_entropy_is_the_closed_form_of_each_head_policy(
    backbone: Backbone, oft_data: RolloutData
) -> None:
    feature, actions = oft_data.features, oft_data.actions_N_C_A
    oft = new_slot(backbone).module
    with torch.no_grad():
        log_prob, entropy = log_prob_and_entropy(oft, feature, actions)
        assert isinstance(oft, OFTHead)
        normal = torch.distributions.Normal(oft.mean(feature), oft.policy.std_A())
        torch.testing.assert_close(log_prob, oft.log_prob(feature, actions))
        torch.testing.assert_close(entropy, normal.entropy().sum(dim=(1, 2)))

        disc = new_slot(backbone, HeadConfig(kind="discrete", action_dim=2, proprio_dim=4)).module
        log_prob, entropy = log_prob_and_entropy(disc, feature, actions)
        assert isinstance(disc, DiscreteHead)
        categorical = torch.distributions.Categorical(logits=disc.logits(feature))
        torch.testing.assert_close(log_prob, disc.log_prob(feature, actions))
        torch.testing.assert_close(entropy, categorical.entropy().sum(dim=(1, 2)))


def test_same_seed_and_data_give_identical_parameters_whatever_the_global_rng(
    backbone: Backbone, oft_data: RolloutData
) -> None:
    a, b, c = new_slot(backbone, seed=0), new_slot(backbone, seed=0), new_slot(backbone, seed=0)
    c.generator.manual_seed(1)  # same weights, another shuffle stream
    torch.manual_seed(123)
    metrics_a = ppo_update(a, oft_data, UNIT_CONFIG)
    torch.manual_seed(456)
    torch.rand(1000)
    metrics_b = ppo_update(b, oft_data, UNIT_CONFIG)
    ppo_update(c, oft_data, UNIT_CONFIG)
    assert metrics_a == metrics_b
    assert_same_state(slot_state(a), slot_state(b))
    # The minibatch order really comes from the slot's own generator.
    params_a, params_c = a.module.state_dict(), c.module.state_dict()
    assert any(not torch.equal(params_a[k], params_c[k]) for k in params_a)


def test_nan_advantages_raise_and_leave_the_slot_untouched(
    backbone: Backbone, oft_data: RolloutData
) -> None:
    slot = new_slot(backbone)
    ppo_update(slot, oft_data, UNIT_CONFIG)  # a slot with optimizer state, mid-training
    before = slot_state(slot)
    bad = oft_data.select(torch.arange(oft_data.size))
    bad.advantages_N[3] = float("nan")
    with pytest.raises(NonFiniteLossError, match="advantages_N"):
        ppo_update(slot, bad, UNIT_CONFIG)
    assert_same_state(slot_state(slot), before)


def test_a_non_finite_loss_mid_update_rolls_back_the_steps_already_taken(
    backbone: Backbone, oft_data: RolloutData
) -> None:
    """A NaN that first shows up in the last minibatch of epoch 1 fails the update after the
    epoch's other minibatches were applied; the slot comes back exactly as before, and the
    next good update is bitwise what a slot that never saw the bad batch does."""
    slot, twin = new_slot(backbone), new_slot(backbone)
    before = slot_state(slot)
    # Find a row the slot's shuffle puts in the last minibatch of the first epoch.
    rng = torch.Generator().manual_seed(0)
    rng.set_state(slot.generator.get_state())
    perm_N = torch.randperm(oft_data.size, generator=rng)
    num_minibatches = math.ceil(oft_data.size / UNIT_CONFIG.minibatch_size)
    assert num_minibatches >= 2
    row = int(torch.tensor_split(perm_N, num_minibatches)[-1][0])
    bad = oft_data.select(torch.arange(oft_data.size))
    bad.features.prefix_B_T_D[row, 0, 0] = float("nan")

    with pytest.raises(NonFiniteLossError, match=f"step {num_minibatches - 1}"):
        ppo_update(slot, bad, UNIT_CONFIG)
    assert_same_state(slot_state(slot), before)
    assert slot.module.state_dict().keys() == twin.module.state_dict().keys()
    ppo_update(slot, oft_data, UNIT_CONFIG)
    ppo_update(twin, oft_data, UNIT_CONFIG)
    assert_same_state(slot_state(slot), slot_state(twin))


# -- learning --------------------------------------------------------------------------------


def train(
    backbone: Backbone,
    normaliser: Normaliser,
    slot: TenantSlot,
    config: PPOConfig,
    iterations: int,
    shared_start: bool = False,
    env_kwargs: dict[str, Any] = ENV_KWARGS,
) -> list[dict[str, float]]:
    """The RL loop: collect ``episodes_per_iteration`` episodes with the current policy (the
    act-time features are the iteration's features: the backbone is frozen), update, publish.

    ``shared_start``: all episodes of an iteration reset with one seed, so they start from the
    same state (a GRPO group: the group mean is then a baseline for that state).
    """
    history = []
    for iteration in range(iterations):
        seeds = [
            1000 * (iteration + 1) + (0 if shared_start else k)
            for k in range(config.episodes_per_iteration)
        ]
        rollouts = run_episodes(backbone, normaliser, slot, seeds, False, env_kwargs)
        assert rollouts.features is not None
        data = build_rollout_data(rollouts.features, rollouts.episodes, config)
        metrics = ppo_update(slot, data, config)
        metrics["return"] = float(np.mean(rollouts.returns))
        history.append(metrics)
        slot.publish_version()
    return history


def learn(
    backbone: Backbone, normaliser: Normaliser, head: HeadConfig, env_kwargs: dict[str, Any]
) -> tuple[np.ndarray, np.ndarray]:
    """PPO from a fresh seed-0 slot with the settings above; deterministic-policy returns on
    :data:`EVAL_SEEDS` before and after (printed with the wall and CPU time)."""
    start, start_cpu = time.perf_counter(), time.process_time()
    slot = new_slot(backbone, head, seed=0, lr=LEARN_LR)
    with torch.no_grad():
        # The head's default log-std (-1, std 0.37) explores too little for 2-D reaching at
        # this budget; std 0.6 learns reliably across slot seeds.
        oft_head(slot).policy.log_std_A.fill_(INIT_LOG_STD)
    before = evaluate(backbone, normaliser, slot, EVAL_SEEDS, env_kwargs)
    history = train(
        backbone, normaliser, slot, LEARN_CONFIG, LEARN_ITERATIONS, env_kwargs=env_kwargs
    )
    after = evaluate(backbone, normaliser, slot, EVAL_SEEDS, env_kwargs)
    wall, cpu = time.perf_counter() - start, time.process_time() - start_cpu
    print(
        f"\nPPO Reach2D {env_kwargs}: eval return {before.mean():+.3f} -> {after.mean():+.3f} "
        f"(paired t {paired_t(after, before):.1f}); training return "
        f"{history[0]['return']:+.3f} -> {history[-1]['return']:+.3f}; {LEARN_ITERATIONS} "
        f"iterations, {slot.step} optimizer steps, {wall:.1f} s wall, {cpu:.1f} s CPU"
    )
    assert all(math.isfinite(v) for m in history for v in m.values())
    assert slot.version == LEARN_ITERATIONS
    return before, after


@pytest.mark.heavy
@pytest.mark.timeout(60)
def test_ppo_learns_reach2d_on_the_frozen_tiny_backbone(
    backbone: Backbone, normaliser: Normaliser
) -> None:
    """PPO on an oft head (+ value head) over the frozen tiny backbone, 20 iterations of 8
    episodes, improves the deterministic policy on 32 fixed evaluation seeds: the paired
    t-statistic of the per-seed return gain exceeds 3 (p < 0.005: not evaluation noise), and
    the policy beats doing nothing (return exactly 0: the progress reward telescopes to
    ``d_0 - d_T``), which the random initial policy does not.

    What it learns: the random-weight tiny backbone's features carry the target's position only
    weakly (a linear probe on them does no better than predicting the mean; supervised L1 on
    the scripted expert plateaus at the "head for the arena centre" policy), so within this
    budget the policy learns from proprio: move towards the centre, where the target is on
    average. That takes the initial policy (about -0.4) to about the blind optimum
    (:func:`centre_seeker_returns`, about +0.46; the scripted expert gets about 2.0).
    """
    before, after = learn(backbone, normaliser, HEAD, ENV_KWARGS)
    assert paired_t(after, before) > 3.0, (before, after)
    assert after.mean() > 0.0 > before.mean(), (before, after)


@pytest.mark.slow  # PPO's learning stays in the default suite: the frozen-backbone test above
@pytest.mark.timeout(60)
def test_ppo_learns_to_use_the_target_when_proprio_carries_it(
    backbone: Backbone, normaliser: Normaliser
) -> None:
    """The same loop and settings with the target's position appended to the state
    (``target_in_state``, proprio 6): the policy must now beat the best target-blind policy
    (the centre-seeker) on the same seeds by a paired t > 3, i.e. PPO learns a policy
    conditioned on the observation, not a bias. (Typically +1.0 to +1.6, 15-65 % success.)"""
    env_kwargs = {**ENV_KWARGS, "target_in_state": True}
    head = HeadConfig(kind="oft", action_dim=2, chunk_len=1, proprio_dim=6, value_head=True)
    before, after = learn(backbone, normaliser, head, env_kwargs)
    blind = centre_seeker_returns(EVAL_SEEDS, env_kwargs)
    print(f"target-blind centre-seeker on the same seeds: {blind.mean():+.3f}")
    assert paired_t(after, blind) > 3.0, (after, blind)
    assert paired_t(after, before) > 3.0, (before, after)


@pytest.mark.timeout(60)
def test_grpo_runs_without_a_critic_and_does_not_collapse(
    backbone: Backbone, normaliser: Normaliser
) -> None:
    config = PPOConfig(algorithm="grpo", epochs=10, episodes_per_iteration=NUM_ENVS)
    slot = new_slot(backbone, seed=0, lr=LEARN_LR)
    with torch.no_grad():
        oft_head(slot).policy.log_std_A.fill_(INIT_LOG_STD)
    value_head = slot.module.value_head
    assert value_head is not None
    critic_before = {k: v.clone() for k, v in value_head.state_dict().items()}
    before = evaluate(backbone, normaliser, slot, EVAL_SEEDS)
    history = train(backbone, normaliser, slot, config, iterations=4, shared_start=True)
    after = evaluate(backbone, normaliser, slot, EVAL_SEEDS)

    assert all(math.isfinite(v) for m in history for v in m.values())
    assert all(m["value_loss"] == 0.0 for m in history)
    # GRPO trains no critic: the value head receives no gradient and does not move.
    for k, v in value_head.state_dict().items():
        assert torch.equal(v, critic_before[k]), k
    # No collapse: the mean return does not fall by more than two standard errors of the
    # starting evaluation (a few noisy iterations may not improve it either).
    assert after.mean() > before.mean() - 2 * before.std(ddof=1) / math.sqrt(len(before))
