"""A policy version and how it is written: the commit protocol's durable half. A version is
frozen (:func:`freeze`: the slot's state copied at a round boundary), then
:func:`write_version` checkpoints it into the ``checkpoints`` object store under a
content-hashed name and advances the job's ``policies`` KV entry with compare-and-set. Only
after both may the trainer announce the version and ack the messages the checkpoint contains
(:class:`services.trainer.commit.Committer`).

:func:`write_version` is also what tests use to publish a policy version exactly as the
trainer does.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass
from typing import Any

from nats.errors import Error as NatsError
from nats.js.kv import KeyValue
from nats.js.object_store import ObjectStore

from bus import checkpoints as ckpt
from bus import records
from schemas.train import OpenSlot, PolicyRecord
from vla.slot import TenantSlot, state_bytes


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
    frozen: Frozen | None = None,
    saved: dict[str, str] | None = None,
    saved_calls: dict[str, int] | None = None,
    save_as: tuple[str, int] | None = None,
) -> tuple[PolicyRecord, int]:
    """Publish the slot's next version: checkpoint object, then the KV entry (created when
    ``revision`` is None or 0, else updated only if still at ``revision``: a lost race raises
    :class:`bus.records.RevisionConflict`). Returns the record and the new revision.

    ``frozen``: the version already taken with :func:`freeze` (the trainer freezes at the
    round boundary, then writes while the next round trains the slot); else it is taken
    here. ``saved``: a session's named states (``saved_calls``: the call that saved each);
    ``save_as``: the name and call that save this version among them."""
    if frozen is None:
        # Versions count from 1 (the initial weights): 0 means "none" / "latest" elsewhere.
        frozen = freeze(slot)
    data = await frozen.serialised()
    sha = ckpt.digest(data)
    name = ckpt.object_name(spec.tenant, spec.job_id, frozen.version, sha)
    await ckpt.put_checkpoint(store, name, data)
    named, calls = dict(saved or {}), dict(saved_calls or {})
    if save_as is not None:
        named[save_as[0]], calls[save_as[0]] = name, save_as[1]
    record = PolicyRecord(
        spec.tenant,
        spec.job_id,
        frozen.version,
        frozen.step,
        name,
        sha,
        stream_seq,
        spec,
        time.time(),
        dict(metrics or {}),
        batches_done,
        named,
        calls,
    )
    try:
        return record, await records.put_policy(policies, record, last=revision or 0)
    except records.RevisionConflict:
        # Another record stands. Unless a record names this very object (an earlier try of
        # this commit landed unseen, perhaps followed by later commits: names are content
        # hashes), the object was never committed: not left for a reader to take for this
        # version.
        with contextlib.suppress(NatsError, TimeoutError):
            history = await records.policy_history(policies, spec.tenant, spec.job_id)
            named_by = {n for r in history for n in (r.object_name, *r.saved.values())}
            if name not in named_by:
                await store.delete(name)
        raise


@dataclass
class Frozen:
    """A slot's next version: a copy of its state taken at the round boundary (what its
    checkpoint will hold), serialised in a worker thread when the commit writes it."""

    version: int
    step: int
    state: dict[str, Any]
    #: The serialised state, once :meth:`serialised` has made it.
    data: bytes = b""

    async def serialised(self) -> bytes:
        if not self.data:
            self.data = await asyncio.to_thread(state_bytes, self.state)
        return self.data


def freeze(slot: TenantSlot) -> Frozen:
    """Take the slot's next version now (its state is copied: training may go on)."""
    slot.publish_version()
    return Frozen(slot.version, slot.step, slot.snapshot())
