"""Jobs that fit their env: ``env describe`` locally, through the bus and the SDK, and the
master's check of a spec's head against the env's description at submit (real nats-server,
real sims)."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import pytest_asyncio
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.errors import TimeoutError as NatsTimeoutError

import services.envs.describe as describe_module
from bench.cli import main as joynexus
from bus.auth import any_inbox, query_reply_allowed
from bus.codec import decode, encode
from bus.connect import connect
from bus.declare import declare
from bus.envinfo import EnvDescribeError, request_description
from bus.errors import PoisonError, RetryableError
from bus.server import EmbeddedServer
from clients.sdk import Client
from schemas import subjects
from schemas.envdesc import DescribeEnv, DescribeReply
from schemas.jobs import JobSubmit
from schemas.train import TRAIN_DECODER, OpenSlot
from services.envs.adapters import ProprioMismatchError, proprio_for_head
from services.envs.describe import Describer, cache_key, describe_env, format_description
from services.master.envfit import EnvDescriptions
from services.master.service import Master
from tests.helpers import eventually, uid

REACH = "JoyNexus/Reach2D-v0"


# -- the description itself ---------------------------------------------------------------------


def test_reach2d_description_names_action_proprio_cameras_limit_and_instruction() -> None:
    d = describe_env(REACH, {"target_in_state": True}, image_size=32)
    assert d.action.dim == 2 and d.action.low == [-1.0, -1.0] and d.action.high == [1.0, 1.0]
    assert d.action.control_mode == "velocity"
    assert d.proprio_dim == 6
    assert [p.name for p in d.proprio_layout] == ["x", "y", "vx", "vy", "target_x", "target_y"]
    assert [(c.name, c.height, c.width) for c in d.cameras] == [("image", 32, 32)]
    assert d.max_episode_steps == 50
    assert d.instruction == "reach the {colour} dot"
    grasp = describe_env("JoyNexus/ReachGrasp2D-v0")
    assert (grasp.action.dim, grasp.proprio_dim) == (3, 4)
    assert grasp.action.control_mode == "velocity+gripper"


def test_cli_env_describe_prints_the_layout(capsys: pytest.CaptureFixture[str]) -> None:
    assert joynexus(["env", "describe", REACH, "--kwargs", '{"num_distractors": 0}']) == 0
    out = capsys.readouterr().out
    assert "action:        dim 2, control mode velocity" in out
    assert "proprio:       dim 4: x, y, vx, vy" in out
    assert "cameras:       1: image 64x64" in out and "episode limit: 50 steps" in out


def test_cli_env_describe_of_an_unknown_env_names_the_supported_ones(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert joynexus(["env", "describe", "Nope-v0"]) == 2
    err = capsys.readouterr().err
    assert "unknown env id 'Nope-v0'" in err and REACH in err


def test_proprio_is_all_or_nothing_never_truncated() -> None:
    proprio = np.arange(4, dtype=np.float32)
    assert proprio_for_head(proprio, 4).tolist() == [0, 1, 2, 3]
    assert proprio_for_head(proprio, 0).shape == (0,)
    # A dataset batch (B, P) keeps its rows (the SFT stream sends one per sample).
    assert proprio_for_head(np.zeros((2, 4), dtype=np.float32), 0).shape == (2, 0)
    with pytest.raises(ProprioMismatchError, match=r"proprio_dim 2 does not match .* 4"):
        proprio_for_head(proprio, 2)


# -- ManiSkill ------------------------------------------------------------------------------------


@pytest.mark.maniskill
def test_push_cube_description(maniskill_home: Path) -> None:
    d = describe_env("PushCube-v1")
    assert (d.action.dim, d.action.control_mode) == (4, "pd_ee_delta_pos")
    assert d.proprio_dim == 25 == sum(p.size for p in d.proprio_layout)
    assert [p.name for p in d.proprio_layout] == ["agent/qpos", "agent/qvel", "extra/tcp_pose"]
    assert [(c.name, c.height) for c in d.cameras] == [("base_camera", 64)]
    assert d.max_episode_steps == 50
    assert d.instruction == "push the cube to the goal region"


@pytest.mark.maniskill
def test_push_cube_task_extras_are_offered_and_added_to_the_proprio_on_request(
    maniskill_home: Path,
) -> None:
    from services.envs.adapters import make_adapter

    plain = describe_env("PushCube-v1", image_size=32)
    assert [(p.name, p.size) for p in plain.proprio_extras] == [("cube_pose", 7), ("goal_xyz", 3)]
    assert "task extras:   cube_pose[7], goal_xyz[3]" in format_description(plain)
    adapter = make_adapter("PushCube-v1", image_size=32, proprio_extras="goal_xyz, cube_pose")
    try:
        assert adapter.proprio_dim == 25 + 3 + 7
        assert adapter.proprio_keys[-2:] == ("task/goal_xyz", "task/cube_pose")  # type: ignore[attr-defined]
        obs = adapter.reset(seed=3)
        for _ in range(3):
            obs, *_ = adapter.step(np.array([0.5, 0.2, -0.3, -1.0], np.float32))
        truth = adapter.privileged_state()
        assert truth is not None
        np.testing.assert_allclose(obs.proprio[25:28], truth["goal_xyz"], atol=1e-6)
        np.testing.assert_allclose(obs.proprio[28:31], truth["cube_xyz"], atol=1e-6)
        assert abs(np.linalg.norm(obs.proprio[31:35]) - 1.0) < 1e-4  # a unit quaternion
        assert obs.proprio.shape == (35,) and obs.proprio.dtype == np.float32
    finally:
        adapter.close()
    with pytest.raises(ValueError, match="has no task extra obj_vel; it offers: cube_pose"):
        make_adapter("PushCube-v1", image_size=32, proprio_extras="obj_vel")
    with pytest.raises(ValueError, match="given twice"):
        make_adapter("PushCube-v1", image_size=32, proprio_extras="goal_xyz,goal_xyz")
    with pytest.raises(ValueError, match="Reach2D-v0 offers no task extras"):
        make_adapter(REACH, proprio_extras="goal_xyz")


@pytest.mark.maniskill
def test_pick_cube_so100_description(maniskill_home: Path) -> None:
    d = describe_env("PickCubeSO100-v1", image_size=32)
    assert (d.action.dim, d.action.control_mode) == (6, "pd_joint_delta_pos")
    assert len(d.action.low) == 6
    assert d.proprio_dim == 23 == sum(p.size for p in d.proprio_layout)
    assert "extra/goal_pos" in [p.name for p in d.proprio_layout]
    assert [(c.name, c.height, c.width) for c in d.cameras] == [("base_camera", 32, 32)]


# -- over the bus ---------------------------------------------------------------------------------


@pytest_asyncio.fixture
async def own_nc(fresh_server: EmbeddedServer) -> AsyncIterator[NATS]:
    """A server of this test alone: no other test's env worker answers describe here."""
    nc = await connect(fresh_server.url, name="pytest-describe")
    await declare(nc.jetstream())
    yield nc
    await nc.close()


@pytest_asyncio.fixture
async def describer(own_nc: NATS) -> AsyncIterator[Describer]:
    d = Describer()
    await d.subscribe(own_nc)
    yield d
    await d.close()


async def test_bus_describe_matches_the_local_one_and_is_cached(
    own_nc: NATS, describer: Describer
) -> None:
    got = await request_description(own_nc, REACH, {"target_in_state": True})
    assert got == describe_env(REACH, {"target_in_state": True})
    assert len(describer.cache) == 1
    assert await request_description(own_nc, REACH, {"target_in_state": True}) == got
    assert len(describer.cache) == 1


async def test_bus_describe_of_an_unknown_env_is_a_clear_non_retryable_error(
    own_nc: NATS, describer: Describer
) -> None:
    with pytest.raises(EnvDescribeError) as info:
        await request_description(own_nc, "Nope-v0")
    assert not info.value.retryable
    assert "unknown env id 'Nope-v0'" in str(info.value) and REACH in str(info.value)


async def test_bus_describe_of_bad_env_kwargs_names_the_env(
    own_nc: NATS, describer: Describer
) -> None:
    with pytest.raises(EnvDescribeError, match=r"env JoyNexus/Reach2D-v0: .*num_distractors"):
        await request_description(own_nc, REACH, {"num_distractors": 9})


async def test_sdk_describe_env(fresh_server: EmbeddedServer, describer: Describer) -> None:
    async with await Client.connect(fresh_server.url) as client:
        d = await client.describe_env("JoyNexus/ReachGrasp2D-v0")
    assert (d.action.dim, d.proprio_dim) == (3, 4)


async def test_bus_describe_without_an_env_worker_is_retryable_not_hung(own_nc: NATS) -> None:
    with pytest.raises(EnvDescribeError, match="no env worker") as info:
        await request_description(own_nc, REACH, timeout=1.0)
    assert info.value.retryable


# -- the master's check at submit -----------------------------------------------------------------


def _rl(tenant: str, env: str = REACH, **head: Any) -> dict[str, Any]:
    return {
        "kind": "rl",
        "tenant": tenant,
        "env": env,
        "env_kwargs": {"target_in_state": True},
        "head": {"kind": "oft", "value_head": True, **head},
        "iterations": 1,
    }


async def _submit(nc: NATS, spec: dict[str, Any], job: str = "rl-1") -> None:
    """One submit through the master's handler, as its consumer would deliver it."""
    js = nc.jetstream()
    master = Master(
        js,
        await js.key_value(subjects.KV_JOBS),
        await js.key_value(subjects.KV_POLICIES),
        envs=EnvDescriptions(nc, timeout_s=20.0),
    )
    tenant = spec["tenant"]
    data = encode(JobSubmit(tenant, job, json.dumps(spec).encode(), 0.0))
    await master.handle(Msg(nc, subject=subjects.job(tenant, "submit"), data=data))


async def _open_slot(nc: NATS, tenant: str) -> OpenSlot:
    """The slot the master opened on the tenant's Training Queue (a work queue: read, not
    consumed)."""
    raw = await nc.jetstream().get_last_msg(subjects.STREAM_TRAIN, subjects.train("tiny", tenant))
    message = decode(TRAIN_DECODER, raw.data or b"")
    assert isinstance(message, OpenSlot), message
    return message


async def test_head_whose_action_dim_does_not_match_its_env_is_rejected_with_both_numbers(
    own_nc: NATS, describer: Describer
) -> None:
    with pytest.raises(PoisonError) as info:
        await _submit(own_nc, _rl(uid("acme"), action_dim=3))
    assert str(info.value) == (
        f"head.action_dim: 3 does not match env {REACH}'s action dimension 2"
    )


async def test_smaller_proprio_dim_than_the_env_is_rejected_not_truncated(
    own_nc: NATS, describer: Describer
) -> None:
    with pytest.raises(PoisonError, match=r"head\.proprio_dim: 4 does not match .* dimension 6"):
        await _submit(own_nc, _rl(uid("acme"), action_dim=2, proprio_dim=4))


async def test_omitted_dims_are_filled_from_the_env(own_nc: NATS, describer: Describer) -> None:
    tenant = uid("acme")
    await _submit(own_nc, _rl(tenant))
    slot = await _open_slot(own_nc, tenant)
    assert (slot.head.action_dim, slot.head.proprio_dim) == (2, 6)


async def test_proprio_dim_zero_means_none_and_is_accepted(
    own_nc: NATS, describer: Describer
) -> None:
    tenant = uid("acme")
    await _submit(own_nc, _rl(tenant, action_dim=2, proprio_dim=0))
    assert (await _open_slot(own_nc, tenant)).head.proprio_dim == 0


async def test_submit_with_no_env_worker_is_retried_with_a_clear_reason(own_nc: NATS) -> None:
    with pytest.raises(RetryableError, match="no env worker is running to describe env"):
        await _submit(own_nc, _rl(uid("acme")))


@pytest.mark.maniskill
async def test_maniskill_head_mismatch_is_rejected_with_both_numbers(
    maniskill_home: Path, own_nc: NATS, describer: Describer
) -> None:
    spec = _rl(uid("acme"), env="PickCubeSO100-v1", action_dim=3)
    spec["env_kwargs"] = {}
    with pytest.raises(PoisonError) as info:
        await _submit(own_nc, spec)
    assert str(info.value) == (
        "head.action_dim: 3 does not match env PickCubeSO100-v1's action dimension 6"
    )


async def test_bus_describe_answers_only_on_an_inbox(own_nc: NATS, describer: Describer) -> None:
    """The broker never checks a request's reply subject: a describe whose reply names
    another tenant's event subject must not have the worker publish there."""
    victim = f"nexus.event.alice.job-{uuid.uuid4().hex[:8]}.state"
    landed = await own_nc.subscribe(victim)
    request = encode(DescribeEnv(REACH, {}))
    await own_nc.publish(subjects.ENV_DESCRIBE, request, reply=victim)
    # a proper request after it is answered, so the bad one was seen and dropped by then
    assert await request_description(own_nc, REACH) == describe_env(REACH)
    await own_nc.flush()
    with pytest.raises(NatsTimeoutError):
        await landed.next_msg(timeout=0.3)
    assert describer.cache  # the worker is alive and answering


async def test_a_tenants_describe_is_answered_only_on_its_own_inbox(
    own_nc: NATS, describer: Describer
) -> None:
    """Bob's describe naming alice's inbox as its reply reaches nothing of alice's."""
    victim = await own_nc.subscribe(f"{subjects.tenant_inbox_prefix('alice')}.>")
    request = encode(DescribeEnv(REACH, {}))
    await own_nc.publish(subjects.env_describe("bob"), request, reply="_INBOX_alice.r")
    await own_nc.publish(subjects.ENV_DESCRIBE, request, reply="_INBOX_alice.r")
    assert await request_description(own_nc, REACH) == describe_env(REACH)
    await own_nc.flush()
    with pytest.raises(NatsTimeoutError):
        await victim.next_msg(timeout=0.3)


def test_shared_queries_answer_the_subjects_own_inbox_only() -> None:
    base = subjects.ENV_DESCRIBE
    assert query_reply_allowed(subjects.env_describe("bob"), base, "_INBOX_bob.x.1")
    assert query_reply_allowed(base, base, "_INBOX.x.1")
    for subject, reply in (
        (subjects.env_describe("bob"), "_INBOX_alice.x"),
        (subjects.env_describe("bob"), "_INBOX.x"),
        (base, "_INBOX_alice.x"),
        (base, "$KV.jobs.alice.j"),
        (f"{base}.bad*token", "_INBOX.x"),
        ("nexus.other", "_INBOX.x"),
    ):
        assert not query_reply_allowed(subject, base, reply), (subject, reply)


def test_any_inbox_accepts_inboxes_only() -> None:
    assert any_inbox("_INBOX.abc.1") and any_inbox("_INBOX_alice.x")
    assert any_inbox("_INBOX_SVC.abc.1")  # a service asking for the health report
    for reply in (
        "",
        "nexus.event.alice.j.state",
        "$KV.jobs.alice.j",
        "_INBOX_",
        "_INBOX_a*.x",
        "_INBOX_SVCX.abc",
    ):
        assert not any_inbox(reply), reply


async def test_one_tenants_flood_of_builds_is_answered_busy_and_holds_no_one_else_up(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Found by an audit: every describe request started a build on the threads that step
    tenants' simulators, without bound (40 requests of one tenant held another's 1 ms
    simulator call for 16 s). Now builds run one at a time in a thread of their own, a
    tenant has two in hand at most (a third is answered busy, retryable), and the cache
    keeps the last MAX_CACHED descriptions asked for."""
    monkeypatch.setattr(describe_module, "MAX_CACHED", 3)
    d = Describer()
    release = asyncio.Event()
    d.on_build = release.wait  # builds wait here: "in hand"

    def ask(size: int, tenant: str | None) -> asyncio.Task[DescribeReply]:
        return asyncio.ensure_future(d.reply(encode(DescribeEnv(REACH, {}, size)), tenant))

    try:
        held = [ask(16, "alice"), ask(17, "alice")]
        await eventually(lambda: d.building == 2 or None, what="alice's two builds")
        busy = await ask(18, "alice")
        assert busy.description is None and busy.retryable
        assert "2 descriptions for tenant alice are being built already" in busy.error
        # The same description as one in hand joins it; others' requests are not held.
        others = [ask(16, "alice"), ask(18, "bob"), ask(19, None)]
        await eventually(lambda: d.building == 4 or None, what="bob's and the service's")
        release.set()
        replies = await asyncio.wait_for(asyncio.gather(*held, *others), 60)
        assert all(r.description is not None and not r.error for r in replies)
        again = await ask(20, "alice")  # its builds ended: it may build again
        assert again.description is not None
        assert list(d.cache) == [
            cache_key(REACH, {}, size) for size in (18, 19, 20)
        ]  # the least recently asked for went
    finally:
        await d.close()
