"""The commit protocol's durable half: checkpoint the slot into the ``checkpoints`` object
store under a content-hashed name, then advance the job's ``policies`` KV entry with
compare-and-set. Only after both may the trainer announce the version and ack the messages
the checkpoint contains (:meth:`services.trainer.service.Trainer.commit`).

:func:`write_version` is also what tests use to publish a policy version exactly as the
trainer does.
"""

from __future__ import annotations

import asyncio
import time

from nats.js.kv import KeyValue
from nats.js.object_store import ObjectStore

from bus import checkpoints as ckpt
from bus.codec import encode
from schemas.train import OpenSlot, PolicyRecord
from vla.slot import TenantSlot


async def write_version(
    store: ObjectStore,
    policies: KeyValue,
    spec: OpenSlot,
    slot: TenantSlot,
    *,
    revision: int | None,
    stream_seq: int = 0,
    batches_done: int = 0,
    metrics: dict[str, float] | None = None,
) -> tuple[PolicyRecord, int]:
    """Publish the slot's next version: checkpoint object, then the KV entry (created when
    ``revision`` is None, else updated only if still at ``revision``). Returns the record and
    the entry's new revision."""
    # Versions count from 1 (the initial weights): 0 means "none" / "latest" elsewhere.
    slot.publish_version()
    data = await asyncio.to_thread(slot.to_bytes)
    sha = ckpt.digest(data)
    name = ckpt.object_name(spec.tenant, spec.job_id, slot.version, sha)
    await ckpt.put_checkpoint(store, name, data)
    record = PolicyRecord(
        spec.tenant,
        spec.job_id,
        slot.version,
        slot.step,
        name,
        sha,
        stream_seq,
        spec,
        time.time(),
        dict(metrics or {}),
        batches_done,
    )
    key = f"{spec.tenant}.{spec.job_id}"
    if revision is None:
        new_revision = await policies.create(key, encode(record))
    else:
        new_revision = await policies.update(key, encode(record), last=revision)
    return record, new_revision
