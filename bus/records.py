"""The ``jobs`` and ``policies`` KV records, typed: one read and one compare-and-set each.

Both buckets key a record by ``<tenant>.<job>`` (:func:`schemas.jobs.job_key`). A read
returns ``(record, revision)``; revision 0 and ``None`` mean there is no record (never
written, deleted or purged). A write names the revision its decision was based on:
``last=0`` creates the record and fails if one exists or was purged (a job its tenant
removed: :func:`job_removed`), ``last=r`` replaces revision ``r`` and fails if anyone wrote
since. Either failure raises :class:`RevisionConflict` (retryable):
read again and decide again. A value that does not decode raises
:class:`bus.codec.DecodeError`; bus failures are nats.py's errors, unchanged.

Watchers of a bucket (the inferencer follows ``policies``, the trainer ``jobs``) decode each
entry with :func:`policy_of` / :func:`job_of`.

```python
kv = await js.key_value(subjects.KV_POLICIES)
record, revision = await get_policy(kv, "acme", "job-1")
revision = await put_policy(kv, new_record, last=revision)
```
"""

from __future__ import annotations

import logging
from typing import TypeVar

import msgspec
from nats.js import JetStreamContext
from nats.js.errors import KeyNotFoundError, KeyWrongLastSequenceError
from nats.js.kv import KeyValue

from bus.codec import DecodeError, decode, encode
from bus.errors import RetryableError
from bus.kv import kv_history, kv_values
from schemas import subjects
from schemas.jobs import JOB_RECORD_DECODER, JobRecord, job_key
from schemas.train import POLICY_RECORD_DECODER, PolicyRecord

log = logging.getLogger(__name__)

R = TypeVar("R", bound=msgspec.Struct)


class RevisionConflict(RetryableError):
    """A compare-and-set lost: the record is not at revision ``last`` any more (or, for
    ``last=0``, already exists). Read it again and decide again."""

    def __init__(self, key: str, last: int) -> None:
        super().__init__(f"record {key!r} changed since revision {last}", delay_s=0.1)
        self.key = key
        self.last = last


async def _get(kv: KeyValue, key: str, decoder: msgspec.msgpack.Decoder[R]) -> tuple[R | None, int]:
    try:
        entry = await kv.get(key)
    except KeyNotFoundError:  # also a deleted or purged key (nats.py maps those to it)
        return None, 0
    if not entry.value or not entry.revision:
        return None, 0
    return decode(decoder, entry.value), entry.revision


async def _put(kv: KeyValue, key: str, record: msgspec.Struct, last: int) -> int:
    if last < 0:
        raise ValueError(f"last must be a revision >= 0, got {last}")
    try:
        return await kv.update(key, encode(record), last=last)
    except KeyWrongLastSequenceError as exc:
        if last == 0:
            # Not nats.py's create, which writes over a purge marker too: a deleted record
            # may be written again, a purged one (a removed job) may not.
            marker = await _marker(kv, key)
            if marker is not None and marker[0] == "DEL":
                return await _put(kv, key, record, marker[1])
        raise RevisionConflict(key, last) from exc


async def _marker(kv: KeyValue, key: str) -> tuple[str, int] | None:
    """The key's delete or purge marker (operation, revision), or None."""
    try:
        await kv.get(key)
    except KeyNotFoundError as exc:  # nats.py reports a marker's entry and operation here
        if exc.op in ("DEL", "PURGE") and exc.entry is not None:
            return str(exc.op), int(exc.entry.revision or 0)
    return None


def _of_entry(entry: KeyValue.Entry, decoder: msgspec.msgpack.Decoder[R]) -> R | None:
    if entry.operation in ("DEL", "PURGE") or not entry.value:
        return None
    return decode(decoder, entry.value)


# -- policies: the latest committed version of a job's policy ---------------------------------


async def get_policy(kv: KeyValue, tenant: str, job_id: str) -> tuple[PolicyRecord | None, int]:
    """The job's committed policy record in ``kv`` (the ``policies`` bucket) and its
    revision; ``(None, 0)`` when nothing is committed."""
    return await _get(kv, job_key(tenant, job_id), POLICY_RECORD_DECODER)


async def put_policy(kv: KeyValue, record: PolicyRecord, *, last: int) -> int:
    """Commit ``record`` if the job's entry is still at revision ``last`` (0: no entry yet,
    not even a removed job's purge marker); returns the new revision. Raises
    :class:`RevisionConflict` otherwise."""
    return await _put(kv, job_key(record.tenant, record.job_id), record, last)


async def policy_history(kv: KeyValue, tenant: str, job_id: str) -> list[PolicyRecord]:
    """The job's committed records that ``kv``'s history still holds, oldest first: which
    object each recent version committed (its object store may also hold an object of the
    same version that was never committed, left by a commit that failed after writing it)."""
    entries = await kv_history(kv, job_key(tenant, job_id))
    return [r for e in entries if (r := policy_of(e)) is not None]


def policy_of(entry: KeyValue.Entry) -> PolicyRecord | None:
    """The record a ``policies`` watch entry carries; None for a deletion or purge."""
    return _of_entry(entry, POLICY_RECORD_DECODER)


# -- jobs: each job's state machine ----------------------------------------------------------


async def get_job(kv: KeyValue, tenant: str, job_id: str) -> tuple[JobRecord | None, int]:
    """The job's record in ``kv`` (the ``jobs`` bucket) and its revision; ``(None, 0)`` when
    the master has not recorded the job."""
    return await _get(kv, job_key(tenant, job_id), JOB_RECORD_DECODER)


async def put_job(kv: KeyValue, record: JobRecord, *, last: int) -> int:
    """Write ``record`` if the job's entry is still at revision ``last`` (0: no entry yet);
    returns the new revision. Raises :class:`RevisionConflict` otherwise."""
    return await _put(kv, job_key(record.tenant, record.job_id), record, last)


async def job_removed(kv: KeyValue, tenant: str, job_id: str) -> bool:
    """Whether the job's record was removed (``job-rm`` purges it, leaving the key's purge
    marker): its id is not given to a new job."""
    marker = await _marker(kv, job_key(tenant, job_id))
    return marker is not None and marker[0] == "PURGE"


def job_of(entry: KeyValue.Entry) -> JobRecord | None:
    """The record a ``jobs`` watch entry carries; None for a deletion or purge."""
    return _of_entry(entry, JOB_RECORD_DECODER)


async def list_jobs(js: JetStreamContext, tenant: str | None = None) -> list[JobRecord]:
    """Every live job record (of ``tenant`` if given), oldest first. Lists keys from the
    bucket's stream state, so polling it leaves no consumers behind (:mod:`bus.kv`)."""
    prefix = f"{tenant}." if tenant is not None else ""
    values = await kv_values(js, subjects.KV_JOBS, prefix)
    records = []
    for key, value in values.items():
        try:
            records.append(decode(JOB_RECORD_DECODER, value))
        except DecodeError as exc:
            # One record that does not decode (damaged, or a newer schema's) is its job's
            # problem: failing the list stopped the master at every start, for every tenant.
            log.warning("jobs record %s does not decode (%s); left out", key, exc)
    return sorted(records, key=lambda r: r.created_at)
