"""A commit's version number is the slot manager's: with a budget for one slot, a job's
``job.slot`` can be an object the manager evicted since (its bytes stored). Freezing that
object bumped a version the next restore did not see, so the next commit published the same
version number again with other weights (an inferencer keeps the first it saw)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, cast

from schemas.model import HeadConfig, OptimizerConfig
from schemas.train import OpenSlot
from services.trainer.commit import Committer
from services.trainer.jobs import JobSlot
from services.trainer.registry import JobRegistry
from services.trainer.slots import Slots
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
