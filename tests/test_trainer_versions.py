"""Version numbers of a job's commits never repeat.

A commit's version number is the slot manager's: with a budget for one slot, a job's
``job.slot`` can be an object the manager evicted since (its bytes stored). Freezing that
object bumped a version the next restore did not see, so the next commit published the same
version number again with other weights (an inferencer keeps the first it saw). A commit
whose event failed after its record landed gave its number back, with the same effect."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, cast

import pytest
import torch
from nats.js import JetStreamContext

from bus.checkpoints import digest
from bus.records import policy_history
from schemas.events import PolicyPublished
from schemas.model import HeadConfig, OptimizerConfig
from schemas.train import OpenSlot
from services.trainer.announce import Announcer
from services.trainer.commit import Committer
from services.trainer.jobs import JobSlot
from services.trainer.registry import JobRegistry
from services.trainer.slots import Slots
from tests.helpers import uid
from vla.backbone import Backbone


def test_a_commit_of_an_evicted_slot_takes_the_next_version_once() -> None:
    backbone = Backbone.load("tiny")
    head = HeadConfig(kind="oft", action_dim=2, chunk_len=1, proprio_dim=0)
    probe = Slots(backbone, 1 << 40, "cpu")
    one = probe.create("probe", OpenSlot("t", "probe", head, OptimizerConfig(), 0, 1)).nbytes
    slots = Slots(backbone, int(one * 1.5), "cpu")  # room for one slot
    for key in ("t/a", "t/b"):
        slots.create(key, OpenSlot("t", key[2:], head, OptimizerConfig(), 0, 1))
    registry = JobRegistry(cast(Any, None), slots, 3)
    committer = Committer(registry, cast(Any, None), cast(Any, None), 3)
    job = cast(JobSlot, SimpleNamespace(key="t/a", slot=slots.acquire(["t/a"])[0]))
    versions = []
    for _ in range(3):
        job.slot = slots.acquire(["t/a"])[0]  # a's round
        slots.acquire(["t/b"])  # b's round evicts a's slot
        versions.append(committer._resident_slot(job).publish_version())  # a's commit
    assert versions == [1, 2, 3]


async def test_a_version_whose_event_was_not_published_is_announced_not_written_again(
    js: JetStreamContext,
) -> None:
    """The policy event failed after the version's record landed. The version stands: it is
    owed, and nothing is committed until it is out (a commit meanwhile takes no version; the
    one due publishes only the event, tried again a second later at most as often); the
    commit after that takes the next number (it used to write the same one again). A trainer
    that restores the job later owes it too, unless the event is stored."""
    tenant, job_id = uid("announce"), "job"
    head = HeadConfig(kind="oft", action_dim=2, chunk_len=1, proprio_dim=0)
    registry = JobRegistry(js, Slots(Backbone.load("tiny"), 1 << 40, "cpu"), 3)
    await registry.connect()
    events: list[PolicyPublished] = []
    broker_away = False

    async def emit(event: object, step_id: object = None) -> None:
        if broker_away:
            raise TimeoutError("injected: the broker did not answer")
        assert isinstance(event, PolicyPublished)
        events.append(event)

    committer = Committer(registry, cast(Any, None), emit, 3)
    job = await registry.open_job(OpenSlot(tenant, job_id, head, OptimizerConfig(), 0, 5), 1)
    assert job is not None
    await committer.commit(job, initial=True)

    async def versions() -> list[int]:
        return [r.version for r in await policy_history(registry.policies, tenant, job_id)]

    job.batches_done = 1  # a step applied
    broker_away = True
    await committer.commit(job)
    assert await versions() == [1, 2] and job.slot.version == 2
    assert job.unannounced is not None and [e.version for e in events] == [1]

    job.batches_done = 2  # another step, while version 2's event is owed
    await committer.commit(job)
    assert await versions() == [1, 2] and job.unannounced is not None
    assert not job.commit_due(every_s=60.0)  # tried again a second later
    job.retry_at = 0.0

    broker_away = False
    assert job.commit_due(every_s=60.0) and committer.start(job)
    await committer.drain([job])
    assert job.unannounced is None and [e.version for e in events] == [1, 2]
    assert await versions() == [1, 2], "the owed event alone"

    assert job.commit_due(every_s=0.0)
    await committer.commit(job)
    assert await versions() == [1, 2, 3] and [e.version for e in events] == [1, 2, 3]

    # Restored by another trainer: version 3's event is not stored on EVENTS, so it is owed.
    async def restored() -> JobSlot:
        other = JobRegistry(js, Slots(Backbone.load("tiny"), 1 << 40, "cpu"), 3)
        await other.connect()
        found = await other.job_for(tenant, job_id)
        assert isinstance(found, JobSlot)
        return found

    owed = (await restored()).unannounced
    assert owed is not None and owed.version == 3 and not owed.final
    await Announcer(js).emit(owed)
    assert (await restored()).unannounced is None


async def test_a_replay_of_a_job_whose_event_is_owed_is_settled_only_once_it_is_out() -> None:
    """A restarted trainer comes back to a job through its replayed messages; acked before
    the owed event went out, a second stop would lose that event for good."""
    from services.trainer.triage import settle_consumed

    settled: list[object] = []

    class Recording:
        async def settle(self, msg: object, error: object) -> None:
            settled.append(msg)

    consumer = cast(Any, Recording())
    owed = PolicyPublished("t", "j", 2, "obj", 2, 0.0)
    job = cast(JobSlot, SimpleNamespace(unannounced=owed, awaiting_event=[]))
    replay = cast(Any, object())
    await settle_consumed(consumer, replay, job)
    assert settled == [] and job.awaiting_event == [(replay, None)]
    job.unannounced = None
    await settle_consumed(consumer, replay, job)
    assert settled == [replay]


async def test_a_commit_that_did_not_land_is_tried_again_as_it_was(
    js: JetStreamContext, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A write that timed out (once before landing, once after landing unseen) is tried
    again with the same version, state and messages, before anything newer: version 2 is
    never skipped and never holds two different states."""
    import services.trainer.commit as commit_module

    tenant, job_id = uid("retry"), "job"
    head = HeadConfig(kind="oft", action_dim=2, chunk_len=1, proprio_dim=0)
    registry = JobRegistry(js, Slots(Backbone.load("tiny"), 1 << 40, "cpu"), 3)
    await registry.connect()

    async def emit(event: object, step_id: object = None) -> None:
        return None

    committer = Committer(registry, cast(Any, None), emit, 5)
    job = await registry.open_job(OpenSlot(tenant, job_id, head, OptimizerConfig(), 0, 5), 1)
    assert job is not None
    await committer.commit(job, initial=True)
    real_write = commit_module.write_version
    faults = ["before", "after"]

    async def flaky_write(*args: Any, **kw: Any) -> Any:
        fault = faults.pop(0) if faults else ""
        if fault == "before":
            raise TimeoutError("injected: no answer, nothing written")
        written = await real_write(*args, **kw)
        if fault == "after":
            raise TimeoutError("injected: written, the answer lost")
        return written

    monkeypatch.setattr(commit_module, "write_version", flaky_write)
    for step in (1, 2):  # each commit fails, and a step is applied after each
        job.batches_done = step
        with torch.no_grad():
            next(job.slot.module.parameters()).add_(1.0)
        await committer.commit(job)
        assert job.pending is not None and job.pending.frozen.version == 2
    kept = job.pending.frozen.data or await job.pending.frozen.serialised()
    job.retry_at = 0.0
    assert job.commit_due(every_s=60.0)
    await committer.commit(job)  # version 2 as it was, then version 3
    history = await policy_history(registry.policies, tenant, job_id)
    assert sorted({r.version for r in history}) == [1, 2, 3]
    second = {r.object_name for r in history if r.version == 2}
    assert second == {history[-2].object_name} and history[-2].sha256 == digest(kept)
    assert history[-1].version == 3 and history[-1].batches_done == 2
