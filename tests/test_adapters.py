"""Env adapters: our Reach2D sims and ManiSkill3 tasks (CPU physics, software Vulkan) behind one
interface. The ManiSkill tests need `scripts/setup-maniskill.sh` to have run (the Makefile's
install step does it) and fail, not skip, when it has not."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from bus.local import StackInfo
from services.envs import maniskill
from services.envs.adapters import (
    EnvAdapter,
    EnvUnavailableError,
    GymDictAdapter,
    StepObs,
    make_adapter,
)
from services.envs.maniskill import MANISKILL_TASKS, ManiSkillAdapter, ManiSkillTask
from services.envs.sims import REACH2D_ID, REACH_GRASP_ID
from services.launcher import LocalStack
from tests.helpers import ROOT


def _assert_step_obs(obs: StepObs, adapter: EnvAdapter, image_size: int) -> None:
    assert len(obs.images) == adapter.num_views
    for image in obs.images:
        assert image.shape == (image_size, image_size, 3) and image.dtype == np.uint8
    assert obs.proprio.shape == (adapter.proprio_dim,) and obs.proprio.dtype == np.float32
    assert np.isfinite(obs.proprio).all()
    assert obs.instruction


def _rollout(adapter: EnvAdapter, seed: int, actions_T_A: np.ndarray) -> list[StepObs]:
    observations = [adapter.reset(seed)]
    for action_A in actions_T_A:
        obs, *_ = adapter.step(action_A)
        observations.append(obs)
    return observations


def _same(a: list[StepObs], b: list[StepObs]) -> bool:
    return all(
        x.instruction == y.instruction
        and np.array_equal(x.proprio, y.proprio)
        and all(np.array_equal(i, j) for i, j in zip(x.images, y.images, strict=True))
        for x, y in zip(a, b, strict=True)
    )


# -- our sims -----------------------------------------------------------------------------------


def test_reach2d_adapter_layout_expert_and_time_limit() -> None:
    adapter = make_adapter(REACH2D_ID, image_size=32, max_episode_steps=4)
    assert isinstance(adapter, GymDictAdapter)
    assert (adapter.action_dim, adapter.proprio_dim, adapter.num_views) == (2, 4, 1)
    obs = adapter.reset(seed=0)
    _assert_step_obs(obs, adapter, 32)
    assert obs.instruction.startswith("reach the ")
    # A random walk from this seed does not reach the target in 4 steps, so the limit ends it.
    rng = np.random.default_rng(0)
    for t in range(4):
        expert_A = adapter.expert_action()
        assert expert_A is not None and expert_A.shape == (2,) and expert_A.dtype == np.float32
        obs, reward, terminated, truncated, info = adapter.step(rng.uniform(-0.2, 0.2, 2))
        _assert_step_obs(obs, adapter, 32)
        assert isinstance(reward, float) and info["is_success"] is False
        assert not terminated and truncated == (t == 3)
    adapter.close()


def test_reach2d_expert_through_the_adapter_succeeds() -> None:
    adapter = make_adapter(REACH2D_ID)
    adapter.reset(seed=5)
    for _ in range(50):
        expert_A = adapter.expert_action()
        assert expert_A is not None
        _, _, terminated, truncated, info = adapter.step(expert_A)
        if terminated or truncated:
            break
    assert terminated and info["is_success"] is True


def test_reach2d_same_seed_same_episode_and_seeds_differ() -> None:
    adapter = make_adapter(REACH2D_ID)
    actions_T_A = np.random.default_rng(1).uniform(-1, 1, (5, 2))
    first = _rollout(adapter, 7, actions_T_A)
    assert _same(first, _rollout(adapter, 7, actions_T_A))
    assert not _same(first, _rollout(adapter, 8, actions_T_A))


def test_reach_grasp_has_a_gripper_dimension() -> None:
    adapter = make_adapter(REACH_GRASP_ID)
    assert adapter.action_dim == 3
    adapter.reset(seed=0)
    expert_A = adapter.expert_action()
    assert expert_A is not None and expert_A.shape == (3,)


def test_actions_are_clipped_and_checked() -> None:
    adapter = make_adapter(REACH2D_ID)
    adapter.reset(seed=2)
    clipped, *_ = adapter.step(np.array([1.0, -1.0]))
    adapter.reset(seed=2)
    huge, *_ = adapter.step(np.array([50.0, -50.0]))
    np.testing.assert_array_equal(clipped.proprio, huge.proprio)
    with pytest.raises(ValueError, match="shape"):
        adapter.step(np.zeros(3))
    with pytest.raises(ValueError, match="finite"):
        adapter.step(np.array([np.nan, 0.0]))


def test_gym_env_without_dict_image_state_observation_is_refused() -> None:
    with pytest.raises(EnvUnavailableError, match=r"CartPole-v1.*'image'"):
        make_adapter("CartPole-v1")


def test_unknown_id_names_the_supported_ones(maniskill_home: Path) -> None:
    # An unknown id imports ManiSkill to learn whether it is a ManiSkill task.
    with pytest.raises(EnvUnavailableError) as excinfo:
        make_adapter("NoSuchEnv-v9")
    message = str(excinfo.value)
    assert "NoSuchEnv-v9" in message
    assert REACH2D_ID in message and all(task in message for task in MANISKILL_TASKS)


def test_the_local_stack_gives_its_roles_a_maniskill_asset_dir_under_home(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # ManiSkill reads MS_ASSET_DIR once, at import: the launcher passes it in each child's
    # environment (nothing sets it in a running process), unless the operator chose one.
    stack = LocalStack(tmp_path / "home")
    stack.info = StackInfo("nats://127.0.0.1:4222", 1, user="u", password="p")
    monkeypatch.delenv("MS_ASSET_DIR", raising=False)
    assert stack.child_env()["MS_ASSET_DIR"] == str((tmp_path / "home").resolve() / "maniskill")
    assert "MS_SKIP_ASSET_DOWNLOAD_PROMPT" not in stack.child_env()
    monkeypatch.setenv("MS_ASSET_DIR", str(tmp_path / "explicit"))
    assert stack.child_env()["MS_ASSET_DIR"] == str(tmp_path / "explicit")


# -- ManiSkill3 ---------------------------------------------------------------------------------

PUSH_CUBE_STEPS = 8


@pytest.fixture(scope="module")
def push_cube(maniskill_home: Path) -> Iterator[ManiSkillAdapter]:
    """One PushCube env for the module: building one costs seconds, resetting it milliseconds."""
    adapter = make_adapter("PushCube-v1", image_size=64, max_episode_steps=PUSH_CUBE_STEPS)
    assert isinstance(adapter, ManiSkillAdapter)
    yield adapter
    adapter.close()


@pytest.mark.maniskill
def test_push_cube_layout(push_cube: ManiSkillAdapter) -> None:
    assert push_cube.control_mode == "pd_ee_delta_pos"
    # xyz end-effector delta + gripper; qpos(9) + qvel(9) + tcp pose(7).
    assert (push_cube.action_dim, push_cube.proprio_dim, push_cube.num_views) == (4, 25, 1)
    assert push_cube.proprio_keys == ("agent/qpos", "agent/qvel", "extra/tcp_pose")


@pytest.mark.maniskill
def test_push_cube_reset_and_random_steps(push_cube: ManiSkillAdapter) -> None:
    obs = push_cube.reset(seed=0)
    _assert_step_obs(obs, push_cube, 64)
    assert obs.instruction == "push the cube to the goal region"
    assert obs.images[0].std() > 5  # a rendered scene, not a blank frame
    rng = np.random.default_rng(0)
    for t in range(PUSH_CUBE_STEPS):
        obs, reward, terminated, truncated, info = push_cube.step(rng.uniform(-1, 1, 4))
        _assert_step_obs(obs, push_cube, 64)
        assert isinstance(reward, float) and np.isfinite(reward)
        assert isinstance(terminated, bool) and isinstance(truncated, bool)
        assert isinstance(info["is_success"], bool) and info["elapsed_steps"] == t + 1
        if terminated:
            break
    assert truncated or terminated


@pytest.mark.maniskill
def test_push_cube_same_seed_same_episode_on_cpu(push_cube: ManiSkillAdapter) -> None:
    actions_T_A = np.random.default_rng(3).uniform(-1, 1, (4, 4))
    first = _rollout(push_cube, 11, actions_T_A)
    assert _same(first, _rollout(push_cube, 11, actions_T_A))
    assert not _same(first, _rollout(push_cube, 12, actions_T_A))


@pytest.mark.maniskill
def test_an_env_built_after_another_closed_renders_the_same_episode(maniskill_home: Path) -> None:
    """The process keeps a render system alive so that a later build skips SAPIEN's shader
    compilation (~12 s each otherwise); an env built on it sees what the first one saw."""
    actions_T_A = np.random.default_rng(5).uniform(-1, 1, (3, 4))
    episodes = []
    for _ in range(2):
        adapter = make_adapter("PushCube-v1", image_size=32, max_episode_steps=8)
        try:
            episodes.append(_rollout(adapter, 21, actions_T_A))
        finally:
            adapter.close()
    assert "cpu" in maniskill._kept_renderers
    assert _same(episodes[0], episodes[1])
    assert episodes[0][-1].images[0].any()  # rendered, not a blank frame


@pytest.mark.maniskill
def test_push_cube_actions_are_clipped(push_cube: ManiSkillAdapter) -> None:
    push_cube.reset(seed=4)
    clipped, *_ = push_cube.step(np.array([1.0, -1.0, 1.0, -1.0]))
    push_cube.reset(seed=4)
    huge, *_ = push_cube.step(np.array([9.0, -9.0, 9.0, -9.0]))
    np.testing.assert_array_equal(clipped.proprio, huge.proprio)
    with pytest.raises(ValueError, match="shape"):
        push_cube.step(np.zeros(8))


@pytest.mark.maniskill
def test_push_cube_step_time(push_cube: ManiSkillAdapter) -> None:
    push_cube.reset(seed=0)
    seconds = []
    for _ in range(5):
        start = time.perf_counter()
        push_cube.step(np.zeros(4))
        seconds.append(time.perf_counter() - start)
    # ~40 ms on an idle 2-core machine with Mesa llvmpipe; the bound only catches a broken
    # (e.g. non-accelerated fallback or per-step rebuild) setup on a busy CI machine.
    median = float(np.median(seconds))
    assert median < 1.0, f"PushCube 64x64 RGB step took {median * 1000:.0f} ms (median of 5)"


@pytest.mark.maniskill
def test_pick_cube_builds_with_goal_in_proprio(maniskill_home: Path) -> None:
    adapter = make_adapter("PickCube-v1")
    try:
        # qpos(9) + qvel(9) + is_grasped(1) + tcp pose(7) + goal position(3).
        assert (adapter.action_dim, adapter.proprio_dim) == (4, 29)
        _assert_step_obs(adapter.reset(seed=0), adapter, 64)
    finally:
        adapter.close()


@pytest.mark.maniskill
def test_asset_needing_task_fails_fast_with_a_clear_message(
    push_cube: ManiSkillAdapter, maniskill_home: Path
) -> None:
    # push_cube has imported ManiSkill already: the timing below is the refusal alone.
    start = time.perf_counter()
    with pytest.raises(EnvUnavailableError, match=r"PickSingleYCB-v1 needs assets.*ycb"):
        make_adapter("PickSingleYCB-v1")
    assert time.perf_counter() - start < 5.0
    assert not any(maniskill_home.iterdir()), "nothing may be downloaded"


@pytest.mark.maniskill
def test_unvetted_maniskill_task_is_refused(push_cube: ManiSkillAdapter) -> None:
    with pytest.raises(EnvUnavailableError, match=r"PokeCube-v1 is not vetted.*PushCube-v1"):
        make_adapter("PokeCube-v1")


@pytest.mark.maniskill
def test_a_download_prompt_we_fail_to_foresee_fails_fast_and_downloads_nothing(
    push_cube: ManiSkillAdapter, maniskill_home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Pretend an asset-needing task were vetted and our asset check missed its assets:
    # ManiSkill's own prompt is reached, reads our closed stdin, and the build is refused.
    monkeypatch.setitem(
        MANISKILL_TASKS, "PickSingleYCB-v1", ManiSkillTask("pick up the object", "pd_ee_delta_pos")
    )
    monkeypatch.setattr(maniskill, "_missing_assets", lambda env_id: [])
    start = time.perf_counter()
    with pytest.raises(EnvUnavailableError, match=r"asked to download assets for PickSingleYCB"):
        make_adapter("PickSingleYCB-v1")
    assert time.perf_counter() - start < 5.0
    assert not any(maniskill_home.iterdir()), "nothing may be downloaded"


@pytest.mark.maniskill
def test_concurrent_first_imports_of_maniskill_all_see_its_tasks() -> None:
    """Two describes building at once (each in its own thread) must both find ManiSkill's
    task registry filled: a half-imported ``mani_skill.envs`` once made PullCube-v1 "not a
    ManiSkill task" for the second one. Needs a fresh interpreter (the import is once per
    process)."""
    script = (
        "import threading, time\n"
        "from services.envs import maniskill as m\n"
        "seen = []\n"
        "def build(e, after):\n"
        "    time.sleep(after)  # arrive while the first import is under way\n"
        "    m.import_maniskill()  # what ManiSkillAdapter does first\n"
        "    seen.append(m._is_maniskill_id(e))\n"
        "ts = [threading.Thread(target=build, args=(e, i * 0.3)) for i, e in enumerate(\n"
        "      ('PushCube-v1', 'PullCube-v1', 'PickCube-v1', 'StackCube-v1', 'PushT-v1'))]\n"
        "[t.start() for t in ts]\n"
        "[t.join() for t in ts]\n"
        "print(sorted(seen))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", script],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        stdin=subprocess.DEVNULL,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[True, True, True, True, True]"


def _grasping_episode(adapter: ManiSkillAdapter, seed: int, noise_seed: int) -> list[StepObs]:
    """16 steps that drive the gripper onto the cube and close it (contacts: what a plain
    reset does not clear), with some noise."""
    rng = np.random.default_rng(noise_seed)
    observations = [adapter.reset(seed)]
    task = adapter.env.unwrapped
    for t in range(16):
        cube = task.cube.pose.p[0].cpu().numpy()  # type: ignore[attr-defined]
        tcp = task.agent.tcp.pose.p[0].cpu().numpy()  # type: ignore[attr-defined]
        action_A = rng.uniform(-1, 1, 4)
        action_A[:3] = np.clip((cube - tcp) * 10, -1, 1) + 0.3 * action_A[:3]
        action_A[3] = 1.0 if t < 8 else -1.0
        obs, *_ = adapter.step(action_A)
        observations.append(obs)
    return observations


@pytest.mark.maniskill
@pytest.mark.heavy
def test_a_pick_cube_episode_depends_on_its_seed_not_on_what_the_env_ran_before(
    maniskill_home: Path,
) -> None:
    """Env workers reuse their envs across tasks and tenants; a re-run task (or the same job
    alone and shared) must see the same episodes. A plain reset leaves PickCube's physics
    state behind, so the env rebuilds its scene at every reset."""
    fresh = make_adapter("PickCube-v1", image_size=64, max_episode_steps=16)
    used = make_adapter("PickCube-v1", image_size=64, max_episode_steps=16)
    assert isinstance(fresh, ManiSkillAdapter) and isinstance(used, ManiSkillAdapter)
    try:
        assert used.rebuild_on_reset
        references = [_grasping_episode(fresh, 500 + k, k) for k in range(2)]
        differed: dict[bool, int] = {}
        for rebuild in (False, True):
            used.rebuild_on_reset = rebuild
            differed[rebuild] = 0
            for k, reference in enumerate(references):
                for h in range(1):  # another grasp first: the history a plain reset keeps
                    _grasping_episode(used, 900 + 3 * k + h, 100 + k + h)
                differed[rebuild] += not _same(reference, _grasping_episode(used, 500 + k, k))
        assert differed[True] == 0, "episodes differ after other episodes ran in their env"
        # The control: without the rebuild these histories do change episodes.
        assert differed[False] > 0
        # Two envs stepped from two threads at once (an env worker's tasks): the calls take
        # turns (maniskill_call's lock), and each episode is the one stepped alone.
        got: dict[int, list[StepObs]] = {}

        def run(adapter: ManiSkillAdapter, k: int) -> None:
            got[k] = _grasping_episode(adapter, 500 + k, k)

        threads = [threading.Thread(target=run, args=(a, k)) for k, a in enumerate((fresh, used))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        assert all(_same(references[k], got[k]) for k in (0, 1))
    finally:
        fresh.close()
        used.close()
