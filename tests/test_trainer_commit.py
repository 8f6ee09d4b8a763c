"""The trainer's commit protocol when its compare-and-set loses (services.trainer.commit):
the checkpoint object it wrote is deleted only when no record the ``policies`` history holds
names it. Names are content hashes, so a commit retried after it landed unseen names the same
object as the record it lost to, or as an older one once later commits followed."""

from __future__ import annotations

import io

import pytest
import torch
from nats.js import JetStreamContext

from bus.kv import list_objects, read_object_into
from bus.records import RevisionConflict, get_policy
from schemas import subjects
from schemas.model import HeadConfig, OptimizerConfig
from schemas.train import OpenSlot
from services.trainer.versions import freeze, write_version
from tests.helpers import uid
from vla.slot import TenantSlot

HEAD = HeadConfig(kind="oft", action_dim=2, chunk_len=2, proprio_dim=2)


async def test_a_lost_commit_deletes_its_object_only_when_no_kept_record_names_it(
    js: JetStreamContext,
) -> None:
    tenant, job_id = uid("commit"), "job"
    slot = TenantSlot(f"{tenant}/{job_id}", HEAD, OptimizerConfig(), 16, seed=0)
    spec = OpenSlot(tenant, job_id, HEAD, OptimizerConfig(), 0, total_steps=10, token_budget=64)
    store = await js.object_store(subjects.OBJ_CHECKPOINTS)
    kv = await js.key_value(subjects.KV_POLICIES)

    _, rev1 = await write_version(store, kv, spec, slot, revision=None)
    second = freeze(slot)
    v2, _ = await write_version(store, kv, spec, slot, revision=rev1, frozen=second)
    with torch.no_grad():
        next(slot.module.parameters()).add_(1.0)  # v3 holds other bytes
    v3, _ = await write_version(store, kv, spec, slot, revision=rev1 + 1)
    assert (await get_policy(kv, tenant, job_id))[0] == v3

    # v2's commit, tried again (it landed unseen): it loses, and v2's object stays.
    with pytest.raises(RevisionConflict):
        await write_version(store, kv, spec, slot, revision=rev1, frozen=second)
    kept = {i.name for i in await list_objects(store, f"{tenant}/{job_id}/")}
    assert v2.object_name in kept and v3.object_name in kept
    out = io.BytesIO()
    await read_object_into(store, v2.object_name, out)
    assert out.getvalue() == second.data

    # A commit no record names (its race was lost to v3): its object goes.
    with torch.no_grad():
        next(slot.module.parameters()).add_(1.0)
    orphan = freeze(slot)
    with pytest.raises(RevisionConflict):
        await write_version(store, kv, spec, slot, revision=rev1, frozen=orphan)
    names = {i.name for i in await list_objects(store, f"{tenant}/{job_id}/")}
    assert names == kept
