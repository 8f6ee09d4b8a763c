"""What each tenant used of a service, reported by every service instance on the ``USAGE``
stream (``nexus.usage.<service>.<instance>``) every few seconds and when it stops; ``joynexus
usage`` adds the reports up into a bill.

A report covers the period since the instance's previous one. ``busy_s`` is the service's own
measured compute time in that period (the trainer's steps and updates, the inferencer's batch
forwards, the env worker's simulator calls), and ``compute_s`` of each tenant is that time
split among the tenants it served: a grouped forward or step by each tenant's share of its
samples (or observations, or env steps), so the tenants' shares add up to the service's
``busy_s``. An env worker's simulator calls of different tasks can overlap; each call is
charged its own duration, and ``busy_s`` is the sum of those durations (what the tenants
used), not the wall-clock union of them.
"""

from __future__ import annotations

from typing import Literal

import msgspec

UsageService = Literal["trainer", "inferencer", "envs"]


class TenantUsage(msgspec.Struct, frozen=True):
    """One tenant's use of one service instance in one period, for one of its jobs."""

    tenant: str
    #: Seconds of the service's compute charged to the tenant.
    compute_s: float = 0.0
    #: Samples trained: SFT/low-level batch rows, RL environment steps learned from.
    samples: int = 0
    #: Simulator steps taken for its rollouts and evaluations.
    env_steps: int = 0
    #: Act requests answered, and the observations in them.
    act_requests: int = 0
    observations: int = 0
    #: Bytes of checkpoint versions written to the object store.
    checkpoint_bytes: int = 0
    #: The job the work was for.
    job_id: str = ""


class UsageReport(msgspec.Struct, frozen=True, tag="usage"):
    """An instance's usage since its previous report (``seq`` - 1)."""

    service: UsageService
    instance: str
    #: Counts the instance's reports from 1; with ``instance`` it is the report's identity.
    seq: int
    period_start: float
    period_end: float
    #: The service's measured compute seconds in the period (the sum of ``compute_s``).
    busy_s: float
    tenants: list[TenantUsage] = msgspec.field(default_factory=list)


USAGE_REPORT_DECODER = msgspec.msgpack.Decoder(UsageReport)
