"""Declaring the streams, KV buckets and object store of DESIGN.md §2 — idempotently.

:func:`declare` creates what is missing and checks what exists. An existing stream whose
essential settings differ (subjects, retention, storage, replicas) is reported as a
:class:`DeclareConflict`; it is never silently replaced, because replacing a live work-queue
stream would drop accepted work.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from nats.js import JetStreamContext
from nats.js.api import ObjectStoreConfig, RetentionPolicy, StorageType, StreamConfig
from nats.js.errors import NotFoundError

from schemas import subjects as s

DAY = 86_400.0


class DeclareConflict(RuntimeError):
    """An existing stream/bucket differs from the declared one in an essential setting."""


@dataclass(frozen=True)
class BusLayout:
    """What :func:`declare` creates. ``replicas`` is 1 locally, 3 in the cluster profile."""

    replicas: int = 1
    events_max_age_s: float = 7 * DAY
    dead_max_age_s: float = 30 * DAY
    jobs_max_age_s: float = 30 * DAY
    #: How long usage reports are kept (``joynexus usage --since`` reaches back this far).
    usage_max_age_s: float = 90 * DAY
    heartbeat_ttl_s: float = 5.0
    #: How long a crash-ledger count outlives its last update (:mod:`bus.crashes`).
    crash_ledger_ttl_s: float = DAY
    duplicate_window_s: float = 120.0
    max_msg_size: int = -1
    #: How long a message stored by reference (:mod:`bus.payloads`) is kept when nobody
    #: consumes it (its consumer deletes it once the message is acknowledged): as long as a
    #: dead letter, whose reference it is.
    payloads_max_age_s: float = 30 * DAY

    def streams(self) -> list[StreamConfig]:
        def cfg(name: str, retention: RetentionPolicy, max_age: float | None) -> StreamConfig:
            return StreamConfig(
                name=name,
                subjects=s.STREAM_SUBJECTS[name],
                retention=retention,
                storage=StorageType.FILE,
                num_replicas=self.replicas,
                max_age=max_age,
                duplicate_window=self.duplicate_window_s,
                max_msg_size=self.max_msg_size,
            )

        return [
            cfg(s.STREAM_JOBS, RetentionPolicy.LIMITS, self.jobs_max_age_s),
            cfg(s.STREAM_TRAIN, RetentionPolicy.WORK_QUEUE, None),
            cfg(s.STREAM_INFER, RetentionPolicy.WORK_QUEUE, None),
            cfg(s.STREAM_ENV, RetentionPolicy.WORK_QUEUE, None),
            cfg(s.STREAM_EVENTS, RetentionPolicy.LIMITS, self.events_max_age_s),
            cfg(s.STREAM_DEAD, RetentionPolicy.LIMITS, self.dead_max_age_s),
            cfg(s.STREAM_USAGE, RetentionPolicy.LIMITS, self.usage_max_age_s),
        ]

    def kv_buckets(self) -> dict[str, dict[str, float | int | None]]:
        """bucket → (history, ttl)."""
        return {
            s.KV_JOBS: {"history": 5, "ttl": None},
            s.KV_POLICIES: {"history": 10, "ttl": None},
            s.KV_HEARTBEATS: {"history": 1, "ttl": self.heartbeat_ttl_s},
            s.KV_PLACEMENT: {"history": 1, "ttl": None},
            s.KV_TENANTS: {"history": 5, "ttl": None},
            s.KV_DATASETS: {"history": 5, "ttl": None},
            s.KV_CRASHES: {"history": 1, "ttl": self.crash_ledger_ttl_s},
        }


@dataclass
class DeclareReport:
    """What a :func:`declare` call did."""

    created: list[str] = field(default_factory=list)
    existing: list[str] = field(default_factory=list)


def _essential(config: StreamConfig) -> dict[str, object]:
    return {
        "subjects": sorted(config.subjects or []),
        "retention": config.retention,
        "storage": config.storage,
        "num_replicas": config.num_replicas or 1,
    }


async def _ensure_stream(js: JetStreamContext, want: StreamConfig, report: DeclareReport) -> None:
    assert want.name is not None
    try:
        info = await js.stream_info(want.name)
    except NotFoundError:
        await js.add_stream(want)
        report.created.append(f"stream {want.name}")
        return
    have, need = _essential(info.config), _essential(want)
    diffs = [f"{k}: existing {have[k]!r}, declared {need[k]!r}" for k in need if have[k] != need[k]]
    if diffs:
        raise DeclareConflict(f"stream {want.name} exists with other settings: " + "; ".join(diffs))
    report.existing.append(f"stream {want.name}")


async def declare(js: JetStreamContext, layout: BusLayout | None = None) -> DeclareReport:
    """Create missing streams, KV buckets and the object stores (checkpoints, payloads);
    verify existing ones. Safe to call from every service at start-up, concurrently."""
    layout = layout or BusLayout()
    report = DeclareReport()
    for config in layout.streams():
        await _ensure_stream(js, config, report)
    for bucket, opts in layout.kv_buckets().items():
        ttl = opts["ttl"]
        stream_name = f"KV_{bucket}"
        try:
            info = await js.stream_info(stream_name)
        except NotFoundError:
            await js.create_key_value(
                bucket=bucket,
                history=int(opts["history"] or 1),
                ttl=ttl,
                storage=StorageType.FILE,
                replicas=layout.replicas,
            )
            report.created.append(f"kv {bucket}")
            continue
        have_ttl = info.config.max_age or None
        if (have_ttl or None) != (ttl or None):
            raise DeclareConflict(f"kv {bucket} exists with ttl {have_ttl!r}, declared {ttl!r}")
        report.existing.append(f"kv {bucket}")
    for bucket, max_age in ((s.OBJ_CHECKPOINTS, None), (s.OBJ_PAYLOADS, layout.payloads_max_age_s)):
        try:
            await js.stream_info(f"OBJ_{bucket}")
            report.existing.append(f"object store {bucket}")
        except NotFoundError:
            store_config = ObjectStoreConfig(
                bucket=bucket, ttl=max_age, storage=StorageType.FILE, replicas=layout.replicas
            )
            await js.create_object_store(bucket, config=store_config)
            report.created.append(f"object store {bucket}")
    return report
