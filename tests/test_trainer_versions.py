"""Version numbers of a job's commits never repeat.

A commit's version number is the slot manager's: with a budget for one slot, a job's
``job.slot`` can be an object the manager evicted since (its bytes stored). Freezing that
object bumped a version the next restore did not see, so the next commit published the same
version number again with other weights (an inferencer keeps the first it saw). A commit
whose event failed after its record landed gave its number back, with the same effect."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, cast

from nats.js import JetStreamContext

from bus.records import get_policy, policy_history
from schemas.events import PolicyPublished
from schemas.model import HeadConfig, OptimizerConfig
from schemas.train import OpenSlot
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
    """The policy event failed after the version's record landed. The version stands: the
    next commit with nothing new publishes that event (no version without a new step), and
    the one after a new step takes the next number (it used to write the same one again)."""
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

    job.batches_done = 1  # a step applied
    broker_away = True
    await committer.commit(job)
    assert (await get_policy(registry.policies, tenant, job_id))[0].version == 2
    assert job.unannounced is not None and [e.version for e in events] == [1]

    broker_away = False
    assert job.commit_due(every_s=60.0) and job.owes_only_an_event
    await committer.commit(job)
    assert job.unannounced is None and [e.version for e in events] == [1, 2]
    assert not job.commit_due(every_s=60.0)

    job.batches_done = 2
    await committer.commit(job)
    history = await policy_history(registry.policies, tenant, job_id)
    assert [r.version for r in history] == [1, 2, 3]
    assert [e.version for e in events] == [1, 2, 3]
