"""What the bus says about an env task's job: where the trainer has got to (committed
batches, trained iterations), whether the job ended, and how many of its tenant's batches wait
in ``TRAIN`` (the dataset stream's backpressure, :mod:`services.envs.flow`)."""

from __future__ import annotations

import logging

from nats.errors import Error as NatsError
from nats.js import JetStreamContext
from nats.js.errors import NotFoundError

from bus.errors import RetryableError
from bus.records import get_job, get_policy, job_removed
from schemas import subjects
from schemas.env import RolloutTask, StreamDataset
from schemas.jobs import TERMINAL_STATUSES

log = logging.getLogger(__name__)


async def committed_batches(js: JetStreamContext, task: StreamDataset) -> int:
    """Batches of the job the trainer has committed (where a restarted stream resumes)."""
    kv = await js.key_value(subjects.KV_POLICIES)
    record, _ = await get_policy(kv, task.tenant, task.job_id)
    return record.batches_done if record is not None else 0


async def iteration_done(js: JetStreamContext, task: RolloutTask) -> bool:
    """Whether the trainer already finished the task's iteration: a redelivered task
    (its worker killed after publishing, before acking) must not fail the job because
    the version it names is no longer stored. Version ``v`` is the policy after
    ``v - 1`` iterations, so iteration ``i`` is done once version ``i + 2`` exists."""
    try:
        record, _ = await get_policy(
            await js.key_value(subjects.KV_POLICIES), task.tenant, task.job_id
        )
    except NatsError as exc:
        raise RetryableError(f"policies KV unavailable: {exc}") from exc
    if record is not None and record.version >= task.iteration + 2:
        log.info(
            "rollout %s/%s iteration %d: already trained on (v%d); dropped",
            task.tenant,
            task.job_id,
            task.iteration,
            record.version,
        )
        return True
    return False


async def job_ended(js: JetStreamContext, tenant: str, job_id: str) -> bool:
    """Whether the job's record says it ended (done, failed or cancelled), or its tenant
    removed it (it had ended)."""
    jobs = await js.key_value(subjects.KV_JOBS)
    record, _ = await get_job(jobs, tenant, job_id)
    if record is None:
        return await job_removed(jobs, tenant, job_id)
    return record.status in TERMINAL_STATUSES


async def unconsumed(js: JetStreamContext, backbone: str, tenant: str) -> int:
    """The tenant's batches in ``TRAIN`` its trainer has not settled: what its durable
    has yet to deliver or has delivered unacked. Not the stream's count on the subject:
    after a broker crash an interest stream can keep messages its consumer already
    acked, and a stream waiting for those to go would wait for ever."""
    subject = subjects.train(backbone, tenant)
    try:
        consumer = await js.consumer_info(
            subjects.STREAM_TRAIN, subjects.trainer_durable(backbone, tenant)
        )
        return int(consumer.num_pending or 0) + int(consumer.num_ack_pending or 0)
    except NotFoundError:
        pass  # no trainer bound the tenant yet: nothing was consumed, the stream counts
    try:
        info = await js.stream_info(subjects.STREAM_TRAIN, subjects_filter=subject)
    except NotFoundError as exc:
        raise RetryableError("TRAIN stream not declared yet") from exc
    return int((info.state.subjects or {}).get(subject, 0))
