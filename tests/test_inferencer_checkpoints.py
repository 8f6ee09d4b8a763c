"""What the inferencer answers when a policy's checkpoint cannot serve, or its answer cannot
travel: a checkpoint whose chunks are gone (read while a prune deleted it) or whose bytes are
corrupt, a pinned version the store holds twice (a commit that failed after writing its
object), and an answer over the server's ``max_payload``. Each gets its sender a specific
error (``retryable`` when asking again may help), never a wait for the sender's timeout, and
the other tenants are served meanwhile."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import numpy as np
import pytest
from nats.aio.client import Client as NATS
from nats.js import JetStreamContext

from bus import checkpoints as ckpt
from bus.inference import InferenceError, PolicyClient
from bus.server import EmbeddedServer
from schemas import subjects
from schemas.model import HeadConfig
from tests.helpers import dead_letters, uid
from tests.test_inferencer import (
    OFT,
    Replica,
    commit_policy,
    in_process,
    launch,
    make_obs,
    perturbed,
    wait_serving,
)
from vla.backbone import Backbone
from vla.slot import TenantSlot

SMALL = HeadConfig(kind="oft", action_dim=7, chunk_len=4, proprio_dim=7)
#: Within the default input limits, yet 70 observations' actions are ~1.15 MB.
WIDE = HeadConfig(kind="oft", action_dim=64, chunk_len=64, proprio_dim=7)
READ_S = 2.0


@pytest.fixture(scope="module")
def backbone() -> Backbone:
    return Backbone.load("tiny")


@pytest.fixture(scope="module")
def replica(
    nats_server: EmbeddedServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Replica, str]]:
    backbone_id = uid("ckpt")
    log = tmp_path_factory.mktemp("inferencer") / "inferencer.log"
    args = ("--backbone-id", backbone_id, "--max-wait-ms", "5", "--target-batch", "2")
    found = launch(nats_server.url, log, *args, "--checkpoint-read-s", str(READ_S))
    yield found, backbone_id
    found.proc.terminate()
    found.proc.wait(30)


async def _object(js: JetStreamContext, tenant: str, version: int) -> str:
    store = await js.object_store(subjects.OBJ_CHECKPOINTS)
    (info,) = [
        i for i in await store.list() if (i.name or "").startswith(f"{tenant}/job/v{version:06d}-")
    ]
    return info.nuid


async def test_unreadable_checkpoints_are_answered_and_others_served_meanwhile(
    nc: NATS, js: JetStreamContext, replica: tuple[Replica, str], backbone: Backbone
) -> None:
    gone, corrupt, good = uid("gone"), uid("corrupt"), uid("good")
    for tenant in (gone, corrupt, good):
        await commit_policy(js, tenant, "job", SMALL, backbone.hidden_size)
    chunks = f"$O.{subjects.OBJ_CHECKPOINTS}.C."
    await js.purge_stream(
        f"OBJ_{subjects.OBJ_CHECKPOINTS}", subject=chunks + await _object(js, gone, 1)
    )
    await js.publish(chunks + await _object(js, corrupt, 1), b"not a checkpoint")
    inferencer, backbone_id = replica
    await wait_serving(js, inferencer)
    obs = [make_obs(SMALL, 0)]
    async with await PolicyClient.create(nc, backbone_id, js) as client:
        loop = asyncio.get_running_loop()
        waiting = [asyncio.create_task(client.act(gone, "job", obs, timeout=60)) for _ in range(2)]
        sent = loop.time()
        with pytest.raises(InferenceError, match=r"checkpoint .* is corrupt") as refused:
            await client.act(corrupt, "job", obs, timeout=60)
        assert not refused.value.retryable
        served = await client.act(good, "job", obs, timeout=20)
        assert served.policy_version == 1
        for task in waiting:
            # The stream's leader holds none of its chunks: damaged for good, not asked again.
            with pytest.raises(
                InferenceError, match=r"is damaged: .*chunks end after 0 of"
            ) as lost:
                await task
            assert not lost.value.retryable
        assert loop.time() - sent < 45  # not the timeout
    (letter,) = await dead_letters(js, "INFER", corrupt)
    assert letter.num_delivered == 1  # a corrupt object is not read again and again
    letters = await dead_letters(js, "INFER", gone)
    assert letters and all(letter.num_delivered == 1 for letter in letters)


async def test_a_pinned_version_is_the_committed_object_not_an_orphan_of_it(
    nc: NATS, js: JetStreamContext, replica: tuple[Replica, str], backbone: Backbone
) -> None:
    """A commit that wrote its object and then lost its record (a crash, a failed
    compare-and-set) leaves an object of that version that was never committed."""
    tenant = uid("orphan")
    first = await commit_policy(js, tenant, "job", OFT, backbone.hidden_size, seed=1)
    orphan = perturbed(first, seed=99)
    orphan.version = 2
    data = orphan.to_bytes()
    store = await js.object_store(subjects.OBJ_CHECKPOINTS)
    await ckpt.put_checkpoint(store, ckpt.object_name(tenant, "job", 2, ckpt.digest(data)), data)
    second: TenantSlot = perturbed(first, seed=2)
    await commit_policy(js, tenant, "job", OFT, backbone.hidden_size, slot=second, version=2)
    await commit_policy(
        js, tenant, "job", OFT, backbone.hidden_size, slot=perturbed(second, 3), version=3
    )
    inferencer, backbone_id = replica
    await wait_serving(js, inferencer)
    obs = [make_obs(OFT, 5)]
    async with await PolicyClient.create(nc, backbone_id, js) as client:
        reply = await client.act(
            tenant, "job", obs, policy_version=2, deterministic=True, timeout=30
        )
    assert reply.actions is not None and reply.policy_version == 2
    np.testing.assert_allclose(
        reply.actions.to_numpy(), in_process(backbone, second, obs), atol=1e-5
    )


async def test_an_answer_over_max_payload_is_an_error_that_says_so(
    nc: NATS, js: JetStreamContext, replica: tuple[Replica, str], backbone: Backbone
) -> None:
    tenant = uid("wide")
    await commit_policy(js, tenant, "job", WIDE, backbone.hidden_size)
    inferencer, backbone_id = replica
    await wait_serving(js, inferencer)
    started = time.monotonic()
    async with await PolicyClient.create(nc, backbone_id, js) as client:
        few = await client.act(tenant, "job", [make_obs(WIDE, 0)], timeout=30)
        assert few.actions is not None and few.actions.to_numpy().shape == (1, 64, 64)
        many = [make_obs(WIDE, i, size=16) for i in range(70)]
        with pytest.raises(InferenceError, match=r"over the server's max_payload") as refused:
            await client.act(tenant, "job", many, timeout=60)
    assert "ask for fewer observations" in str(refused.value) and not refused.value.retryable
    assert time.monotonic() - started < 50


async def test_a_checkpoint_written_again_with_the_same_bytes_is_left_as_it_was(
    js: JetStreamContext,
) -> None:
    """A commit retried after its write landed unseen writes the same object again: the
    store keeps the object it has (rewriting would move it to new chunks and purge the old
    ones under a reader); other bytes under the name are written."""
    store = await js.object_store(subjects.OBJ_CHECKPOINTS)
    data = np.random.default_rng(0).bytes(300_000)
    name = ckpt.object_name(uid("again"), "job", 1, ckpt.digest(data))
    await ckpt.put_checkpoint(store, name, data)
    first = await store.get_info(name)
    await ckpt.put_checkpoint(store, name, data)
    assert (await store.get_info(name)).nuid == first.nuid
    other = data[::-1]
    await ckpt.put_checkpoint(store, name, other)
    assert (await store.get_info(name)).nuid != first.nuid
    assert await ckpt.read_object(store, name) == other
    await store.delete(name)
