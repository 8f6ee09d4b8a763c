"""Event-driven data flow on a real bus: a throttled dataset stream wakes when the trainer's
commit lands (no request per batch, no sleep), and falls back to the exact count when no
commit comes; a checkpoint frozen at a round boundary holds that state even though training
goes on while it is written (the trainer's commits are off its critical path)."""

from __future__ import annotations

import asyncio
import time
import uuid

import torch
from nats.js import JetStreamContext

from bus import checkpoints as ckpt
from bus.records import get_policy
from schemas import subjects
from schemas.model import HeadConfig, OptimizerConfig
from schemas.train import OpenSlot
from services.envs.flow import RESYNC_S, Flow
from services.trainer.versions import freeze, write_version
from vla.feature import VLAFeature
from vla.slot import TenantSlot

HEAD = HeadConfig(kind="oft", action_dim=2, chunk_len=2, proprio_dim=0)
HIDDEN = 16


def new_slot(tenant: str) -> TenantSlot:
    return TenantSlot(tenant, HEAD, OptimizerConfig(lr=1e-2), HIDDEN, seed=1)


def train_once(slot: TenantSlot) -> None:
    g = torch.Generator().manual_seed(slot.step)
    feature = VLAFeature(
        torch.randn(2, 3, HIDDEN, generator=g), torch.ones(2, 3), torch.zeros(2, 0)
    )
    slot.train_step(feature, torch.rand(2, 2, 2, generator=g))


async def commit(js: JetStreamContext, spec: OpenSlot, slot: TenantSlot, batches: int) -> None:
    store = await js.object_store(subjects.OBJ_CHECKPOINTS)
    kv = await js.key_value(subjects.KV_POLICIES)
    _, revision = await get_policy(kv, spec.tenant, spec.job_id)
    await write_version(store, kv, spec, slot, revision=revision, batches_done=batches)


def spec_for(tenant: str, job_id: str) -> OpenSlot:
    return OpenSlot(tenant, job_id, HEAD, OptimizerConfig(lr=1e-2), 1, total_steps=100)


async def test_throttled_stream_wakes_at_the_next_commit_without_polling(
    js: JetStreamContext,
) -> None:
    tenant, job_id = f"t-{uuid.uuid4().hex[:8]}", "job"
    spec, slot = spec_for(tenant, job_id), new_slot(tenant)
    await commit(js, spec, slot, batches=0)
    exact_reads: list[float] = []

    async def exact() -> int:  # the stream's one request: counted
        exact_reads.append(time.monotonic())
        return 0

    flow = Flow(await js.key_value(subjects.KV_POLICIES), tenant, job_id, exact)
    stop = asyncio.Event()
    await flow.start(committed=0)
    try:
        for _ in range(4):
            assert flow.in_flight < 4
            flow.published()
        assert flow.in_flight == 4
        waiter = asyncio.ensure_future(flow.wait_below(4, stop))
        await asyncio.sleep(0)  # the waiter is parked: nothing committed yet
        assert not waiter.done()
        t0 = time.monotonic()
        await commit(js, spec, slot, batches=3)
        await asyncio.wait_for(waiter, RESYNC_S)
        woke_s = time.monotonic() - t0
        assert flow.committed == 3 and flow.in_flight == 1
        assert woke_s < RESYNC_S / 2, woke_s  # woken by the commit, not by the fallback
        assert len(exact_reads) == 1  # only at the start: no request per batch
    finally:
        await flow.close()


async def test_without_a_commit_the_wait_reads_the_exact_count(js: JetStreamContext) -> None:
    """A missed watch update (or a trainer that is down) cannot stall the stream: after
    RESYNC_S it reads the exact count, which here says the trainer consumed everything."""
    tenant, job_id = f"t-{uuid.uuid4().hex[:8]}", "job"
    counts = [0, 0]  # at start, then at the fallback

    async def exact() -> int:
        return counts.pop(0)

    flow = Flow(await js.key_value(subjects.KV_POLICIES), tenant, job_id, exact)
    await flow.start(committed=0)
    try:
        for _ in range(3):
            flow.published()
        t0 = time.monotonic()
        await asyncio.wait_for(flow.wait_below(3, asyncio.Event()), 3 * RESYNC_S)
        assert time.monotonic() - t0 >= RESYNC_S * 0.9
        assert flow.in_flight == 0 and counts == []
    finally:
        await flow.close()


async def test_frozen_checkpoint_holds_the_round_boundary_state(js: JetStreamContext) -> None:
    """The trainer freezes the slot, then trains the next round while the checkpoint is
    written: the checkpoint has the frozen weights, step and version, not the later ones."""
    tenant = f"t-{uuid.uuid4().hex[:8]}"
    spec, slot = spec_for(tenant, "job"), new_slot(tenant)
    train_once(slot)
    frozen = freeze(slot)
    at_freeze = {k: v.clone() for k, v in slot.module.state_dict().items()}
    store = await js.object_store(subjects.OBJ_CHECKPOINTS)
    kv = await js.key_value(subjects.KV_POLICIES)
    writing = asyncio.ensure_future(
        write_version(store, kv, spec, slot, revision=None, batches_done=1, frozen=frozen)
    )
    train_once(slot)  # the next round, while the write is in flight
    train_once(slot)
    record, _ = await writing
    assert (record.version, record.step) == (1, 1)
    assert (slot.version, slot.step) == (1, 3)
    data = await ckpt.get_checkpoint(store, record.object_name, record.sha256)
    stored = TenantSlot.from_bytes(data)
    assert stored.step == 1
    for k, v in stored.module.state_dict().items():
        assert torch.equal(v, at_freeze[k]), k
    assert any(not torch.equal(v, slot.module.state_dict()[k]) for k, v in at_freeze.items())
