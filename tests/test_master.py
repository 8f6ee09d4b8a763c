"""The master's answers to tenants: every event has an identity-derived ``Nats-Msg-Id`` (a
replayed publish is a no-op), and every submit whose envelope decodes is answered with a
``rejected`` event naming what was wrong, whatever headers the client set."""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest
import pytest_asyncio
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js import JetStreamContext

import bus.publish as bus_publish
from bus.codec import decode, encode
from bus.connect import connect
from bus.datacache import DatasetCache
from bus.datasets import register_path
from bus.declare import declare
from bus.errors import PoisonError, RetryableError
from bus.inference import observation
from bus.publish import publish_event
from bus.records import put_job, put_policy
from bus.server import EmbeddedServer
from schemas import headers, subjects
from schemas.events import EVENT_DECODER, Accepted, PolicyPublished, Rejected, StateChanged
from schemas.infer import ActReply
from schemas.jobs import JobCancel, JobRecord, JobSubmit
from schemas.limits import InputLimits
from schemas.model import HeadConfig, OptimizerConfig
from schemas.specs import EvalJobSpec, parse_job_spec
from schemas.tenantctl import Sampled, SamplePolicy
from schemas.tenants import TenantLimits, TenantRecord
from schemas.train import TRAIN_DECODER, CloseSlot, OpenSlot, PolicyRecord
from services.envs.datasets import record
from services.envs.describe import Describer
from services.envs.sims import REACH2D_ID
from services.master.admission import UNEXPECTED_TRIES
from services.master.plans import Datasets, compile_eval
from services.master.service import Master
from services.master.sessions import Sessions
from services.master.tenantjobs import TenantJobs
from tests.conftest import Procs
from tests.helpers import start_service, uid


async def _stored(js: JetStreamContext, subject: str) -> int:
    """Messages the EVENTS stream holds on ``subject``."""
    info = await js.stream_info(subjects.STREAM_EVENTS, subjects_filter=subject)
    return (info.state.subjects or {}).get(subject, 0)


async def _first_event(js: JetStreamContext, tenant: str, job_id: str) -> object:
    sub = await js.subscribe(subjects.events_of_job(tenant, job_id), ordered_consumer=True)
    try:
        return decode(EVENT_DECODER, (await sub.next_msg(timeout=30)).data)
    finally:
        await sub.unsubscribe()


def _rl_spec(tenant: str) -> bytes:
    """A valid job spec whose plan needs no dataset on disk."""
    spec = {
        "kind": "rl",
        "tenant": tenant,
        "env": "JoyNexus/Reach2D-v0",
        "head": {"kind": "oft", "action_dim": 2, "value_head": True},
        "iterations": 1,
    }
    return json.dumps(spec).encode()


@pytest_asyncio.fixture
async def own_nc(fresh_server: EmbeddedServer) -> AsyncIterator[NATS]:
    """A server of this test alone: the master under test publishes slot and env tasks that
    no other test's trainer or env worker may pick up."""
    nc = await connect(fresh_server.url, name="pytest-master")
    await declare(nc.jetstream())
    yield nc
    await nc.close()


@pytest.fixture
def own_js(own_nc: NATS) -> JetStreamContext:
    return own_nc.jetstream()


async def _master(js: JetStreamContext) -> Master:
    return Master(
        js,
        await js.key_value(subjects.KV_JOBS),
        await js.key_value(subjects.KV_POLICIES),
    )


async def test_republishing_a_logical_event_stores_it_once(own_js: JetStreamContext) -> None:
    """A replay re-creates an event with a new ``at``; its msg id must not change with it."""
    tenant, job = uid("acme"), "j1"
    await publish_event(own_js, Accepted(tenant, job, "sft", 1.0))
    await publish_event(own_js, Accepted(tenant, job, "sft", 2.0))
    assert await _stored(own_js, subjects.event(tenant, job, "accepted")) == 1

    await publish_event(own_js, StateChanged(tenant, job, "running", 3.0), "running")
    await publish_event(own_js, StateChanged(tenant, job, "running", 4.0), "running")
    await publish_event(own_js, StateChanged(tenant, job, "failed", 5.0, "boom"), "failed")
    assert await _stored(own_js, subjects.event(tenant, job, "state")) == 2, (
        "one per status entered"
    )


@pytest.mark.parametrize("failure", ["before_store", "after_store"])
async def test_submit_redelivered_after_a_failed_announcement_is_announced_once(
    own_nc: NATS, own_js: JetStreamContext, monkeypatch: pytest.MonkeyPatch, failure: str
) -> None:
    """The master recorded the job, then its ``accepted`` publish failed: lost before the
    server stored it (a crash, a dropped connection), or stored with the ack lost (a
    timeout). The submit is redelivered; the tenant must see exactly one ``accepted``."""
    tenant, job = uid("acme"), "rl-1"
    # The master announces through bus.publish.publish_event, which publishes from there.
    real_publish = bus_publish.publish
    failed: list[str] = []

    async def flaky(js: JetStreamContext, subject: str, message: Any, **kw: Any) -> Any:
        if isinstance(message, Accepted) and not failed:
            failed.append(subject)
            if failure == "after_store":
                await real_publish(js, subject, message, **kw)
            raise ConnectionError(f"publish to {subject} failed ({failure})")
        return await real_publish(js, subject, message, **kw)

    monkeypatch.setattr(bus_publish, "publish", flaky)
    describer = Describer()  # the env worker's describe answers (the spec names an env)
    await describer.subscribe(own_nc)
    master = await _master(own_js)
    submit = Msg(
        own_nc,
        subject=subjects.job(tenant, "submit"),
        data=encode(JobSubmit(tenant, job, _rl_spec(tenant), 0.0)),
    )
    with pytest.raises(ConnectionError):
        await master.handle(submit)
    assert failed, "the accepted publish was not reached"
    await master.handle(submit)  # the redelivery
    await describer.close()

    record = await master.record(tenant, job)
    assert record is not None and record[0].status == "running"
    assert await _stored(own_js, subjects.event(tenant, job, "accepted")) == 1
    assert await _stored(own_js, subjects.event(tenant, job, "state")) == 1


async def test_rejection_of_a_redelivered_dead_command_is_stored_once(
    own_js: JetStreamContext,
) -> None:
    """``on_dead`` runs again when the master dies between dead-lettering a command and
    terminating it; the tenant is told once. (The SDK's job-id header is set, so this holds
    on that path as well as on the decoded-envelope one.)"""
    tenant, job = uid("acme"), "bad-1"
    await own_js.publish(
        subjects.job(tenant, "submit"),
        encode(JobSubmit(tenant, job, b"{}", 0.0)),
        headers={headers.JOB_ID: job},
    )
    sub = await own_js.pull_subscribe(subjects.job(tenant, "submit"), durable=uid("d"))
    (msg,) = await sub.fetch(1, timeout=5)
    master = await _master(own_js)
    await master.on_dead(msg, "invalid job spec: kind: Field required", ValueError())
    await master.on_dead(msg, "invalid job spec: kind: Field required", ValueError())
    assert await _stored(own_js, subjects.event(tenant, job, "rejected")) == 1


@pytest.fixture
def master_proc(
    nats_server: EmbeddedServer, js: JetStreamContext, procs: Procs, tmp_path: Path
) -> subprocess.Popen[bytes]:
    return procs.add(start_service("master", nats_server.url, tmp_path / "master.log"))


async def test_bad_spec_submitted_without_headers_gets_a_rejected_event_naming_the_field(
    master_proc: subprocess.Popen[bytes], js: JetStreamContext
) -> None:
    """A client written from the README sends a JobSubmit and nothing else."""
    tenant, job = uid("acme"), "bad-spec"
    spec = {"kind": "sft", "tenant": tenant, "dataset": "d", "steps": 5, "optimiser": {}}
    spec["head"] = {"kind": "oft", "action_dim": 2}
    await js.publish(
        subjects.job(tenant, "submit"),
        encode(JobSubmit(tenant, job, json.dumps(spec).encode(), 0.0)),
    )
    event = await _first_event(js, tenant, job)
    assert isinstance(event, Rejected), event
    assert "optimiser: unknown field" in event.reason


async def test_submit_for_another_tenant_is_rejected_to_its_sender_only(
    master_proc: subprocess.Popen[bytes], js: JetStreamContext
) -> None:
    """The subject's tenant is who sent it (the broker enforces that); the message's
    tenant claims to be someone else. The sender hears why; the other tenant hears
    nothing."""
    sender, victim, job = uid("mallory"), uid("alice"), "j-1"
    await js.publish(
        subjects.job(sender, "submit"),
        encode(JobSubmit(victim, job, _rl_spec(victim), 0.0)),
    )
    event = await _first_event(js, sender, job)
    assert isinstance(event, Rejected), event
    assert event.tenant == sender
    assert f"tenant {victim!r}" in event.reason and f"tenant {sender!r}" in event.reason
    assert master_proc.poll() is None
    for kind in ("rejected", "accepted", "state"):
        assert await _stored(js, subjects.event(victim, job, kind)) == 0


# -- a job the master accepted never hangs, whatever fails while it starts ------------------


def _session_spec(tenant: str, **extra: Any) -> bytes:
    head = {"kind": "oft", "action_dim": 2, "proprio_dim": 0}
    return json.dumps({"kind": "session", "tenant": tenant, "head": head, **extra}).encode()


async def test_a_queued_job_its_lowered_limits_rule_out_fails_instead_of_blocking_the_queue(
    own_nc: NATS, own_js: JetStreamContext
) -> None:
    """Found by an audit: a queued job that its tenant's lowered limits ruled out waited for
    ever, and every younger job of the tenant behind it (jobs start oldest first)."""
    tenant = uid("acme")
    tenants = await own_js.key_value(subjects.KV_TENANTS)
    limits = TenantLimits(max_concurrent_jobs=1, max_job_priority=2)
    await tenants.put(tenant, encode(TenantRecord(tenant, "U" + "A" * 55, time.time(), limits)))
    master = await _master(own_js)

    async def submit(job: str, **extra: Any) -> None:
        data = encode(JobSubmit(tenant, job, _session_spec(tenant, **extra), 0.0))
        await master.handle(Msg(own_nc, subject=subjects.job(tenant, "submit"), data=data))

    await submit("a1")
    await submit("a2", priority=2)
    assert await _status(master, tenant, "a2") == "queued"
    lowered = msgspec.structs.replace(limits, max_job_priority=1)
    await tenants.put(tenant, encode(TenantRecord(tenant, "U" + "A" * 55, time.time(), lowered)))
    await master.cancel(JobCancel(tenant, "a1", "make room"))
    await master.admissions.admit_queued(tenant)
    found = await master.record(tenant, "a2")
    assert found is not None and found[0].status == "failed"
    assert "max_job_priority 1" in found[0].reason and "limits changed while it waited" in (
        found[0].reason
    )
    await submit("a3")  # nothing waits in front of it
    assert await _status(master, tenant, "a3") == "running"


async def test_a_submit_that_gives_up_after_recording_its_job_fails_the_job(
    own_nc: NATS, own_js: JetStreamContext, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The master recorded the job ``accepted``, then starting it raised (every delivery
    the same): when the runtime gives the submit up, the tenant is told why and the job
    fails, instead of staying ``accepted`` and holding a place among its running jobs."""
    tenant, job = uid("acme"), "s-1"
    master = await _master(own_js)

    async def broken_start(plan: object, job_id: str) -> None:
        raise OverflowError("a bug of ours")

    monkeypatch.setattr(master, "start", broken_start)
    submit = JobSubmit(tenant, job, _session_spec(tenant), 0.0)
    msg = Msg(own_nc, subject=subjects.job(tenant, "submit"), data=encode(submit))
    with pytest.raises(OverflowError):
        await master.handle(msg)
    found = await master.record(tenant, job)
    assert found is not None and found[0].status == "accepted"
    # What the consume runtime does after max_deliver (a stored message: it needs a sequence).
    await own_js.publish(subjects.job(tenant, "submit"), encode(submit))
    sub = await own_js.pull_subscribe(subjects.job(tenant, "submit"), durable=uid("d"))
    (stored,) = await sub.fetch(1, timeout=5)
    await master.on_dead(
        stored, "gave up after 5 deliveries: OverflowError: a bug of ours", OverflowError()
    )
    found = await master.record(tenant, job)
    assert found is not None and found[0].status == "failed"
    assert (
        found[0].reason == "not started: gave up after 5 deliveries: OverflowError: a bug of ours"
    )
    assert await _stored(own_js, subjects.event(tenant, job, "rejected")) == 1


async def test_another_submits_refusal_leaves_an_accepted_job_alone(
    own_nc: NATS, own_js: JetStreamContext
) -> None:
    """A second submit under a taken job id is refused; the job the id belongs to is not
    the refused command's, and keeps its state."""
    tenant, job = uid("acme"), "s-1"
    master = await _master(own_js)
    await put_job(
        master.jobs,
        JobRecord(tenant, job, "session", "accepted", _session_spec(tenant), 1.0, 1.0),
        last=0,
    )
    other = JobSubmit(tenant, job, _session_spec(tenant, seed=7), 0.0)
    await own_js.publish(subjects.job(tenant, "submit"), encode(other))
    sub = await own_js.pull_subscribe(subjects.job(tenant, "submit"), durable=uid("d"))
    (stored,) = await sub.fetch(1, timeout=5)
    await master.on_dead(stored, "job id 's-1' is already used by another job", ValueError())
    found = await master.record(tenant, job)
    assert found is not None and found[0].status == "accepted"
    # Nor is it told on that job's events, where a ``rejected`` would end its followers.
    assert await _stored(own_js, subjects.event(tenant, job, "rejected")) == 0


async def _queued_sessions(
    js: JetStreamContext,
    monkeypatch: pytest.MonkeyPatch,
    tenant: str,
    failing: str,
    error: Exception,
) -> Master:
    """A master with two queued sessions of ``tenant``, "bad" then "good", whose compile
    raises ``error`` for ``failing``."""
    master = await _master(js)
    for i, name in enumerate(("bad", "good")):
        record = JobRecord(tenant, name, "session", "queued", _session_spec(tenant), i, i)
        await put_job(master.jobs, record, last=0)
    real_compile = master.compile

    async def compile_fails(job_id: str, spec: Any, limits: Any = None) -> Any:
        if job_id == failing:
            raise error
        return await real_compile(job_id, spec, limits)

    monkeypatch.setattr(master, "compile", compile_fails)
    return master


async def test_a_queued_job_that_cannot_be_started_fails_and_the_next_one_starts(
    own_js: JetStreamContext, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An error of ours while starting one queued job (every try the same) must not stop
    the admissions loop, and with it the master at every restart: it is tried
    UNEXPECTED_TRIES times, then that job fails and the jobs behind it start."""
    tenant = uid("acme")
    master = await _queued_sessions(
        own_js, monkeypatch, tenant, "bad", OverflowError("can't serialize ints > 2**64 - 1")
    )

    async def status(name: str) -> str:
        found = await master.record(tenant, name)
        assert found is not None
        return found[0].status

    for _ in range(UNEXPECTED_TRIES - 1):
        await master.admissions.admit_queued(tenant)
        assert (await status("bad"), await status("good")) == ("queued", "queued")
        assert tenant in master.admissions.room  # tried again at the loop's next wake-up
    await master.admissions.admit_queued(tenant)
    found = await master.record(tenant, "bad")
    assert found is not None and found[0].status == "failed"
    assert found[0].reason == (
        "could not be started: OverflowError: can't serialize ints > 2**64 - 1"
    )
    assert await status("good") == "running"
    assert master.admissions.errors == {}


async def test_a_queued_job_that_cannot_start_for_now_holds_up_no_younger_one(
    own_js: JetStreamContext, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Jobs start oldest first, and a new job waits behind the queued ones: a queued job
    whose start fails for now (no env worker describes its env yet, the bus) must not keep
    the younger ones that could start waiting until it can."""
    tenant = uid("acme")
    not_yet = RetryableError("no env worker answered describe")
    master = await _queued_sessions(own_js, monkeypatch, tenant, "bad", not_yet)
    await master.admissions.admit_queued(tenant)
    statuses = [await _status(master, tenant, name) for name in ("bad", "good")]
    assert statuses == ["queued", "running"]
    assert tenant in master.admissions.room  # the stuck one is tried again


async def test_a_pipeline_id_that_leaves_its_stages_no_room_is_refused(
    own_nc: NATS, own_js: JetStreamContext
) -> None:
    """Stage ids are ``<pipeline id>-s<index>`` and ids have 64 chars: a longer pipeline id
    would cut them to the pipeline's own id (or another stage's)."""
    tenant = uid("acme")
    master = await _master(own_js)
    stage = {
        "kind": "rl",
        "tenant": tenant,
        "env": "e",
        "iterations": 1,
        "head": {"kind": "oft"},
        "rl": {"algorithm": "grpo"},
    }
    spec = json.dumps({"kind": "pipeline", "tenant": tenant, "stages": [stage] * 11}).encode()
    job = "p" * 61
    msg = Msg(
        own_nc,
        subject=subjects.job(tenant, "submit"),
        data=encode(JobSubmit(tenant, job, spec, 0.0)),
    )
    with pytest.raises(PoisonError) as refused:
        await master.handle(msg)
    assert str(refused.value) == (
        f"job id: {job!r} has 61 chars, but a pipeline of 11 stages names them "
        "'<job id>-s0' to '-s10' and an id has 64 chars at most: give it 60 chars or fewer"
    )
    assert await master.record(tenant, job) is None


# -- what a spec leaves to its dataset is checked as if the spec said it --------------------


async def _reach_dataset(js: JetStreamContext, tenant: str, path: Path, episodes: int) -> None:
    record(REACH2D_ID, episodes, path, seed=0)  # actions 2-D, observation.state 4-D
    await register_path(js, tenant, "reach", path)


async def test_head_dims_taken_from_the_dataset_are_held_to_the_operators_bounds(
    own_js: JetStreamContext, tmp_path: Path
) -> None:
    tenant = uid("acme")
    await _reach_dataset(own_js, tenant, tmp_path / "reach", episodes=4)
    master = Master(
        own_js,
        await own_js.key_value(subjects.KV_JOBS),
        await own_js.key_value(subjects.KV_POLICIES),
        limits=InputLimits(max_proprio_dim=2),
        datasets=Datasets(own_js, DatasetCache(tmp_path / "cache")),
    )
    sft = {"kind": "sft", "tenant": tenant, "dataset": "reach", "steps": 2, "batch_size": 2}
    blind = parse_job_spec({**sft, "head": {"kind": "oft", "proprio_dim": 0}})
    plan = await master.compile("ok", blind)
    assert plan is not None and plan.open_slot is not None
    assert plan.open_slot.head.action_dim == 2  # the dataset's
    with pytest.raises(PoisonError) as refused:
        await master.compile("j", parse_job_spec({**sft, "head": {"kind": "oft"}}))
    assert str(refused.value) == (
        "head.proprio_dim: 4 exceeds max_proprio_dim 2 (a dim the spec omits is its dataset's "
        "or env's)"
    )


async def test_an_eval_on_a_dataset_checks_the_policys_head_and_the_held_out_split(
    own_js: JetStreamContext, tmp_path: Path
) -> None:
    """Before, a policy whose action dim was not the dataset's was accepted: a larger one
    failed in the env worker, a 1-D one was broadcast into a wrong error and "succeeded"."""
    tenant = uid("acme")
    await _reach_dataset(own_js, tenant, tmp_path / "reach", episodes=4)
    record(REACH2D_ID, 1, tmp_path / "one", seed=0)
    await register_path(own_js, tenant, "one", tmp_path / "one")
    datasets = Datasets(own_js, DatasetCache(tmp_path / "cache"))

    def policy(action_dim: int, proprio_dim: int = 0) -> PolicyRecord:
        head = HeadConfig(kind="oft", action_dim=action_dim, proprio_dim=proprio_dim)
        slot = OpenSlot(tenant, "trained", head, OptimizerConfig(), 0, 10)
        return PolicyRecord(tenant, "trained", 3, 10, "obj", "sha", 1, slot, 0.0)

    spec = parse_job_spec(
        {"kind": "eval", "tenant": tenant, "policy_job": "trained", "dataset": "reach"}
    )
    assert isinstance(spec, EvalJobSpec)
    plan = await compile_eval("ev", spec, policy(2, 4), datasets)
    assert plan.env_tasks[0].dataset == "reach"
    for action_dim in (1, 7):
        with pytest.raises(
            PoisonError,
            match=rf"^policy_job 'trained': head\.action_dim: "
            rf"{action_dim} does not match the dataset's action dimension 2",
        ):
            await compile_eval("ev", spec, policy(action_dim), datasets)
    with pytest.raises(PoisonError, match=r"policy_job 'trained': head\.proprio_dim: 3 does"):
        await compile_eval("ev", spec, policy(2, 3), datasets)
    one = spec.model_copy(update={"dataset": "one"})
    with pytest.raises(PoisonError, match=r"^val_fraction: 0\.2 of dataset one's 1 episodes "):
        await compile_eval("ev", one, policy(2), datasets)


async def test_a_policy_is_evaluated_and_trained_on_only_on_the_backbone_that_trained_it(
    own_js: JetStreamContext, tmp_path: Path
) -> None:
    """Found by an audit: an eval on another backbone was accepted. Of the same width, it
    ran and published wrong metrics; of another, every act request failed, retried as the
    service's fault. Now the submit is refused naming the field; so is init_from."""
    tenant = uid("acme")
    await _reach_dataset(own_js, tenant, tmp_path / "reach", episodes=4)
    jobs = await own_js.key_value(subjects.KV_JOBS)
    policies = await own_js.key_value(subjects.KV_POLICIES)
    master = Master(
        own_js, jobs, policies, datasets=Datasets(own_js, DatasetCache(tmp_path / "cache"))
    )
    head = {"kind": "oft", "action_dim": 2, "proprio_dim": 4}
    trained = {"kind": "session", "tenant": tenant, "backbone": "tiny", "head": head}
    now = time.time()
    spec_json = json.dumps(trained).encode()
    await put_job(
        jobs, JobRecord(tenant, "trained", "session", "running", spec_json, now, now), last=0
    )
    slot = OpenSlot(tenant, "trained", HeadConfig("oft", 2, proprio_dim=4), OptimizerConfig(), 0, 9)
    await put_policy(
        policies, PolicyRecord(tenant, "trained", 3, 3, "obj", "sha", 1, slot, now), last=0
    )
    evaluation = {"kind": "eval", "tenant": tenant, "policy_job": "trained", "dataset": "reach"}
    session = {**trained, "init_from": "trained"}
    for spec in (evaluation, session):
        assert await master.compile("same", parse_job_spec({**spec, "backbone": "tiny"}))
        field = "policy_job" if spec["kind"] == "eval" else "init_from"
        with pytest.raises(
            PoisonError,
            match=rf"^backbone: 'tiny-224', but {field} 'trained' was trained on 'tiny' ",
        ):
            await master.compile("other", parse_job_spec({**spec, "backbone": "tiny-224"}))
    # A pipeline's stages start from each other's policies: one backbone for all of them.
    sft = {"kind": "sft", "tenant": tenant, "dataset": "reach", "steps": 2, "head": head}
    stages = [sft, {**evaluation, "backbone": "tiny-224"}]
    with pytest.raises(ValueError, match=r"stages\.1\.backbone: 'tiny-224' is not stage 0's"):
        parse_job_spec({"kind": "pipeline", "tenant": tenant, "stages": stages})


def _rl_pipeline(tenant: str, stages: int) -> bytes:
    stage = json.loads(_rl_spec(tenant))
    return json.dumps({"kind": "pipeline", "tenant": tenant, "stages": [stage] * stages}).encode()


async def _submit_pipeline(own_nc: NATS, master: Master, tenant: str, job: str) -> None:
    data = encode(JobSubmit(tenant, job, _rl_pipeline(tenant, 3), 0.0))
    await master.handle(Msg(own_nc, subject=subjects.job(tenant, "submit"), data=data))


async def _status(master: Master, tenant: str, job: str) -> str | None:
    found = await master.record(tenant, job)
    return None if found is None else found[0].status


async def test_a_stages_end_handled_again_after_a_failure_starts_the_next_stage_once(
    own_nc: NATS, own_js: JetStreamContext, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stage's final policy event recorded the stage succeeded, then starting the next
    stage failed (a bus error): the event is redelivered, and the next stage must start
    (the redelivery found the stage ended and did nothing: the pipeline ran for ever)."""
    tenant, job = uid("acme"), "p"
    describer = Describer()
    await describer.subscribe(own_nc)
    master = await _master(own_js)
    try:
        await _submit_pipeline(own_nc, master, tenant, job)
        assert await _status(master, tenant, "p-s0") == "running"
        # What the trainer commits before the final policy event (the next stage's init).
        opened = await own_js.pull_subscribe(subjects.train("tiny", tenant), durable=uid("o"))
        (msg,) = await opened.fetch(1, timeout=5)
        slot = decode(TRAIN_DECODER, msg.data)
        assert isinstance(slot, OpenSlot) and slot.job_id == "p-s0"
        assert msg.headers is not None and msg.headers[headers.JOB_ID] == "p-s0"
        trained = PolicyRecord(tenant, "p-s0", 3, 3, "obj", "sha", 1, slot, 1.0)
        await put_policy(await own_js.key_value(subjects.KV_POLICIES), trained, last=0)
        real_accept = master.accept
        failures: list[str] = []

        async def accept_fails_once(job_id: str, *args: Any, **kw: Any) -> None:
            if not failures:
                failures.append(job_id)
                raise RetryableError("the bus did not answer")
            await real_accept(job_id, *args, **kw)

        monkeypatch.setattr(master, "accept", accept_fails_once)
        final = PolicyPublished(tenant, "p-s0", 3, "obj", 3, 1.0, final=True)
        with pytest.raises(RetryableError):
            await master.handle_event(Msg(own_nc, subject="ev", data=encode(final)))
        assert failures == ["p-s1"]
        assert await _status(master, tenant, "p-s0") == "succeeded"
        assert await _status(master, tenant, "p-s1") is None
        for _ in range(2):  # the redelivery, and one more: nothing twice
            await master.handle_event(Msg(own_nc, subject="ev", data=encode(final)))
        assert await _status(master, tenant, "p-s1") == "running"
        assert await _stored(own_js, subjects.event(tenant, "p-s0", "state")) == 2
        assert await _stored(own_js, subjects.event(tenant, "p-s1", "accepted")) == 1
        assert await _status(master, tenant, "p-s2") is None
    finally:
        await describer.close()


async def test_a_cancelled_pipeline_cancels_its_running_stage_and_starts_no_other(
    own_nc: NATS, own_js: JetStreamContext, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Cancelling a pipeline cancelled only its own record: its stage ran on (its services
    follow the stage's record) and, when it ended, the next stage started."""
    tenant, job = uid("acme"), "p"
    describer = Describer()
    await describer.subscribe(own_nc)
    master = await _master(own_js)
    try:
        await _submit_pipeline(own_nc, master, tenant, job)
        closes = await own_js.pull_subscribe(subjects.train("tiny", tenant), durable=uid("closes"))
        await master.cancel(JobCancel(tenant, job, "enough"))
        assert await _status(master, tenant, job) == "cancelled"
        found = await master.record(tenant, "p-s0")
        assert found is not None and found[0].status == "cancelled"
        assert found[0].reason == "its pipeline p cancelled"
        fetched = await closes.fetch(10, timeout=5)
        assert all((m.headers or {}).get(headers.JOB_ID) == "p-s0" for m in fetched)
        sent = [decode(TRAIN_DECODER, m.data) for m in fetched]
        assert [c for c in sent if isinstance(c, CloseSlot)] == [
            CloseSlot(tenant, "p-s0", "cancelled")
        ]
        # The stage's final policy arriving after the cancel changes nothing.
        final = PolicyPublished(tenant, "p-s0", 3, "obj", 3, 1.0, final=True)
        await master.handle_event(Msg(own_nc, subject="ev", data=encode(final)))
        assert await _status(master, tenant, "p-s0") == "cancelled"
        assert await _status(master, tenant, "p-s1") is None
        # Cancelled again (a session's lease running out after its client closed it, past
        # the duplicate window): its state event is stored already, not published again.
        real_publish = bus_publish.publish
        states: list[object] = []

        async def counting(js: JetStreamContext, subject: str, message: Any, **kw: Any) -> Any:
            if isinstance(message, StateChanged):
                states.append(message)
            return await real_publish(js, subject, message, **kw)

        monkeypatch.setattr(bus_publish, "publish", counting)
        await master.cancel(JobCancel(tenant, job, "again"))
        assert states == []
    finally:
        await describer.close()


async def test_a_job_cancelled_while_it_was_being_started_has_its_slot_closed_after_it_opened(
    own_nc: NATS, own_js: JetStreamContext, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A cancel handled while a job was being started (a queued job's admission compiles
    for seconds beside the commands consumer) published its CloseSlot before the start's
    OpenSlot: the trainer opened the slot of a cancelled job and held it for good."""
    tenant, job = uid("acme"), "j"
    describer = Describer()
    await describer.subscribe(own_nc)
    master = await _master(own_js)
    real_begin = master.begin

    async def cancelled_meanwhile(job_id: str, *args: Any) -> None:
        await master.cancel(JobCancel(tenant, job_id, "changed my mind"))
        await real_begin(job_id, *args)

    monkeypatch.setattr(master, "begin", cancelled_meanwhile)
    controls = await own_js.pull_subscribe(subjects.train("tiny", tenant), durable=uid("c"))
    try:
        submit = JobSubmit(tenant, job, _rl_spec(tenant), 0.0)
        await master.handle(
            Msg(own_nc, subject=subjects.job(tenant, "submit"), data=encode(submit))
        )
        assert await _status(master, tenant, job) == "cancelled"
        sent = [decode(TRAIN_DECODER, m.data) for m in await controls.fetch(10, timeout=5)]
        assert [type(c) for c in sent] == [CloseSlot, OpenSlot, CloseSlot]
        assert sent[-1].job_id == job
    finally:
        await describer.close()


async def test_a_tenants_own_job_under_a_pipelines_next_stage_id_fails_the_pipeline_saying_so(
    own_nc: NATS, own_js: JetStreamContext
) -> None:
    """A job the tenant submitted as ``p-s1`` while pipeline ``p`` ran its stage 0 was
    taken for stage 1 "started already": the pipeline ran for ever, holding its place."""
    tenant, job = uid("acme"), "p"
    describer = Describer()
    await describer.subscribe(own_nc)
    master = await _master(own_js)
    try:
        await _submit_pipeline(own_nc, master, tenant, job)
        assert await _status(master, tenant, "p-s0") == "running"
        own = JobSubmit(tenant, "p-s1", _rl_spec(tenant), 0.0)
        opened = await own_js.pull_subscribe(subjects.train("tiny", tenant), durable=uid("o"))
        (msg,) = await opened.fetch(1, timeout=5)
        slot = decode(TRAIN_DECODER, msg.data)
        assert isinstance(slot, OpenSlot) and slot.job_id == "p-s0"
        await master.handle(Msg(own_nc, subject=subjects.job(tenant, "submit"), data=encode(own)))
        assert await _status(master, tenant, "p-s1") == "running"
        trained = PolicyRecord(tenant, "p-s0", 3, 3, "obj", "sha", 1, slot, 1.0)
        await put_policy(await own_js.key_value(subjects.KV_POLICIES), trained, last=0)
        final = PolicyPublished(tenant, "p-s0", 3, "obj", 3, 1.0, final=True)
        await master.handle_event(Msg(own_nc, subject="ev", data=encode(final)))
        assert await _status(master, tenant, "p-s0") == "succeeded"
        found = await master.record(tenant, job)
        assert found is not None and found[0].status == "failed"
        assert "job id 'p-s1' is already used by another job" in found[0].reason
        assert await _status(master, tenant, "p-s1") == "running"  # the tenant's own, untouched
    finally:
        await describer.close()


async def test_a_new_job_that_would_fit_waits_behind_the_tenants_older_queued_job(
    own_nc: NATS, own_js: JetStreamContext
) -> None:
    """Jobs start oldest first: a submit that fits the tenant's limits did not look at its
    queued jobs, so a steady flow of small jobs kept a larger queued one waiting for ever."""
    from schemas.tenants import TenantLimits, TenantRecord

    tenant = uid("acme")
    limits = TenantLimits(max_concurrent_jobs=2)
    tenants = await own_js.key_value(subjects.KV_TENANTS)
    await tenants.put(tenant, encode(TenantRecord(tenant, "U" + "A" * 55, time.time(), limits)))
    jobs = await own_js.key_value(subjects.KV_JOBS)
    spec = _rl_spec(tenant)
    await put_job(jobs, JobRecord(tenant, "running", "rl", "running", spec, 1.0, 1.0), last=0)
    older = JobRecord(tenant, "older", "rl", "queued", spec, 2.0, 2.0, reason="waits")
    await put_job(jobs, older, last=0)
    describer = Describer()
    await describer.subscribe(own_nc)
    master = await _master(own_js)
    try:
        submit = JobSubmit(tenant, "newer", spec, 0.0)
        await master.handle(
            Msg(own_nc, subject=subjects.job(tenant, "submit"), data=encode(submit))
        )
        found = await master.record(tenant, "newer")
        assert found is not None and found[0].status == "queued"
        assert "1 older jobs waiting to start (older)" in found[0].reason
    finally:
        await describer.close()


async def test_an_unrecorded_sessions_lease_runs_out_without_a_cancel(
    own_js: JetStreamContext,
) -> None:
    """A session submit the master rejected has no record: when the lease that its submit
    started ran out, a cancel was queued, refused as an unknown job, and the session got a
    second, confusing ``rejected`` event. Its lease is dropped instead (a session still
    behind other commands gets a whole lease once it is recorded)."""
    from schemas.tenantctl import SubmitJob
    from services.master.sessions import Sessions
    from services.master.tenantjobs import TenantJobs

    tenant = uid("acme")
    jobs = await own_js.key_value(subjects.KV_JOBS)
    sessions = Sessions(own_js, jobs, TenantJobs(own_js))
    head = {"kind": "oft", "action_dim": 2, "proprio_dim": 0}
    spec = {"kind": "session", "tenant": tenant, "head": head}
    sessions.submitted(SubmitJob(tenant, "s", json.dumps({**spec, "lease_s": 2.0}).encode()))
    assert (tenant, "s") in sessions.leases
    sessions.leases[(tenant, "s")] = (time.monotonic() - 5.0, 2.0)
    assert await sessions.expire() == [(tenant, "s")]
    assert sessions.leases == {}
    info = await own_js.stream_info(subjects.STREAM_JOBS)
    assert info.state.messages == 0, "no cancel queued"


async def test_sampling_is_weighed_by_the_tenants_class_and_the_jobs_priority(
    own_js: JetStreamContext,
) -> None:
    """Found by an audit: sampling through the master went to the inferencer at weight 1,
    while the job's rollouts carried its tenant's priority class times its own priority."""
    tenant = uid("acme")
    tenants = await own_js.key_value(subjects.KV_TENANTS)
    limits = TenantLimits(priority="high")  # weight 4
    await tenants.put(tenant, encode(TenantRecord(tenant, "U" + "A" * 55, time.time(), limits)))
    jobs = await own_js.key_value(subjects.KV_JOBS)
    now = time.time()
    spec = _session_spec(tenant, priority=2)
    await put_job(jobs, JobRecord(tenant, "s-1", "session", "running", spec, now, now), last=0)
    sessions = Sessions(own_js, jobs, TenantJobs(own_js))
    relayed: dict[str, Any] = {}

    class Inferencer:
        async def act(self, tenant: str, job_id: str, observations: Any, **kw: Any) -> ActReply:
            relayed.update(kw)
            return ActReply("r", 1)

    async def inferencer(backbone: str) -> Inferencer:
        return Inferencer()

    sessions._policy_client = inferencer  # type: ignore[method-assign,assignment]
    obs = observation([np.zeros((8, 8, 3), np.uint8)], "reach", np.zeros(2, np.float32))
    reply = await sessions.act(SamplePolicy(tenant, "s-1", [obs], seed=3))
    assert isinstance(reply, Sampled) and relayed["priority"] == 8
