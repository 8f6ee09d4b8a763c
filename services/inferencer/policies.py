"""The inferencer's resident policies, synced from the ``policies`` KV and ``checkpoints`` store.

Serving state is indexed by ``(tenant, job, version)``. A watcher over the ``policies`` KV
records the latest committed :class:`~schemas.train.PolicyRecord` of every job it serves
and loads that version's slot in the background, so a request for the latest version usually
finds it resident (a job first asked for is read through the KV; the bucket keeps every job
ever committed, and remembering them all would grow without end). A request pinned to an
older version that is not resident is served by finding its checkpoint in the object store
(``<tenant>/<job>/v{version:06d}-...``). At most ``max_versions_per_job`` versions of a job
stay resident (the latest one always among them; older ones are dropped least recently used
first).

Everything here runs on the event loop; only deserialising a slot goes to a thread.

Stopping: nothing here is cancelled (a cancel can be lost on Python 3.11, PITFALLS). The
watch is :func:`bus.watch.follow_kv` on the service's stop event; a request waiting for a
load or a KV read gives up with :class:`~bus.errors.Interrupted` once the service stops
(:func:`until_stop`), leaving the load to end on its own; loads check the stop event between
their steps, and :meth:`PolicyCache.close` waits for them with a bound.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections import OrderedDict
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import Any, TypeVar

from nats.errors import Error as NatsError
from nats.js import JetStreamContext
from nats.js.kv import KeyValue
from nats.js.object_store import ObjectStore

from bus import checkpoints as ckpt
from bus.codec import DecodeError
from bus.errors import Interrupted, PoisonError, RetryableError
from bus.records import get_policy, policy_of
from bus.watch import follow_kv
from schemas import subjects
from schemas.model import HeadConfig
from schemas.train import OpenSlot, PolicyRecord
from vla.slot import TenantSlot

log = logging.getLogger(__name__)
T = TypeVar("T")

#: How often a wait that gives up on stop looks at the stop event.
STOP_POLL_S = 0.1


JobKey = tuple[str, str]
VersionKey = tuple[str, str, int]


@dataclass(frozen=True)
class ServedPolicy:
    """One resident policy version: the slot to act with and the job's model-facing spec."""

    tenant: str
    job_id: str
    version: int
    slot: TenantSlot
    #: The job's slot spec (head, num_views, token_budget) from its ``policies`` record.
    spec: OpenSlot

    @property
    def head(self) -> HeadConfig:
        return self.slot.head_config

    @property
    def label(self) -> str:
        return f"{self.tenant}/{self.job_id} v{self.version}"


def retrieve_outcome(fut: asyncio.Future[Any]) -> None:
    """Done-callback of an abandoned future: fetch its outcome so it is never reported as
    an exception nobody retrieved (its waiter already gave up)."""
    if not fut.cancelled():
        fut.exception()


async def until_stop(work: Awaitable[T], stop: asyncio.Event) -> T:
    """``await work`` unless ``stop`` is set first: then raise :class:`Interrupted` and leave
    ``work`` to finish on its own. Nothing is cancelled; a shared future (a policy load
    other requests wait for) is not disturbed by one waiter giving up."""
    if stop.is_set():
        if inspect.iscoroutine(work):
            work.close()
        raise Interrupted()
    fut = asyncio.ensure_future(work)
    while not fut.done():
        if stop.is_set():
            fut.add_done_callback(retrieve_outcome)
            raise Interrupted()
        await asyncio.wait({fut}, timeout=STOP_POLL_S)
    return fut.result()


async def wait_bounded(tasks: set[asyncio.Task[T]], timeout: float, what: str) -> None:
    """Wait up to ``timeout`` for ``tasks`` (never cancelled: they end on the stop event)."""
    if not tasks:
        return
    _, late = await asyncio.wait(set(tasks), timeout=timeout)
    if late:
        log.warning("%d %s still running %.1f s after stop", len(late), what, timeout)


#: Latest records kept per resident job at most (those of jobs being loaded or asked for).
RECORDS_PER_RESIDENT_JOB = 4


class PolicyCache:
    """Resident tenant policies of one inferencer, keyed by ``(tenant, job, version)``.

    Args:
        js: JetStream context (the ``policies`` KV and ``checkpoints`` store are opened by
            :meth:`open`).
        device: where slots are restored.
        max_versions_per_job: resident versions kept per job (>= 1).
        stop: the service's stop event: :meth:`follow` returns and waits give up once set.
    """

    def __init__(
        self,
        js: JetStreamContext,
        device: str,
        max_versions_per_job: int,
        stop: asyncio.Event,
        checkpoint_read_s: float = ckpt.READ_TIMEOUT_S,
        max_resident_jobs: int = 64,
    ) -> None:
        if max_versions_per_job < 1:
            raise ValueError(f"max_versions_per_job must be >= 1, got {max_versions_per_job}")
        if max_resident_jobs < 1:
            raise ValueError(f"max_resident_jobs must be >= 1, got {max_resident_jobs}")
        self.js = js
        self.device = device
        self.max_versions = max_versions_per_job
        self.max_jobs = max_resident_jobs
        self.stop = stop
        #: How long reading one checkpoint may take (then its requests are handed back).
        self.checkpoint_read_s = checkpoint_read_s
        #: Latest committed record per job (from the KV watch, or read through on a miss).
        self.records: dict[JobKey, PolicyRecord] = {}
        #: Resident versions per job; the jobs and each job's versions in recency order.
        self._resident: OrderedDict[JobKey, OrderedDict[int, ServedPolicy]] = OrderedDict()
        #: Loads in progress, so concurrent requests for one version share one fetch.
        self._loading: dict[VersionKey, asyncio.Task[ServedPolicy]] = {}
        #: KV read-throughs in progress, shared by concurrent requests for one job.
        self._reading: dict[JobKey, asyncio.Task[PolicyRecord | None]] = {}
        #: Jobs this cache knew whose record went (removed by their tenant): a load that
        #: was in flight then does not make them resident again.
        self._removed: set[JobKey] = set()
        self._kv: KeyValue
        self._store: ObjectStore
        self.loads = 0

    async def open(self) -> None:
        self._kv = await self.js.key_value(subjects.KV_POLICIES)
        self._store = await self.js.object_store(subjects.OBJ_CHECKPOINTS)

    @property
    def resident_count(self) -> int:
        return sum(len(v) for v in self._resident.values())

    # -- following the KV --------------------------------------------------------------------
    async def follow(self, ready: asyncio.Event | None = None) -> None:
        """Watch the ``policies`` KV until the service stops: record each job's latest
        version and preload it. ``ready`` is set once the bucket's current entries have been
        seen. A failed watch is started again (it replays the latest entries; older ones are
        ignored)."""
        await follow_kv(
            self._kv, self.stop, self._on_entry, on_ready=None if ready is None else ready.set
        )

    def _on_entry(self, entry: KeyValue.Entry) -> None:
        job = self._job_of_key(entry.key)
        if job is None:
            return
        try:
            record = policy_of(entry)
        except DecodeError as exc:
            log.warning("ignoring undecodable policies entry %s: %s", entry.key, exc)
            return
        if record is None:  # nothing committed any more (a removed job): stop serving it
            loading = any((t, j) == job for t, j, _ in self._loading)
            if job in self.records or job in self._resident or loading:
                self._removed.add(job)
            self.records.pop(job, None)
            self._resident.pop(job, None)
            return
        # Only jobs asked for here are followed: at start the watch replays every job ever
        # committed (records are kept), and most will never be asked for again.
        if job not in self.records and job not in self._resident and job not in self._reading:
            return  # (a job being read through is followed: the read may answer older)
        if self._note(record) and job in self._resident:
            self._start_load(record.tenant, record.job_id, record.version, record, preload=True)

    @staticmethod
    def _job_of_key(key: str) -> JobKey | None:
        tenant, sep, job_id = key.partition(".")
        return (tenant, job_id) if sep and tenant and job_id else None

    def _note(self, record: PolicyRecord) -> bool:
        """Record ``record`` if it is newer than what we know; True if it was."""
        job = (record.tenant, record.job_id)
        self._removed.discard(job)
        known = self.records.get(job)
        if known is not None and known.version >= record.version:
            return False
        self.records[job] = record
        if len(self.records) > RECORDS_PER_RESIDENT_JOB * self.max_jobs:
            # Jobs asked for whose policy never became resident (a load that failed).
            keep = {(t, j) for t, j, _ in self._loading} | set(self._resident)
            for stale in [k for k in self.records if k not in keep]:
                if stale != job:
                    del self.records[stale]
        return True

    async def latest_record(self, tenant: str, job_id: str) -> PolicyRecord:
        """The job's latest committed record; read through the KV when the watch has not
        delivered it yet. Raises PoisonError when nothing is committed for the job,
        :class:`Interrupted` when the service stops during the read."""
        job = (tenant, job_id)
        record = self.records.get(job)
        if record is not None:
            return record
        read = self._reading.get(job)
        if read is None:
            read = asyncio.create_task(self._read_record(tenant, job_id))
            self._reading[job] = read
            read.add_done_callback(lambda _: self._reading.pop(job, None))
            read.add_done_callback(retrieve_outcome)
        found = await until_stop(read, self.stop)
        if found is None:
            raise PoisonError(f"no committed policy for tenant {tenant!r} job {job_id!r}")
        self._note(found)
        return self.records[job]

    async def _read_record(self, tenant: str, job_id: str) -> PolicyRecord | None:
        try:
            record, _ = await get_policy(self._kv, tenant, job_id)
        except DecodeError as exc:
            raise PoisonError(f"policy record of {tenant}/{job_id} is unreadable: {exc}") from exc
        except NatsError as exc:
            raise RetryableError(f"policies KV unavailable: {exc}") from exc
        return record

    # -- resolving ---------------------------------------------------------------------------
    def resident(self, tenant: str, job_id: str, version: int) -> ServedPolicy | None:
        """What :meth:`resolve` answers at once when the version (0: the latest known) is
        resident; None when it has to be read or loaded first."""
        job = (tenant, job_id)
        versions = self._resident.get(job)
        if versions is None:
            return None
        if version == 0:
            record = self.records.get(job)
            if record is None:
                return None
            version = record.version
        served = versions.get(version)
        if served is not None:
            versions.move_to_end(version)
            self._resident.move_to_end(job)
        return served

    async def resolve(self, tenant: str, job_id: str, version: int) -> ServedPolicy:
        """The policy that serves a request: ``version`` 0 = the latest committed one.

        Raises :class:`PoisonError` for a job with no committed policy or a version that does
        not exist (any more), :class:`RetryableError` when the bus is unavailable,
        :class:`Interrupted` when the service stops while the version is loading.
        """
        if version < 0:
            raise PoisonError(f"policy_version must be >= 0, got {version}")
        record = await self.latest_record(tenant, job_id)
        if version == 0:
            try:
                return await self._resolve_version(tenant, job_id, record.version, record)
            except PoisonError:
                # The version known as the latest may have been pruned under a newer one the
                # watch has not delivered yet (a lagging watch, a small --keep-versions):
                # the newest serves "latest"; only without a newer one is the error its.
                fresh = await until_stop(self._read_record(tenant, job_id), self.stop)
                if fresh is None or fresh.version <= record.version:
                    raise
                self._note(fresh)
                return await self._resolve_version(tenant, job_id, fresh.version, fresh)
        return await self._resolve_version(tenant, job_id, version, record)

    async def _resolve_version(
        self, tenant: str, job_id: str, version: int, record: PolicyRecord
    ) -> ServedPolicy:
        """:meth:`resolve` of one version (``record``: the job's latest known record)."""
        if version > record.version:
            # The watch may not have delivered it yet, or may have missed it (a watch that
            # outlived a broker restart can stand still): the KV itself decides.
            fresh = await until_stop(self._read_record(tenant, job_id), self.stop)
            if fresh is not None and self._note(fresh):
                record = fresh
        if version > record.version:
            raise PoisonError(
                f"policy version {version} of {tenant}/{job_id} is not committed "
                f"(latest is {record.version})"
            )
        job = (tenant, job_id)
        resident = self._resident.get(job)
        if resident is not None and version in resident:
            resident.move_to_end(version)
            self._resident.move_to_end(job)
            return resident[version]
        exact = record if record.version == version else None
        # A request that gives up on stop leaves the shared load running (close() waits).
        served = await until_stop(self._start_load(tenant, job_id, version, exact), self.stop)
        if job in self._resident:
            self._resident.move_to_end(job)  # served now (a preload's admit did not touch it)
        return served

    def _start_load(
        self,
        tenant: str,
        job_id: str,
        version: int,
        record: PolicyRecord | None,
        *,
        preload: bool = False,
    ) -> asyncio.Task[ServedPolicy]:
        key = (tenant, job_id, version)
        task = self._loading.get(key)
        if task is None:
            task = asyncio.create_task(self._load(tenant, job_id, version, record, preload))
            self._loading[key] = task
            task.add_done_callback(lambda t: self._loaded(key, t))
        return task

    def _loaded(self, key: VersionKey, task: asyncio.Task[ServedPolicy]) -> None:
        self._loading.pop(key, None)
        if task.cancelled():
            return
        # Retrieving the exception here also keeps preloads nobody awaits from warning
        # "exception never retrieved"; requests that awaited the load report it themselves.
        exc = task.exception()
        if exc is not None:
            quiet = isinstance(exc, PoisonError | Interrupted)
            log.log(
                logging.DEBUG if quiet else logging.WARNING,
                "loading %s/%s v%d failed: %s",
                *key,
                exc,
            )

    async def close(self, timeout: float) -> None:
        """On stop: wait up to ``timeout`` seconds for loads and KV reads in progress (they
        end at their next step once stopping). Nothing is cancelled; one still running after
        the bound is left to finish on its own."""
        work = {*self._loading.values(), *self._reading.values()}
        if not work:
            return
        _, late = await asyncio.wait(work, timeout=timeout)
        if late:
            log.warning("%d policy loads still running %.1f s after stop", len(late), timeout)

    async def _load(
        self,
        tenant: str,
        job_id: str,
        version: int,
        record: PolicyRecord | None,
        preload: bool = False,
    ) -> ServedPolicy:
        if record is not None:
            name, sha256, spec = record.object_name, record.sha256, record.slot
        else:
            name, sha256 = await self._find_version(tenant, job_id, version)
            # A job's spec is fixed at OpenSlot: its latest record describes every version.
            spec = (await self.latest_record(tenant, job_id)).slot
        if self.stop.is_set():
            raise Interrupted()
        try:
            data = await ckpt.get_checkpoint(self._store, name, sha256, self.checkpoint_read_s)
        except ckpt.CheckpointError as exc:
            raise PoisonError(f"policy {tenant}/{job_id} v{version}: {exc}") from exc
        except (NatsError, TimeoutError) as exc:
            raise RetryableError(f"checkpoint store unavailable: {exc}") from exc
        if self.stop.is_set():
            raise Interrupted()
        slot = await asyncio.to_thread(TenantSlot.from_bytes, data, self.device)
        if slot.version != version:
            raise PoisonError(f"checkpoint {name} holds version {slot.version}, expected {version}")
        served = ServedPolicy(tenant, job_id, version, slot, spec)
        self._admit(served, preload)
        self.loads += 1
        log.info("loaded policy %s (%s head)", served.label, served.head.kind)
        return served

    async def _find_version(self, tenant: str, job_id: str, version: int) -> tuple[str, str]:
        """Object name and sha256 of a job's checkpoint ``version``
        (:func:`bus.checkpoints.committed_object`)."""
        try:
            return await ckpt.committed_object(self._kv, self._store, tenant, job_id, version)
        except ckpt.CheckpointError as exc:
            raise PoisonError(str(exc)) from exc
        except NatsError as exc:
            raise RetryableError(f"policies KV or checkpoint store unavailable: {exc}") from exc

    def _admit(self, served: ServedPolicy, preload: bool = False) -> None:
        """Make ``served`` resident, dropping the least recently used older versions, and the
        least recently served jobs past ``max_resident_jobs`` (a dropped job's next request
        loads it again). A preload does not count as serving its job, and is dropped if its
        job was dropped meanwhile; a load of a job removed meanwhile is not kept."""
        job = (served.tenant, served.job_id)
        if (preload and job not in self._resident) or job in self._removed:
            return
        versions = self._resident.setdefault(job, OrderedDict())
        if not preload:
            self._resident.move_to_end(job)
        while len(self._resident) > self.max_jobs:
            dropped, _ = self._resident.popitem(last=False)
            self.records.pop(dropped, None)  # asked for again, it is read through
        versions[served.version] = served
        versions.move_to_end(served.version)
        record = self.records.get(job)
        latest = record.version if record is not None else served.version
        while len(versions) > self.max_versions:
            victim = next((v for v in versions if v != latest), None)
            if victim is None:
                break
            del versions[victim]

    def gauges(self) -> dict[str, float]:
        return {
            "resident_policies": float(self.resident_count),
            "resident_jobs": float(len(self._resident)),
            "jobs_known": float(len(self.records)),
            "policy_loads": float(self.loads),
        }
