"""The inferencer as a real subprocess on a real nats-server: actions of the head's shape,
grouped forwards across tenants, version following and pinning, deterministic and seeded
reproducibility against in-process computation, bad requests answered and dead-lettered,
replicas sharing the queue, and a clean SIGTERM stop that hands unstarted work back.

Policies are committed here exactly as the trainer commits them (slot bytes into the
``checkpoints`` store under :func:`bus.checkpoints.object_name`, then a
``PolicyRecord`` into the ``policies`` KV), so no trainer is needed.
"""

from __future__ import annotations

import asyncio
import subprocess
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import msgspec
import numpy as np
import pytest
import pytest_asyncio
import torch
from nats.aio.client import Client as NATS
from nats.errors import TimeoutError as NatsTimeoutError
from nats.js import JetStreamContext
from nats.js.errors import KeyNotFoundError

from bus.codec import decode, encode
from bus.inference import (
    InferenceError,
    InferenceTimeout,
    PolicyClient,
    observation,
)
from bus.records import get_policy
from bus.server import EmbeddedServer
from schemas import subjects
from schemas.dead import DeadLetter
from schemas.health import HEARTBEAT_DECODER
from schemas.infer import ACT_REPLY_DECODER, ActReply, ActRequest
from schemas.model import HeadConfig, Observation, OptimizerConfig
from schemas.tensor import Tensor
from schemas.train import OpenSlot
from services.trainer.versions import write_version
from tests.conftest import Procs
from tests.helpers import dead_letters, eventually, start_service, uid
from vla.backbone import Backbone
from vla.normalize import Normaliser
from vla.slot import TenantSlot

OFT = HeadConfig(kind="oft", action_dim=7, chunk_len=4, proprio_dim=7, value_head=True)
DISCRETE = HeadConfig(kind="discrete", action_dim=3, chunk_len=2, proprio_dim=0)
FLOW = HeadConfig(kind="flow", action_dim=5, chunk_len=3, proprio_dim=4)
TOKEN_BUDGET = 16
#: Wide enough that requests sent together in a test always meet in one forward.
TEST_MAX_WAIT_MS = "100"


# -- helpers ---------------------------------------------------------------------------------
async def commit_policy(
    js: JetStreamContext,
    tenant: str,
    job_id: str,
    head: HeadConfig,
    hidden_size: int,
    *,
    version: int = 1,
    seed: int = 0,
    slot: TenantSlot | None = None,
) -> TenantSlot:
    """Commit ``slot`` (or a fresh one) as ``version`` of the job with the trainer's own
    commit protocol (:func:`services.trainer.versions.write_version`): checkpoint object first,
    then the ``policies`` record that points at it, by compare-and-set."""
    if slot is None:
        slot = TenantSlot(f"{tenant}/{job_id}", head, OptimizerConfig(), hidden_size, seed=seed)
    slot.version = version - 1  # write_version publishes the next version
    spec = OpenSlot(
        tenant, job_id, head, OptimizerConfig(), seed, total_steps=10, token_budget=TOKEN_BUDGET
    )
    store = await js.object_store(subjects.OBJ_CHECKPOINTS)
    kv = await js.key_value(subjects.KV_POLICIES)
    _, revision = await get_policy(kv, tenant, job_id)
    await write_version(store, kv, spec, slot, revision=revision)
    return slot


def perturbed(slot: TenantSlot, seed: int) -> TenantSlot:
    """A copy of ``slot`` with noise added to every weight (a stand-in for training)."""
    copy = TenantSlot.from_bytes(slot.to_bytes())
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in copy.module.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=gen))
    return copy


def make_obs(head: HeadConfig, seed: int, size: int = 64) -> Observation:
    rng = np.random.default_rng(seed)
    image = rng.integers(0, 256, (size, size, 3), dtype=np.uint8)
    proprio = rng.standard_normal(head.proprio_dim).astype(np.float32)
    return observation([image], "pick up the red block", proprio)


def in_process(
    backbone: Backbone, slot: TenantSlot, obs: list[Observation], seed: int = -1
) -> np.ndarray:
    """Deterministic (``seed`` -1) or seeded actions computed here, without the bus."""
    feature = backbone.encode(Normaliser(backbone, 1, TOKEN_BUDGET).normalise(obs))
    if seed < 0:
        return slot.act(feature, deterministic=True).actions_B_C_A.numpy()
    slot.module.eval()
    with torch.no_grad():
        gen = torch.Generator().manual_seed(seed)
        return slot.module.act(feature, generator=gen).actions_B_C_A.numpy()


def _actions(reply: ActReply) -> np.ndarray:
    assert reply.actions is not None, reply.error
    return reply.actions.to_numpy()


@dataclass
class Replica:
    """An inferencer subprocess; its heartbeat key is known (``--instance``), so reading
    its gauges is one KV get (listing the bucket's keys would create a consumer per poll)."""

    proc: subprocess.Popen[bytes]
    log: Path
    instance: str


def launch(url: str, log: Path, *args: str) -> Replica:
    instance = uid("inf")
    proc = start_service("inferencer", url, log, "--instance", instance, *args)
    return Replica(proc, log, instance)


async def gauges_of(
    js: JetStreamContext, replica: Replica, since: float = 0.0
) -> dict[str, float] | None:
    """The replica's heartbeat gauges, if it has a heartbeat written after ``since``."""
    kv = await js.key_value(subjects.KV_HEARTBEATS)
    try:
        entry = await kv.get(f"inferencer.{replica.instance}")
    except KeyNotFoundError:
        return None
    if not entry.value:
        return None
    beat = decode(HEARTBEAT_DECODER, entry.value)
    return beat.gauges if beat.at > since else None


async def wait_serving(js: JetStreamContext, replica: Replica) -> None:
    async def up() -> bool:
        if replica.proc.poll() is not None:
            raise AssertionError(f"inferencer exited {replica.proc.returncode}; see {replica.log}")
        gauges = await gauges_of(js, replica)
        return gauges is not None and "requests_served" in gauges  # the scheduler is up

    await eventually(up, timeout=60, what="inferencer heartbeat")


# -- fixtures --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def backbone() -> Backbone:
    torch.set_num_threads(1)
    return Backbone.load("tiny")


@pytest.fixture(scope="module")
def inferencer(
    nats_server: EmbeddedServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Replica]:
    """One inferencer on backbone ``tiny`` for the module's behaviour tests."""
    log = tmp_path_factory.mktemp("inferencer") / "inferencer.log"
    replica = launch(nats_server.url, log, "--max-wait-ms", TEST_MAX_WAIT_MS)
    yield replica
    proc = replica.proc
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest_asyncio.fixture
async def client(
    nc: NATS, js: JetStreamContext, inferencer: Replica
) -> AsyncIterator[PolicyClient]:
    await wait_serving(js, inferencer)
    async with await PolicyClient.create(nc, "tiny", js) as c:
        yield c


# -- behaviour -------------------------------------------------------------------------------
async def test_act_returns_actions_of_the_heads_shape_with_finite_log_probs_and_values(
    js: JetStreamContext, client: PolicyClient, backbone: Backbone
) -> None:
    tenant = uid("acme")
    await commit_policy(js, tenant, "job-oft", OFT, backbone.hidden_size)
    await commit_policy(js, tenant, "job-disc", DISCRETE, backbone.hidden_size)

    reply = await client.act(tenant, "job-oft", [make_obs(OFT, 1), make_obs(OFT, 2)])
    assert reply.error == "" and reply.policy_version == 1
    assert reply.actions is not None and reply.log_probs is not None and reply.values is not None
    actions = reply.actions.to_numpy()
    assert actions.dtype == np.float32 and actions.shape == (2, OFT.chunk_len, OFT.action_dim)
    assert reply.log_probs.to_numpy().shape == (2,)
    assert np.isfinite(reply.log_probs.to_numpy()).all()
    assert reply.values.to_numpy().shape == (2,) and np.isfinite(reply.values.to_numpy()).all()

    reply = await client.act(tenant, "job-disc", [make_obs(DISCRETE, 3)])
    assert reply.actions is not None and reply.log_probs is not None
    assert reply.actions.to_numpy().shape == (1, DISCRETE.chunk_len, DISCRETE.action_dim)
    assert np.isfinite(reply.log_probs.to_numpy()).all()
    assert reply.values is None, "no value head, no values"


async def test_two_tenants_with_different_heads_share_one_grouped_forward(
    js: JetStreamContext, client: PolicyClient, backbone: Backbone
) -> None:
    a, b = uid("alpha"), uid("beta")
    slot_a = await commit_policy(js, a, "job", OFT, backbone.hidden_size, seed=1)
    slot_b = await commit_policy(js, b, "job", FLOW, backbone.hidden_size, seed=2)
    obs_a, obs_b = [make_obs(OFT, 10)], [make_obs(FLOW, 11)]
    # Warm both policies up so the grouped call below is not split by a policy load.
    await asyncio.gather(client.act(a, "job", obs_a), client.act(b, "job", obs_b))

    reply_a, reply_b = await asyncio.gather(
        client.act(a, "job", obs_a, deterministic=True),
        client.act(b, "job", obs_b, deterministic=True),
    )
    # Only these two requests were in flight: a forward of 2 held both tenants.
    assert reply_a.group_size == 2 and reply_b.group_size == 2
    assert reply_a.actions is not None and reply_b.actions is not None
    assert reply_a.actions.to_numpy().shape == (1, OFT.chunk_len, OFT.action_dim)
    assert reply_b.actions.to_numpy().shape == (1, FLOW.chunk_len, FLOW.action_dim)
    # Partitioned back to the right tenant: each equals its own policy computed alone.
    np.testing.assert_allclose(
        reply_a.actions.to_numpy(), in_process(backbone, slot_a, obs_a), rtol=1e-5, atol=1e-5
    )
    np.testing.assert_allclose(
        reply_b.actions.to_numpy(), in_process(backbone, slot_b, obs_b), rtol=1e-5, atol=1e-5
    )


async def test_latest_follows_new_versions_and_pinned_old_versions_are_still_served(
    js: JetStreamContext,
    client: PolicyClient,
    backbone: Backbone,
    inferencer: Replica,
) -> None:
    tenant = uid("versions")
    obs = [make_obs(OFT, 5)]
    # Versions count from 1 (the trainer's initial commit); policy_version=0 means latest.
    slots = {1: await commit_policy(js, tenant, "job", OFT, backbone.hidden_size, seed=3)}
    assert (await client.act(tenant, "job", obs)).policy_version == 1

    async def latest_is(version: int) -> bool:
        return (await client.act(tenant, "job", obs)).policy_version == version

    async def commit(version: int) -> None:
        slots[version] = perturbed(slots[version - 1], seed=version)  # "training"
        await commit_policy(
            js, tenant, "job", OFT, backbone.hidden_size, slot=slots[version], version=version
        )

    await commit(2)
    await eventually(lambda: latest_is(2), timeout=20, what="latest requests served by v2")
    # Three more versions: with 3 resident per job, v1 and v2 are dropped from memory.
    for version in (3, 4, 5):
        await commit(version)
    await eventually(lambda: latest_is(5), timeout=20, what="latest requests served by v5")
    latest = await client.act(tenant, "job", obs, deterministic=True)
    np.testing.assert_allclose(
        _actions(latest), in_process(backbone, slots[5], obs), rtol=1e-5, atol=1e-5
    )

    async def loads(since: float) -> float | None:
        gauges = await gauges_of(js, inferencer, since)
        return gauges["policy_loads"] if gauges else None

    t0 = time.time()
    before: float = await eventually(lambda: loads(t0), what="a fresh heartbeat")
    for pinned in (4, 2):  # v4 is resident; v2 is found again in the checkpoint store
        reply = await client.act(tenant, "job", obs, policy_version=pinned, deterministic=True)
        assert reply.policy_version == pinned
        np.testing.assert_allclose(
            _actions(reply), in_process(backbone, slots[pinned], obs), rtol=1e-5, atol=1e-5
        )
    assert not np.allclose(in_process(backbone, slots[2], obs), in_process(backbone, slots[5], obs))

    t1 = time.time()
    after: float = await eventually(lambda: loads(t1), what="a fresh heartbeat")
    assert after == before + 1, "v2 (evicted) loaded again from the store; v4 was resident"

    with pytest.raises(InferenceError, match=r"version 9 .* is not committed"):
        await client.act(tenant, "job", obs, policy_version=9)


async def test_deterministic_and_seeded_actions_are_reproducible_and_match_in_process(
    js: JetStreamContext, client: PolicyClient, backbone: Backbone
) -> None:
    tenant = uid("repro")
    slot = await commit_policy(js, tenant, "job", FLOW, backbone.hidden_size, seed=7)
    obs = [make_obs(FLOW, 20), make_obs(FLOW, 21)]

    first = await client.act(tenant, "job", obs, deterministic=True)
    second = await client.act(tenant, "job", obs, deterministic=True)
    assert first.actions is not None and second.actions is not None
    np.testing.assert_array_equal(first.actions.to_numpy(), second.actions.to_numpy())
    np.testing.assert_allclose(
        first.actions.to_numpy(), in_process(backbone, slot, obs), rtol=1e-5, atol=1e-5
    )

    seeded = [await client.act(tenant, "job", obs, seed=s) for s in (11, 11, 12)]
    acts = [r.actions.to_numpy() for r in seeded if r.actions is not None]
    np.testing.assert_allclose(acts[0], acts[1], rtol=1e-5, atol=1e-5)
    assert not np.allclose(acts[0], acts[2]), "another seed draws other noise"
    np.testing.assert_allclose(
        acts[0], in_process(backbone, slot, obs, seed=11), rtol=1e-5, atol=1e-5
    )


async def test_bad_requests_get_an_error_reply_and_a_dead_letter_and_serving_goes_on(
    nc: NATS, js: JetStreamContext, client: PolicyClient, backbone: Backbone
) -> None:
    tenant = uid("bad")
    await commit_policy(js, tenant, "job", OFT, backbone.hidden_size)
    good = make_obs(OFT, 1)
    rgba = Tensor.from_numpy(np.zeros((64, 64, 4), np.uint8))
    floats = Tensor.from_numpy(np.zeros((64, 64, 3), np.float32))
    short = Tensor.from_numpy(np.zeros(3, np.float32))
    # (job, observations, token budget, error); the layout is given explicitly so that the
    # client does not refuse the unknown job itself before the inferencer sees it.
    cases = [
        ("nojob", [good], TOKEN_BUDGET, "no committed policy"),
        ("no job", [good], TOKEN_BUDGET, "invalid job_id 'no job'"),
        (
            "job",
            [Observation([rgba], "x", good.proprio)],
            TOKEN_BUDGET,
            r"images\[0\].*\(H, W, 3\)",
        ),
        ("job", [Observation([floats], "x", good.proprio)], TOKEN_BUDGET, "expected uint8"),
        ("job", [Observation(good.images, "x", short)], TOKEN_BUDGET, r"proprio.*\(7,\)"),
        ("job", [good], 48, "token_budget=16"),
    ]
    for job_id, observations, budget, pattern in cases:
        with pytest.raises(InferenceError, match=pattern) as caught:
            await client.act(tenant, job_id, observations, num_views=1, token_budget=budget)
        assert not caught.value.retryable

    # A payload that is not an ActRequest at all: the sender is still told, from what can
    # be salvaged (its reply_to), and the service survives.
    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox)
    junk = msgspec.msgpack.encode({"request_id": "junk-1", "reply_to": inbox, "tenant": 3})
    await js.publish(subjects.infer("tiny", tenant), junk)
    junk_reply = decode(ACT_REPLY_DECODER, (await sub.next_msg(timeout=10)).data)
    assert junk_reply.request_id == "junk-1" and "malformed act request" in junk_reply.error
    await sub.unsubscribe()

    # A reply subject that would be a protocol error to publish on: dead-lettered only.
    unanswerable = ActRequest(tenant, "job", "r-1", "not a subject", [good], token_budget=16)
    await js.publish(subjects.infer("tiny", tenant), encode(unanswerable))

    async def all_dead() -> list[DeadLetter] | None:
        letters = await dead_letters(js, "INFER", tenant)
        return letters if len(letters) >= len(cases) + 2 else None

    dead: list[DeadLetter] = await eventually(all_dead, what="a dead letter per bad request")
    assert all(d.error_type == "PoisonError" and d.stream == "INFER" for d in dead)
    assert any("no committed policy" in d.reason for d in dead)
    assert any("is not a subject to reply on" in d.reason for d in dead)

    reply = await client.act(tenant, "job", [good])
    assert reply.error == "" and reply.actions is not None


async def test_a_request_whose_requester_stopped_waiting_is_dropped_unanswered(
    nc: NATS,
    js: JetStreamContext,
    client: PolicyClient,
    backbone: Backbone,
    inferencer: Replica,
) -> None:
    """An act request taken after its ``expires_at`` costs no forward and gets no answer
    (its requester has given up); it is acked, not dead-lettered."""
    tenant = uid("late")
    await commit_policy(js, tenant, "job", OFT, backbone.hidden_size)
    before = (await gauges_of(js, inferencer) or {}).get("requests_expired", 0.0)
    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox)
    late = ActRequest(
        tenant,
        "job",
        "late-1",
        inbox,
        [make_obs(OFT, 1)],
        token_budget=TOKEN_BUDGET,
        expires_at=time.time() - 1.0,
    )
    await js.publish(subjects.infer("tiny", tenant), encode(late))
    reply = await client.act(tenant, "job", [make_obs(OFT, 2)])  # a live one is served
    assert reply.error == "" and reply.actions is not None

    async def counted() -> bool:
        gauges = await gauges_of(js, inferencer)
        return gauges is not None and gauges["requests_expired"] >= before + 1

    await eventually(counted, timeout=30, what="the late request counted as expired")
    with pytest.raises(NatsTimeoutError):
        await sub.next_msg(timeout=0.5)
    assert await dead_letters(js, "INFER", tenant) == []
    await sub.unsubscribe()


async def test_client_times_out_with_a_retryable_error_when_no_inferencer_serves(
    nc: NATS, js: JetStreamContext
) -> None:
    async with await PolicyClient.create(nc, uid("nobody"), js) as client:
        with pytest.raises(InferenceTimeout) as caught:
            await client.act(
                "acme", "job", [make_obs(DISCRETE, 0)], num_views=1, token_budget=16, timeout=0.3
            )
        assert caught.value.retryable
        with pytest.raises(InferenceError, match="no committed policy"):
            await client.act(uid("acme"), "job", [make_obs(DISCRETE, 0)])  # layout lookup
        with pytest.raises(ValueError, match="request_id"):
            await client.act("acme", "job", [], num_views=1, token_budget=16, request_id="a.b")


# -- processes -------------------------------------------------------------------------------
async def test_replicas_share_the_queue_and_sigterm_hands_unstarted_work_to_the_other(
    nats_server: EmbeddedServer,
    nc: NATS,
    js: JetStreamContext,
    procs: Procs,
    tmp_path: Path,
    backbone: Backbone,
) -> None:
    bid = uid("rep")  # own backbone id: own queue and consumer, isolated from other tests
    tenant = uid("scale")
    await commit_policy(js, tenant, "job", FLOW, backbone.hidden_size)
    # One request per forward and at most 2 held per replica: the queue stays in the stream,
    # where either replica can take it.
    args = ("--backbone-id", bid, "--target-batch", "1", "--max-wait-ms", "0")
    replicas = [launch(nats_server.url, tmp_path / f"r{i}.log", *args) for i in range(2)]
    for r in replicas:
        procs.add(r.proc)
    for r in replicas:
        await wait_serving(js, r)
    info = await js.consumer_info(subjects.STREAM_INFER, f"inferencer-{bid}")
    assert info.config.filter_subject == f"nexus.infer.{bid}.>"

    async with await PolicyClient.create(nc, bid, js) as client:
        obs = [make_obs(FLOW, 0)]
        replies = await asyncio.gather(*(client.act(tenant, "job", obs) for _ in range(30)))
        assert all(r.actions is not None for r in replies)

        async def both_served() -> bool:
            served = [await gauges_of(js, r) for r in replicas]
            return all(g is not None and g.get("requests_served", 0) > 0 for g in served)

        await eventually(both_served, timeout=10, what="both replicas served requests")

        # SIGTERM one while work is queued: it answers what it started, hands back what it
        # had pulled but not started, exits 0; the other serves everything that is left.
        stopping = replicas[0]
        calls = [asyncio.create_task(client.act(tenant, "job", obs, timeout=60)) for _ in range(40)]
        await eventually(lambda: any(c.done() for c in calls), timeout=30, what="a reply")
        assert procs.stop(stopping.proc) == 0, stopping.log.read_text()[-3000:]
        assert not all(c.done() for c in calls), "the stop came while work was queued"
        assert await gauges_of(js, stopping) is None, "a clean stop deletes the heartbeat"
        replies = await asyncio.gather(*calls)
        assert all(r.actions is not None for r in replies), "every request answered"
        assert procs.stop(replicas[1].proc) == 0, replicas[1].log.read_text()[-3000:]
