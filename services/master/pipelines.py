"""Pipelines: a job of stages run one after another, each stage a child job of its own
(``<pipeline id>-s<index>``) that starts from the policy the stage before it trained (an
eval stage passes on the policy it evaluated). The pipeline ends with its last stage, or
fails with the first stage that does not succeed. A pipeline cancelled or failed ends its
unfinished stages with it (a stage's services follow the stage's record, not the pipeline's).
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

from bus.errors import PoisonError
from schemas.ids import MAX_ID_CHARS
from schemas.jobs import TERMINAL_STATUSES, JobRecord
from schemas.specs import EvalJobSpec, PipelineSpec, RLJobSpec, SFTJobSpec, parse_job_spec

if TYPE_CHECKING:
    from services.master.service import Master


def stage_id(pipeline_id: str, index: int) -> str:
    """The job id of a pipeline's stage ``index``."""
    return f"{pipeline_id}-s{index}"


def check_stage_ids(pipeline_id: str, spec: PipelineSpec) -> None:
    """Refuse a pipeline whose id leaves its stages' ids no room (ids have 64 chars at most:
    cut, a stage's id could be the pipeline's own or another stage's)."""
    last = stage_id(pipeline_id, len(spec.stages) - 1)
    if len(last) > MAX_ID_CHARS:
        room = MAX_ID_CHARS - (len(last) - len(pipeline_id))
        raise PoisonError(
            f"job id: {pipeline_id!r} has {len(pipeline_id)} chars, but a pipeline of "
            f"{len(spec.stages)} stages names them '<job id>-s0' to {last[len(pipeline_id) :]!r} "
            f"and an id has {MAX_ID_CHARS} chars at most: give it {room} chars or fewer"
        )


async def start_stage(
    master: Master, pipeline_id: str, spec: PipelineSpec, index: int, previous: str | None
) -> None:
    """Submit stage ``index`` as a child job, starting from ``previous``'s policy."""
    stage = spec.stages[index]
    if previous is not None:
        if isinstance(stage, SFTJobSpec | RLJobSpec):
            stage = stage.model_copy(update={"init_from": previous})
        elif isinstance(stage, EvalJobSpec):
            stage = stage.model_copy(update={"policy_job": previous, "policy_version": 0})
    child = stage_id(pipeline_id, index)
    document = json.dumps(stage.model_dump(mode="json")).encode()
    try:
        # Admitted with its pipeline (which holds what its largest stage does).
        tenant = await master.gate.record(spec.tenant)
        limits = tenant.limits if tenant is not None else None
        await master.accept(child, stage, document, parent=pipeline_id, limits=limits)
    except PoisonError as exc:
        await master.transition(
            spec.tenant, pipeline_id, "failed", reason=f"stage {index} ({stage.kind}): {exc}"
        )
        return
    # The pipeline may have been cancelled while the stage was being accepted (its
    # end_stages found no record of it yet): the stage, recorded now, ends with it.
    found = await master.record(spec.tenant, pipeline_id)
    if found is not None and found[0].status in TERMINAL_STATUSES:
        await end_stages(master, spec.tenant, pipeline_id, spec, found[0].status)


async def advance_pipeline(master: Master, child: JobRecord) -> None:
    """A stage ended: start the next one, or end the pipeline with the stage's outcome."""
    found = await master.record(child.tenant, child.parent)
    if found is None:
        return
    parent, _ = found
    spec = parse_job_spec(parent.spec_json)
    assert isinstance(spec, PipelineSpec)
    index = int(child.job_id.rsplit("-s", 1)[-1])
    if child.status != "succeeded":
        await master.transition(
            child.tenant,
            parent.job_id,
            "failed",
            reason=f"stage {index} {child.status}: {child.reason}",
        )
        return
    if index + 1 == len(spec.stages):
        await master.transition(
            child.tenant,
            parent.job_id,
            "succeeded",
            metrics=dict(child.metrics),
            policy_version=child.policy_version,
        )
        return
    if parent.status in TERMINAL_STATUSES:
        return  # cancelled meanwhile (its stages with it): no stage after this one
    following = await master.record(child.tenant, stage_id(parent.job_id, index + 1))
    if (
        following is not None
        and following[0].parent == parent.job_id
        and following[0].status != "accepted"
    ):
        return  # started already (this stage's end handled again)
    trained = child.job_id
    if child.kind == "eval":  # an eval stage passes on the policy it evaluated
        trained = parse_job_spec(child.spec_json).policy_job  # type: ignore[union-attr]
    await start_stage(master, parent.job_id, spec, index + 1, previous=trained)


async def end_stages(
    master: Master, tenant: str, pipeline_id: str, spec: PipelineSpec, reason: str
) -> None:
    """The pipeline ended ``reason`` (cancelled, failed): so do its unfinished stages."""
    for index in range(len(spec.stages)):
        child = stage_id(pipeline_id, index)
        found = await master.record(tenant, child)
        if found is None or found[0].status in TERMINAL_STATUSES:
            continue
        if await master.transition(
            tenant, child, "cancelled", reason=f"its pipeline {pipeline_id} {reason}"
        ):
            await master.close_slot(tenant, child, "cancelled")
