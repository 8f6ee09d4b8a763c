"""Subject and stream names: one builder per subject family (DESIGN.md §2).

Every token that comes from a user is validated by :func:`schemas.ids.validate_id`, so no
tenant can address another tenant's subjects with ``.``, ``*`` or ``>``.
"""

from __future__ import annotations

from typing import Literal

from schemas.ids import validate_id

PREFIX = "nexus"

STREAM_JOBS = "JOBS"
STREAM_TRAIN = "TRAIN"
STREAM_INFER = "INFER"
STREAM_ENV = "ENV"
STREAM_EVENTS = "EVENTS"
STREAM_DEAD = "DEAD"

KV_JOBS = "jobs"
KV_POLICIES = "policies"
KV_HEARTBEATS = "heartbeats"
KV_PLACEMENT = "placement"
OBJ_CHECKPOINTS = "checkpoints"

JobVerb = Literal["submit", "cancel", "pause", "resume"]
JOB_VERBS: tuple[str, ...] = ("submit", "cancel", "pause", "resume")

EventKind = Literal["accepted", "rejected", "state", "progress", "metrics", "policy", "error"]


def job(tenant: str, verb: str) -> str:
    """``nexus.job.<tenant>.<verb>`` — a job lifecycle command."""
    if verb not in JOB_VERBS:
        raise ValueError(f"unknown job verb {verb!r}; expected one of {JOB_VERBS}")
    return f"{PREFIX}.job.{validate_id(tenant, 'tenant')}.{verb}"


def train(backbone: str, tenant: str) -> str:
    """``nexus.train.<backbone>.<tenant>`` — the tenant's Training Queue subject."""
    return f"{PREFIX}.train.{validate_id(backbone, 'backbone')}.{validate_id(tenant, 'tenant')}"


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


#: Subject filters of each stream (what the stream stores).
STREAM_SUBJECTS: dict[str, list[str]] = {
    STREAM_JOBS: [f"{PREFIX}.job.>"],
    STREAM_TRAIN: [f"{PREFIX}.train.>"],
    STREAM_INFER: [f"{PREFIX}.infer.>"],
    STREAM_ENV: [f"{PREFIX}.env.>"],
    STREAM_EVENTS: [f"{PREFIX}.event.>"],
    STREAM_DEAD: [f"{PREFIX}.dead.>"],
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
