"""What ``joynexus chaos`` reads back and checks: each job's reported steps, its last
committed policy, and the comparison with the fault-free run (:func:`check`)."""

from __future__ import annotations

import io
from dataclasses import dataclass, field

import torch
from nats.js import JetStreamContext

from bus.kv import read_object_into
from bus.records import get_policy
from clients.sdk import Job
from schemas import subjects
from schemas.events import Progress, Rejected, StateChanged
from schemas.jobs import TERMINAL_STATUSES


@dataclass
class JobCheck:
    """One job's outcome in the chaos phase against the reference."""

    tenant: str
    kind: str
    status: str
    expected: int
    reported: list[int] = field(default_factory=list)
    #: Batches (SFT) or iterations (RL) its last committed policy applied.
    applied: int = 0
    #: Steps with no progress event (see :func:`check`).
    missing_events: int = 0
    lost: int = 0
    duplicated: int = 0
    params_equal: bool = False
    #: The largest difference of any parameter from the reference run's.
    max_param_diff: float = 0.0
    #: The first step whose loss or mean return differs from the reference run's (0: none).
    first_divergent_step: int = 0
    #: Whether a second fault-free run reaches the reference's parameters bit for bit on a
    #: CPU whose kernels are batch-invariant (only then is ``params_equal`` asked of the run
    #: with faults), and how far the second run lands.
    reproducible: bool = False
    fault_free_param_diff: float = 0.0
    reason: str = ""


@dataclass
class Outcome:
    """What a job reported, read from its stored events (a reconnect neither skips nor
    repeats one)."""

    status: str = "unknown"
    reason: str = ""
    #: The steps its progress events named, in order.
    steps: list[int] = field(default_factory=list)
    #: Its loss (SFT) or mean return (RL) at each of them.
    curve: list[float] = field(default_factory=list)


async def reported(job: Job) -> Outcome:
    outcome = Outcome()
    async for event in job.events(idle_timeout=600):
        if isinstance(event, Progress):
            outcome.steps.append(event.step)
            metrics = event.metrics
            outcome.curve.append(metrics.get("loss", metrics.get("return_mean", float("nan"))))
        elif isinstance(event, Rejected):
            outcome.status, outcome.reason = "rejected", event.reason
        elif isinstance(event, StateChanged) and event.status in TERMINAL_STATUSES:
            outcome.status, outcome.reason = event.status, event.reason
    return outcome


@dataclass
class Final:
    """A job's last committed policy: how many batches or iterations it applied, and its
    parameters."""

    applied: int = 0
    params: dict[str, torch.Tensor] = field(default_factory=dict)


async def final_policy(js: JetStreamContext, tenant: str, job_id: str) -> Final:
    from vla.slot import TenantSlot

    rec, _ = await get_policy(await js.key_value(subjects.KV_POLICIES), tenant, job_id)
    if rec is None:
        return Final()
    store = await js.object_store(subjects.OBJ_CHECKPOINTS)
    buf = io.BytesIO()
    await read_object_into(store, rec.object_name, buf)
    params = dict(TenantSlot.from_bytes(buf.getvalue()).module.state_dict())
    return Final(rec.batches_done, params)


def check(
    tenant: str,
    kind: str,
    expected: int,
    outcome: Outcome,
    reference: Outcome,
    final: Final,
    ref_params: dict[str, torch.Tensor],
) -> JobCheck:
    """Lost: a job that did not succeed, or applied fewer batches/iterations than asked;
    duplicated: more applied than asked, or a step reported twice. (A progress event the
    broker could not take while it was down is skipped by design, the next carries the job
    on: ``missing_events`` counts those apart; a batch applied twice under the same step
    would show in the parameters.)"""
    steps, params = outcome.steps, final.params
    result = JobCheck(tenant, kind, outcome.status, expected, steps, reason=outcome.reason)
    result.applied = final.applied
    result.duplicated = (
        len(steps)
        - len(set(steps))
        + max(0, final.applied - expected)
        + len(set(steps) - set(range(1, expected + 1)))
    )
    result.lost = max(0, expected - final.applied) + (outcome.status != "succeeded")
    result.missing_events = len(set(range(1, expected + 1)) - set(steps))
    same_keys = bool(params) and params.keys() == ref_params.keys()
    result.params_equal = same_keys and all(torch.equal(params[k], ref_params[k]) for k in params)
    result.max_param_diff = (
        max(float((params[k] - ref_params[k]).abs().max()) for k in params)
        if same_keys
        else float("inf")
    )
    ref_curve = dict(zip(reference.steps, reference.curve, strict=True))
    result.first_divergent_step = next(
        (s for s, v in zip(steps, outcome.curve, strict=True) if ref_curve.get(s) != v), 0
    )
    return result
