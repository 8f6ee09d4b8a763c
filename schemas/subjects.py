"""Subject and stream names: one builder per subject family (DESIGN.md §2).

Every token that comes from a user is validated by :func:`schemas.ids.validate_id`, so no
tenant can address another tenant's subjects with ``.``, ``*`` or ``>``.
"""

from __future__ import annotations

import re
from typing import Literal, NamedTuple

from schemas.ids import InvalidIdError, validate_id

PREFIX = "nexus"

STREAM_JOBS = "JOBS"
STREAM_TRAIN = "TRAIN"
STREAM_INFER = "INFER"
STREAM_ENV = "ENV"
STREAM_EVENTS = "EVENTS"
STREAM_DEAD = "DEAD"
STREAM_USAGE = "USAGE"

KV_JOBS = "jobs"
KV_POLICIES = "policies"
KV_HEARTBEATS = "heartbeats"
KV_PLACEMENT = "placement"
OBJ_CHECKPOINTS = "checkpoints"
#: Messages too large for one NATS message, stored here and sent as a reference
#: (:class:`schemas.train.PayloadRef`); deleted once consumed, else after the bucket's max age.
OBJ_PAYLOADS = "payloads"
#: Registered tenants (:class:`schemas.tenants.TenantRecord`), written by the operator.
KV_TENANTS = "tenants"
#: Datasets in tenants' namespaces (:class:`schemas.tenants.DatasetRecord`), key
#: ``<tenant>.<dataset>``; written by the master (pushed) or the operator (registered).
KV_DATASETS = "datasets"
#: Redelivered messages whose handling started and never settled, key
#: ``<stream>.<durable>.<stream seq>`` (:mod:`bus.crashes`).
KV_CRASHES = "crashes"

JobVerb = Literal["submit", "cancel", "pause", "resume"]
JOB_VERBS: tuple[str, ...] = ("submit", "cancel", "pause", "resume")

#: Core NATS request-reply (no stream): "describe this env" (:mod:`schemas.envdesc`), answered
#: by one env worker of the ``envs`` queue group. Outside ``nexus.env.>``, which ENV stores.
ENV_DESCRIBE = f"{PREFIX}.envinfo.describe"
#: Queue depth and wait per tenant, published by the scheduling services (:mod:`schemas.metrics`).
QUEUE_METRICS = f"{PREFIX}.metrics.queues"
#: Every env worker prepares simulator sessions asked for here (:mod:`schemas.envctl`).
ENVS_PREWARM = f"{PREFIX}.ctl.envs.prewarm"
#: Queue group of the env workers answering :data:`ENV_DESCRIBE`.
ENV_DESCRIBE_QUEUE = "envs"

#: Core NATS request-reply a tenant sends about its own things: ``nexus.ctl.tenant.<tenant>.<op>``,
#: answered by the master (queue group :data:`TENANT_CTL_QUEUE`). A tenant may publish only
#: under its own tenant token (the broker enforces it; the master checks again).
TENANT_CTL_OPS: tuple[str, ...] = (
    "job",
    "jobs",
    "job-rm",
    "datasets",
    "dataset-add",
    "dataset-rm",
    "export",
    "export-rm",
    "submit",
    "cancel",
    "events",
    "dataset-plan",
    "dataset-part",
    "export-read",
    "call",
    "lease",
    "act",
)
TENANT_CTL_QUEUE = "master"
#: Core NATS request-reply: what backbones are served now (no tenant data; any identity).
BACKBONES_QUERY = f"{PREFIX}.ctl.backbones"

EventKind = Literal["accepted", "rejected", "state", "progress", "metrics", "policy", "error"]


def job(tenant: str, verb: str) -> str:
    """``nexus.job.<tenant>.<verb>`` — a job lifecycle command."""
    if verb not in JOB_VERBS:
        raise ValueError(f"unknown job verb {verb!r}; expected one of {JOB_VERBS}")
    return f"{PREFIX}.job.{validate_id(tenant, 'tenant')}.{verb}"


def train(backbone: str, tenant: str) -> str:
    """``nexus.train.<backbone>.<tenant>`` — the tenant's Training Queue subject."""
    return f"{PREFIX}.train.{validate_id(backbone, 'backbone')}.{validate_id(tenant, 'tenant')}"


def trainer_durable(backbone: str, tenant: str) -> str:
    """``trainer-<backbone>-<tenant>`` — the trainers' durable on the tenant's Training Queue
    (env workers read its pending count for a dataset stream's backpressure)."""
    return f"trainer-{validate_id(backbone, 'backbone')}-{validate_id(tenant, 'tenant')}"


def infer(backbone: str, tenant: str) -> str:
    """``nexus.infer.<backbone>.<tenant>`` — the tenant's Inference Queue subject."""
    return f"{PREFIX}.infer.{validate_id(backbone, 'backbone')}.{validate_id(tenant, 'tenant')}"


def env(tenant: str, job_id: str) -> str:
    """``nexus.env.<tenant>.<job>`` — rollout and dataset tasks of one job."""
    return f"{PREFIX}.env.{validate_id(tenant, 'tenant')}.{validate_id(job_id, 'job')}"


def event(tenant: str, job_id: str, kind: str) -> str:
    """``nexus.event.<tenant>.<job>.<kind>`` — something a tenant may watch."""
    return (
        f"{PREFIX}.event.{validate_id(tenant, 'tenant')}.{validate_id(job_id, 'job')}."
        f"{validate_id(kind, 'event kind')}"
    )


def events_of_job(tenant: str, job_id: str) -> str:
    """Filter for every event of one job."""
    return f"{PREFIX}.event.{validate_id(tenant, 'tenant')}.{validate_id(job_id, 'job')}.>"


def dead(stream: str, tenant: str) -> str:
    """``nexus.dead.<stream>.<tenant>`` — a dead-letter record. ``tenant`` may be ``unknown``."""
    return f"{PREFIX}.dead.{stream.lower()}.{validate_id(tenant, 'tenant')}"


def env_describe(tenant: str | None = None) -> str:
    """Where to ask the env workers to describe an env: a tenant asks under its own token
    (``nexus.envinfo.describe.<tenant>``) so the answer can go only to its own inbox; a
    service or the operator on the bare subject."""
    return ENV_DESCRIBE if tenant is None else f"{ENV_DESCRIBE}.{validate_id(tenant, 'tenant')}"


def backbones_query(tenant: str | None = None) -> str:
    """Where to ask what backbones are served (a tenant under its own token, as
    :func:`env_describe`)."""
    if tenant is None:
        return BACKBONES_QUERY
    return f"{BACKBONES_QUERY}.{validate_id(tenant, 'tenant')}"


def shared_query_tenant(subject: str, base: str) -> str | None:
    """The tenant token of a shared query (``<base>.<tenant>``); None for the bare ``base``.
    Raises :class:`SubjectError` for anything else."""
    if subject == base:
        return None
    tenant = subject.removeprefix(f"{base}.")
    if tenant == subject:
        raise SubjectError(f"{subject!r} is not {base!r} or {base!r}.<tenant>")
    try:
        return validate_id(tenant, "tenant")
    except InvalidIdError as exc:
        raise SubjectError(f"{subject!r}: {exc}") from exc


def train_wake(backbone: str) -> str:
    """``nexus.wake.train.<backbone>``: core NATS, no payload, published by the master after it
    queued a session call on that backbone's Training Queue, so an idle trainer fetches it at
    once (services only: tenants may neither publish nor subscribe here)."""
    return f"{PREFIX}.wake.train.{validate_id(backbone, 'backbone')}"


def tenant_ctl(tenant: str, op: str) -> str:
    """``nexus.ctl.tenant.<tenant>.<op>`` — a tenant's request about its own jobs and data."""
    if op not in TENANT_CTL_OPS:
        raise ValueError(f"unknown tenant request {op!r}; expected one of {TENANT_CTL_OPS}")
    return f"{PREFIX}.ctl.tenant.{validate_id(tenant, 'tenant')}.{op}"


def tenant_ctl_all(tenant: str | None = None) -> str:
    """Filter for the requests of one tenant (or of every tenant)."""
    if tenant is None:
        return f"{PREFIX}.ctl.tenant.*.*"
    return f"{PREFIX}.ctl.tenant.{validate_id(tenant, 'tenant')}.*"


def cache_ctl(backbone: str) -> str:
    """``nexus.ctl.cache.<backbone>``: an operator's question to that backbone's trainers
    about their feature caches (:mod:`schemas.cachectl`)."""
    return f"{PREFIX}.ctl.cache.{validate_id(backbone, 'backbone')}"


def features_encode(backbone: str) -> str:
    """``nexus.features.<backbone>.encode`` — core NATS request-reply to the backbone role
    (:class:`schemas.feature.EncodeRequest`), answered by one instance of the queue group
    :func:`features_queue`. Services only: no tenant identity may publish it."""
    return f"{PREFIX}.features.{validate_id(backbone, 'backbone')}.encode"


def features_queue(backbone: str) -> str:
    """Queue group of the backbone role instances serving ``backbone``."""
    return f"backbone-{validate_id(backbone, 'backbone')}"


def feature_bucket(backbone: str) -> str:
    """The object store bucket of one backbone's feature records too big for a message."""
    return f"features-{validate_id(backbone, 'backbone')}"


def feature_cache_bucket(backbone: str) -> str:
    """The object store bucket of one backbone's feature cache (per-sample features kept
    across trainers and restarts, under the operator's budget)."""
    return f"featcache-{validate_id(backbone, 'backbone')}"


def usage(service: str, instance: str) -> str:
    """Where a service instance reports its usage per tenant (:mod:`schemas.usage`); an
    instance id's characters other than letters, digits, ``-`` and ``_`` become ``_``."""
    instance_token = re.sub(r"[^A-Za-z0-9_-]", "_", instance) or "_"
    return f"{PREFIX}.usage.{validate_id(service, 'service')}.{instance_token}"


def tenant_bucket(tenant: str) -> str:
    """The tenant's own object store bucket: its pushed datasets and exported policies."""
    return f"data-{validate_id(tenant, 'tenant')}"


#: The inbox prefix of the services' connections (with creds): no tenant's (ids are lowercase),
#: and not the operator's ``_INBOX``, which a tenant's request may name as its reply (so a
#: tenant can never have a service's answer delivered into another service's inbox).
SERVICE_INBOX_PREFIX = "_INBOX_SVC"


def tenant_inbox_prefix(tenant: str) -> str:
    """The inbox prefix a tenant's connection uses (the only subjects it may subscribe to)."""
    return f"_INBOX_{validate_id(tenant, 'tenant')}"


#: Subject filters of each stream (what the stream stores).
STREAM_SUBJECTS: dict[str, list[str]] = {
    STREAM_JOBS: [f"{PREFIX}.job.>"],
    STREAM_TRAIN: [f"{PREFIX}.train.>"],
    STREAM_INFER: [f"{PREFIX}.infer.>"],
    STREAM_ENV: [f"{PREFIX}.env.>"],
    STREAM_EVENTS: [f"{PREFIX}.event.>"],
    STREAM_DEAD: [f"{PREFIX}.dead.>"],
    STREAM_USAGE: [f"{PREFIX}.usage.>"],
}


def tenant_of(subject: str) -> str | None:
    """Best-effort tenant token of a ``nexus.*`` subject (for dead-lettering unparseable input)."""
    parts = subject.split(".")
    if len(parts) < 3 or parts[0] != PREFIX:
        return None
    family = parts[1]
    index = {"job": 2, "env": 2, "event": 2, "dead": 3, "train": 3, "infer": 3}.get(family)
    if index is None or index >= len(parts):
        return None
    return parts[index]


# -- parsing: the inverse of the builders above ----------------------------------------------


class SubjectError(ValueError):
    """A subject that is not of the expected family, or has a token no builder would write."""


class JobSubject(NamedTuple):
    tenant: str
    verb: str


class TrainSubject(NamedTuple):
    backbone: str
    tenant: str


class InferSubject(NamedTuple):
    backbone: str
    tenant: str


class EnvSubject(NamedTuple):
    tenant: str
    job_id: str


class EventSubject(NamedTuple):
    tenant: str
    job_id: str
    kind: str


class TenantCtlSubject(NamedTuple):
    tenant: str
    op: str


class DeadSubject(NamedTuple):
    stream: str
    tenant: str


def _tokens(subject: str, family: str, count: int, kinds: tuple[str, ...]) -> list[str]:
    """The ``count`` tokens after ``nexus.<family>.``, each checked as an id of its kind."""
    parts = subject.split(".")
    if parts[:2] != [PREFIX, family] or len(parts) != 2 + count:
        raise SubjectError(
            f"{subject!r} is not a {PREFIX}.{family} subject of {count} tokens after the family"
        )
    tokens = parts[2:]
    try:
        for token, kind in zip(tokens, kinds, strict=True):
            validate_id(token, kind)
    except InvalidIdError as exc:
        raise SubjectError(f"{subject!r}: {exc}") from exc
    return tokens


def parse_job(subject: str) -> JobSubject:
    """``nexus.job.<tenant>.<verb>`` → (tenant, verb); the verb is one of :data:`JOB_VERBS`."""
    tenant, verb = _tokens(subject, "job", 2, ("tenant", "job verb"))
    if verb not in JOB_VERBS:
        raise SubjectError(f"{subject!r}: unknown job verb {verb!r}; expected one of {JOB_VERBS}")
    return JobSubject(tenant, verb)


def parse_train(subject: str) -> TrainSubject:
    """``nexus.train.<backbone>.<tenant>`` → (backbone, tenant)."""
    return TrainSubject(*_tokens(subject, "train", 2, ("backbone", "tenant")))


def tenant_of_train(subject: str) -> str:
    """The tenant of a Training Queue subject."""
    return parse_train(subject).tenant


def parse_infer(subject: str) -> InferSubject:
    """``nexus.infer.<backbone>.<tenant>`` → (backbone, tenant)."""
    return InferSubject(*_tokens(subject, "infer", 2, ("backbone", "tenant")))


def parse_env(subject: str) -> EnvSubject:
    """``nexus.env.<tenant>.<job>`` → (tenant, job_id)."""
    return EnvSubject(*_tokens(subject, "env", 2, ("tenant", "job")))


def parse_event(subject: str) -> EventSubject:
    """``nexus.event.<tenant>.<job>.<kind>`` → (tenant, job_id, kind)."""
    return EventSubject(*_tokens(subject, "event", 3, ("tenant", "job", "event kind")))


def parse_dead(subject: str) -> DeadSubject:
    """``nexus.dead.<stream>.<tenant>`` → (stream, tenant); ``stream`` is lower-case, as
    :func:`dead` writes it."""
    stream, tenant = _tokens(subject, "dead", 2, ("stream", "tenant"))
    return DeadSubject(stream, tenant)


def parse_tenant_ctl(subject: str) -> TenantCtlSubject:
    """``nexus.ctl.tenant.<tenant>.<op>`` → (tenant, op), op one of :data:`TENANT_CTL_OPS`."""
    parts = subject.split(".")
    if parts[:3] != [PREFIX, "ctl", "tenant"] or len(parts) != 5:
        raise SubjectError(f"{subject!r} is not a {PREFIX}.ctl.tenant.<tenant>.<op> subject")
    try:
        tenant = validate_id(parts[3], "tenant")
    except InvalidIdError as exc:
        raise SubjectError(f"{subject!r}: {exc}") from exc
    if parts[4] not in TENANT_CTL_OPS:
        raise SubjectError(
            f"{subject!r}: unknown tenant request {parts[4]!r}; expected one of {TENANT_CTL_OPS}"
        )
    return TenantCtlSubject(tenant, parts[4])
