"""Every input checked where it enters, through the real services (subprocesses on a real
nats-server) with operator limits set by ``JOYNEXUS_LIMIT_*`` / ``--limit-*``: each violation
gets its specific error (naming the field and the limit) for that tenant's job and a DEAD
record, while a well-formed job of another tenant, running at the same time, is unaffected;
and every service refuses a message whose tenant is not its subject's."""

from __future__ import annotations

import asyncio
import json
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from nats.js import JetStreamContext

from bus.codec import decode, encode
from bus.connect import connect
from bus.datacache import DatasetCache
from bus.declare import declare
from bus.inference import InferenceError, PolicyClient
from bus.publish import publish
from bus.records import get_job
from bus.server import EmbeddedServer
from schemas import headers, subjects
from schemas.dead import DeadLetter
from schemas.env import StreamDataset
from schemas.events import Accepted, ErrorEvent, Rejected, StateChanged
from schemas.infer import ACT_REPLY_DECODER, ActRequest
from schemas.jobs import JobCancel, JobSubmit
from schemas.limits import InputLimits
from schemas.model import OptimizerConfig
from schemas.tenants import TenantLimits, TenantRecord
from schemas.tensor import Tensor
from schemas.train import SFTBatch
from services.envs.sims import REACH2D_ID
from tests.conftest import Procs
from tests.helpers import dead_letters, eventually, start_service, uid
from tests.test_inferencer import OFT, commit_policy, launch, make_obs, wait_serving
from tests.test_trainer_defects import (
    IMAGE,
    done,
    episode,
    events_of,
    record,
    rl_open,
    send,
    sft_batch,
    sft_open,
)
from vla.backbone import Backbone


async def dead_with(js: JetStreamContext, stream: str, tenant: str, text: str) -> DeadLetter:
    async def probe() -> DeadLetter | None:
        return next((d for d in await dead_letters(js, stream, tenant) if text in d.reason), None)

    return await eventually(probe, timeout=60, what=f"a {stream} dead letter with {text!r}")


async def fatal_error(js: JetStreamContext, tenant: str, job: str) -> ErrorEvent:
    async def probe() -> ErrorEvent | None:
        evs = await events_of(js, tenant, job)
        return next((e for e in evs if isinstance(e, ErrorEvent) and e.fatal), None)

    return await eventually(probe, timeout=60, what=f"a fatal error event of {tenant}/{job}")


# -- the trainer -----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def limited_trainer(
    nats_server: EmbeddedServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[subprocess.Popen[bytes]]:
    """One trainer whose chunks are at most 4 actions and images at most 32 px."""
    log = tmp_path_factory.mktemp("trainer") / "trainer.log"
    proc = start_service(
        "trainer",
        nats_server.url,
        log,
        "--deterministic",
        "--limit-max-chunk-len",
        "4",
        JOYNEXUS_LIMIT_MAX_IMAGE_SIDE="32",
    )
    yield proc
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def chunked_batch(tenant: str, job: str, step: int, chunk: int, side: int = IMAGE) -> SFTBatch:
    rng = np.random.default_rng(step)
    b = 2
    return SFTBatch(
        tenant,
        job,
        step,
        0,
        step,
        Tensor.from_numpy(rng.integers(0, 255, (b, 1, side, side, 3), dtype=np.uint8)),
        ["reach"] * b,
        Tensor.from_numpy(rng.standard_normal((b, 3)).astype(np.float32)),
        Tensor.from_numpy(rng.uniform(-1, 1, (b, chunk, 2)).astype(np.float32)),
        Tensor.from_numpy(np.zeros((b, chunk), bool)),
    )


@pytest.mark.timeout(150)
async def test_a_nan_rollout_fails_its_job_naming_the_field_while_another_tenant_trains(
    limited_trainer: subprocess.Popen[bytes], js: JetStreamContext
) -> None:
    bad, good = uid("nanrl"), uid("good")
    bad_job, good_job = uid("j"), uid("j")
    await send(js, bad, rl_open(bad, bad_job, 2, lag=0, optim=OptimizerConfig()))
    await send(js, good, sft_open(good, good_job, 3))
    ep = episode(bad, bad_job, 0, 0, 1)
    rewards = ep.rewards.to_numpy().copy()
    rewards[2] = np.nan
    poisoned = type(ep)(
        **{
            **{f: getattr(ep, f) for f in ep.__struct_fields__},
            "rewards": Tensor.from_numpy(rewards),
        }
    )
    await send(js, bad, poisoned)
    await send(js, good, *(sft_batch(good, good_job, s) for s in range(3)))

    error = await fatal_error(js, bad, bad_job)
    assert "rewards: 1 of 4 values are NaN or infinite" in error.message, error.message
    dead = await dead_with(js, "TRAIN", bad, "rewards: 1 of 4 values are NaN or infinite")
    assert dead.subject == subjects.train("tiny", bad)
    rec = await eventually(lambda: done(js, good, good_job, 3), timeout=90, what="good job done")
    assert rec.step == 3 and limited_trainer.poll() is None


@pytest.mark.timeout(150)
async def test_a_too_long_chunk_and_a_too_large_image_are_refused_naming_the_limit(
    limited_trainer: subprocess.Popen[bytes], js: JetStreamContext
) -> None:
    tenant, good = uid("chunk"), uid("good")
    long_job, big_job, good_job = uid("j"), uid("j"), uid("j")
    await send(js, tenant, sft_open(tenant, long_job, 2), sft_open(tenant, big_job, 2))
    await send(js, good, sft_open(good, good_job, 2))
    await send(js, tenant, chunked_batch(tenant, long_job, 0, chunk=8))
    await send(js, tenant, chunked_batch(tenant, big_job, 0, chunk=1, side=64))
    await send(js, good, *(sft_batch(good, good_job, s) for s in range(2)))

    long_error = await fatal_error(js, tenant, long_job)
    assert "actions: chunk length 8 exceeds max_chunk_len 4" in long_error.message
    big_error = await fatal_error(js, tenant, big_job)
    assert "images: 64x64 exceeds max_image_side 32" in big_error.message
    await dead_with(js, "TRAIN", tenant, "exceeds max_chunk_len 4")
    await eventually(lambda: done(js, good, good_job, 2), timeout=90, what="good job done")
    assert limited_trainer.poll() is None


@pytest.mark.timeout(120)
async def test_a_training_message_that_does_not_decode_fails_the_job_its_header_names(
    limited_trainer: subprocess.Popen[bytes], js: JetStreamContext
) -> None:
    """A batch no trainer can decode (another version's schema) names no job in its body:
    its header does, so the job fails saying why instead of waiting for that step for good."""
    tenant, job = uid("undecodable"), uid("j")
    await send(js, tenant, sft_open(tenant, job, 2))
    await js.publish(
        subjects.train("tiny", tenant), b"\xc1 not msgpack", headers={headers.JOB_ID: job}
    )
    error = await fatal_error(js, tenant, job)
    assert "malformed training message" in error.message, error.message
    await dead_with(js, "TRAIN", tenant, "malformed training message")
    assert limited_trainer.poll() is None


@pytest.mark.timeout(120)
async def test_the_trainer_refuses_a_message_claiming_another_tenant(
    limited_trainer: subprocess.Popen[bytes], js: JetStreamContext
) -> None:
    """Tenant ``mallory``'s subject carries an OpenSlot naming ``victim``: refused, and no
    slot of ``victim`` exists (nothing of the victim's is reached or created)."""
    mallory, victim, job = uid("mallory"), uid("victim"), uid("j")
    await publish(js, subjects.train("tiny", mallory), sft_open(victim, job, 2))
    dead = await dead_with(js, "TRAIN", mallory, f"message for tenant {victim!r}")
    assert f"on tenant {mallory!r}'s subject" in dead.reason
    assert await record(js, victim, job) is None and await record(js, mallory, job) is None


@pytest.mark.timeout(120)
async def test_a_rollout_can_never_reach_another_tenants_job(
    limited_trainer: subprocess.Popen[bytes], js: JetStreamContext
) -> None:
    """``victim`` trains job J; ``mallory`` sends rollouts for J on its own subject, naming
    itself (the job is looked up as mallory's, which does not exist) or naming the victim
    (refused for the subject): both dead, and the victim's job completes untouched."""
    mallory, victim, job = uid("mallory"), uid("victim"), uid("j")
    await send(js, victim, sft_open(victim, job, 2))
    await send(js, mallory, episode(mallory, job, 0, 0, 1))
    await publish(js, subjects.train("tiny", mallory), episode(victim, job, 0, 0, 1))
    await dead_with(js, "TRAIN", mallory, f"no slot is open for job {job!r} of tenant {mallory!r}")
    await dead_with(js, "TRAIN", mallory, f"message for tenant {victim!r}")
    await send(js, victim, *(sft_batch(victim, job, s) for s in range(2)))
    rec = await eventually(lambda: done(js, victim, job, 2), timeout=90, what="victim's job done")
    assert rec.step == 2 and rec.batches_done == 2
    assert not [e for e in await events_of(js, victim, job) if isinstance(e, ErrorEvent)]


# -- the inferencer --------------------------------------------------------------------------
@pytest.mark.timeout(150)
async def test_the_inferencer_refuses_an_oversized_image_and_a_foreign_tenant(
    nats_server: EmbeddedServer, js: JetStreamContext, procs: Procs, tmp_path: Path
) -> None:
    replica = launch(nats_server.url, tmp_path / "inf.log", "--limit-max-image-side", "64")
    procs.add(replica.proc)
    bad, good = uid("big"), uid("good")
    hidden = Backbone.load("tiny").hidden_size
    await commit_policy(js, bad, "job", OFT, hidden)
    await commit_policy(js, good, "job", OFT, hidden)
    await wait_serving(js, replica)
    client = await PolicyClient.create(js._nc, "tiny", js)
    try:
        oversized = client.act(bad, "job", [make_obs(OFT, 1, size=128)], timeout=30)
        fine = client.act(good, "job", [make_obs(OFT, 2)], deterministic=True, timeout=30)
        results = await asyncio.gather(oversized, fine, return_exceptions=True)
        assert isinstance(results[0], InferenceError)
        assert "observations[0].images[0]: 128x128 exceeds max_image_side 64" in str(results[0])
        assert not isinstance(results[1], BaseException) and results[1].actions is not None
        assert results[1].actions.shape == (1, OFT.chunk_len, OFT.action_dim)
        await dead_with(js, "INFER", bad, "exceeds max_image_side 64")

        # A request naming the good tenant, sent on the bad tenant's subject.
        inbox = js._nc.new_inbox()
        sub = await js._nc.subscribe(inbox)
        request = ActRequest(good, "job", uid("r"), inbox, [make_obs(OFT, 3)])
        await publish(js, subjects.infer("tiny", bad), request)
        reply = decode(ACT_REPLY_DECODER, (await sub.next_msg(timeout=30)).data)
        assert reply.actions is None and f"request for tenant {good!r}" in reply.error
        await sub.unsubscribe()
    finally:
        await client.close()
    assert replica.proc.poll() is None


# -- the master ------------------------------------------------------------------------------
def rl_spec(tenant: str, **overrides: object) -> dict[str, object]:
    spec: dict[str, object] = {
        "kind": "rl",
        "tenant": tenant,
        "env": REACH2D_ID,
        "head": {"kind": "oft", "action_dim": 2, "chunk_len": 1, "hidden_dim": 32},
        "rl": {"algorithm": "grpo"},
        "iterations": 3,
        "episodes_per_iteration": 2,
        "parallel_envs": 2,
        "max_episode_steps": 10,
    }
    spec.update(overrides)
    return spec


async def submit(js: JetStreamContext, spec: dict[str, object], job: str) -> None:
    tenant = str(spec["tenant"])
    body = JobSubmit(tenant, job, json.dumps(spec).encode(), time.time())
    await js.publish(subjects.job(tenant, "submit"), encode(body), headers={headers.JOB_ID: job})


async def outcome(js: JetStreamContext, tenant: str, job: str) -> Accepted | Rejected:
    async def probe() -> Accepted | Rejected | None:
        evs = await events_of(js, tenant, job)
        return next((e for e in evs if isinstance(e, Accepted | Rejected)), None)

    return await eventually(probe, timeout=60, what=f"{tenant}/{job} accepted or rejected")


def start_master_and_envs(url: str, logs: Path, procs: Procs, **env: str) -> None:
    procs.add(start_service("master", url, logs / "master.log", **env))
    procs.add(start_service("envs", url, logs / "envs.log", **env))


@pytest.mark.timeout(150)
async def test_a_spec_over_an_operator_bound_is_rejected_and_a_cancel_for_another_tenant_too(
    fresh_server: EmbeddedServer, procs: Procs, tmp_path: Path
) -> None:
    nc = await connect(fresh_server.url)
    js = nc.jetstream()
    await declare(js)
    from bus.datasets import register_path
    from services.envs.datasets import record as record_dataset
    from vla.data import check_dataset

    record_dataset(REACH2D_ID, 4, tmp_path / "demos", seed=0)
    record_dataset(REACH2D_ID, 2, tmp_path / "small", seed=1)
    frames = check_dataset(tmp_path / "small").num_frames
    limits = {
        "JOYNEXUS_LIMIT_MAX_ITERATIONS": "50",
        "JOYNEXUS_LIMIT_MAX_DATASET_FRAMES": str(frames),
        "JOYNEXUS_LIMIT_MAX_STEPS": "3",
    }
    start_master_and_envs(fresh_server.url, tmp_path, procs, **limits)
    bad, good = uid("over"), uid("good")
    await submit(js, rl_spec(bad, iterations=500), "too-long")
    await submit(js, rl_spec(good), "fine")
    rejected = await outcome(js, bad, "too-long")
    assert isinstance(rejected, Rejected)
    assert "iterations: 500 exceeds max_iterations 50" in rejected.reason
    assert isinstance(await outcome(js, good, "fine"), Accepted)
    await dead_with(js, "JOBS", bad, "exceeds max_iterations 50")
    # A dataset past max_dataset_frames is refused at submit, before any frame is streamed.
    await register_path(js, bad, "demos", tmp_path / "demos")
    sft = {
        "kind": "sft",
        "tenant": bad,
        "dataset": "demos",
        "steps": 2,
        "head": {"kind": "oft", "action_dim": 2},
    }
    await submit(js, sft, "big-data")
    refused = await outcome(js, bad, "big-data")
    assert isinstance(refused, Rejected)
    assert f"exceeds max_dataset_frames {frames}" in refused.reason
    assert refused.reason.startswith("dataset 'demos': ")
    # Steps past max_steps: given, or made by epochs.
    await register_path(js, bad, "small", tmp_path / "small")
    await submit(js, {**sft, "dataset": "small", "steps": 5}, "many-steps")
    await submit(js, {**sft, "dataset": "small", "steps": None, "epochs": 100}, "many-epochs")
    steps = await outcome(js, bad, "many-steps")
    assert isinstance(steps, Rejected) and "steps: 5 exceeds max_steps 3" in steps.reason
    epochs = await outcome(js, bad, "many-epochs")
    assert isinstance(epochs, Rejected) and "epochs: 100 epochs of" in epochs.reason
    assert "exceeds max_steps 3" in epochs.reason

    # The bad tenant cancels the good tenant's job by naming it in the body of a command on
    # its own subject: refused, and the good job goes on.
    await js.publish(subjects.job(bad, "cancel"), encode(JobCancel(good, "fine", "mine now")))
    await dead_with(js, "JOBS", bad, f"command for tenant {good!r}")
    kv = await js.key_value(subjects.KV_JOBS)
    record_, _ = await get_job(kv, good, "fine")
    assert record_ is not None and record_.status in ("accepted", "running")
    await nc.close()


@pytest.mark.timeout(150)
async def test_registered_tenants_only_and_their_concurrent_job_limit(
    fresh_server: EmbeddedServer, procs: Procs, tmp_path: Path
) -> None:
    """With tenants registered, an unknown or revoked tenant is refused by name; a tenant's
    submit past ``max_concurrent_jobs`` waits, queued with the limit as its reason, and one
    that could never fit its limits is refused naming the limit."""
    nc = await connect(fresh_server.url)
    js = nc.jetstream()
    await declare(js)
    tenants = await js.key_value(subjects.KV_TENANTS)  # declared with the layout
    alice, revoked = uid("alice"), uid("gone")
    now = time.time()
    limits = TenantLimits(1, max_env_sessions=4, max_job_priority=2)
    await tenants.put(alice, encode(TenantRecord(alice, "U" + "A" * 55, now, limits)))
    await tenants.put(revoked, encode(TenantRecord(revoked, "U" + "B" * 55, now, revoked=True)))
    start_master_and_envs(fresh_server.url, tmp_path, procs)

    stranger = uid("stranger")
    await submit(js, rl_spec(stranger), "s1")
    await submit(js, rl_spec(revoked), "r1")
    await submit(js, rl_spec(alice), "a1")
    for tenant, job in ((stranger, "s1"), (revoked, "r1")):
        refused = await outcome(js, tenant, job)
        assert isinstance(refused, Rejected) and f"unknown tenant {tenant!r}" in refused.reason
    assert isinstance(await outcome(js, alice, "a1"), Accepted)
    await submit(js, rl_spec(alice), "a2")
    assert isinstance(await outcome(js, alice, "a2"), Accepted)
    queued = await eventually(
        lambda: queued_state(js, alice, "a2"), timeout=30, what="a2 queued with its reason"
    )
    assert "max_concurrent_jobs is 1" in queued.reason and "a1" in queued.reason
    # Never to fit: more simulator sessions than the limit, a priority over the cap.
    await submit(js, rl_spec(alice, episodes_per_iteration=8), "big")
    await submit(js, rl_spec(alice, priority=3), "pushy")
    big, pushy = await outcome(js, alice, "big"), await outcome(js, alice, "pushy")
    assert isinstance(big, Rejected) and "exceeds max_env_sessions 4" in big.reason
    assert isinstance(pushy, Rejected) and "priority: 3 exceeds max_job_priority 2" in pushy.reason
    await nc.close()


async def queued_state(js: JetStreamContext, tenant: str, job: str) -> StateChanged | None:
    evs = await events_of(js, tenant, job)
    return next((e for e in evs if isinstance(e, StateChanged) and e.status == "queued"), None)


# -- env workers -----------------------------------------------------------------------------
@pytest.mark.timeout(120)
async def test_env_workers_refuse_a_task_claiming_another_tenant_and_oversized_tasks(
    nats_server: EmbeddedServer, js: JetStreamContext, procs: Procs, tmp_path: Path
) -> None:
    procs.add(
        start_service(
            "envs", nats_server.url, tmp_path / "envs.log", "--limit-max-batch-size", "16"
        )
    )
    mallory, victim = uid("mallory"), uid("victim")
    task = StreamDataset(victim, "job", "tiny", "victims-data", 8, 4, 1, 1, 0)
    await publish(js, subjects.env(mallory, "job"), task)
    dead = await dead_with(js, "ENV", mallory, f"task for {victim!r}/'job'")
    assert dead.tenant == mallory
    # Only the subject's job hears why; the victim's job gets nothing.
    assert not [e for e in await events_of(js, victim, "job") if isinstance(e, ErrorEvent)]
    error = await fatal_error(js, mallory, "job")
    assert f"task for {victim!r}" in error.message

    big = StreamDataset(mallory, "big", "tiny", "data", 64, 4, 1, 1, 0)
    await publish(js, subjects.env(mallory, "big"), big)
    error = await fatal_error(js, mallory, "big")
    assert "batch_size: 64 exceeds max_batch_size 16" in error.message


def test_limits_reject_unknown_keys_and_defaults_hold_the_spec_bounds() -> None:
    with pytest.raises(ValueError, match="max_imag_side"):
        InputLimits.model_validate({"max_imag_side": 3})
    limits = InputLimits()
    assert limits.max_chunk_len == 64 and limits.max_views == 3


@pytest.mark.timeout(150)
async def test_env_workers_refuse_a_dataset_over_the_frame_limit_and_stream_a_small_one(
    nats_server: EmbeddedServer, js: JetStreamContext, procs: Procs, tmp_path: Path
) -> None:
    from bus.datasets import register_path
    from services.envs.datasets import record as record_dataset
    from vla.data import check_dataset

    record_dataset(REACH2D_ID, 1, tmp_path / "small", seed=0)
    record_dataset(REACH2D_ID, 4, tmp_path / "big", seed=1)
    small = check_dataset(tmp_path / "small").num_frames
    big = check_dataset(tmp_path / "big").num_frames
    assert big > small
    bad, good = uid("bigdata"), uid("good")
    await register_path(js, bad, "demos", tmp_path / "big")
    await register_path(js, good, "demos", tmp_path / "small")
    procs.add(
        start_service(
            "envs",
            nats_server.url,
            tmp_path / "envs.log",
            JOYNEXUS_LIMIT_MAX_DATASET_FRAMES=str(small),
        )
    )
    await publish(
        js, subjects.env(bad, "j"), StreamDataset(bad, "j", "tiny", "demos", 4, 3, 1, 1, 0)
    )
    await publish(
        js, subjects.env(good, "j"), StreamDataset(good, "j", "nobody", "demos", 4, 3, 1, 1, 0)
    )
    error = await fatal_error(js, bad, "j")
    assert f"dataset 'demos': {big} frames exceeds max_dataset_frames {small}" in error.message
    await dead_with(js, "ENV", bad, "exceeds max_dataset_frames")

    async def streamed() -> bool:
        info = await js.stream_info(
            subjects.STREAM_TRAIN, subjects_filter=subjects.train("nobody", good)
        )
        return (info.state.subjects or {}).get(subjects.train("nobody", good), 0) == 3

    # (on a backbone no trainer serves, so they stay there to be counted)
    await eventually(streamed, timeout=60, what="the small dataset's 3 batches in TRAIN")
    stored = await js.get_msg(subjects.STREAM_TRAIN, subject=subjects.train("nobody", good))
    assert (stored.headers or {}).get(headers.JOB_ID) == "j", "each batch names its job"


@pytest.mark.timeout(120)
async def test_a_publish_acknowledgement_aimed_at_another_tenants_env_subject_fails_nothing(
    nats_server: EmbeddedServer, js: JetStreamContext, procs: Procs, tmp_path: Path
) -> None:
    """The broker checks the subject a tenant publishes to, not the reply subject it names;
    JetStream writes its publish acknowledgement there, here into ENV on the victim's job's
    subject. The env worker dead-letters that JSON, and the victim's job hears nothing."""
    procs.add(start_service("envs", nats_server.url, tmp_path / "envs.log"))
    mallory, victim, job = uid("mallory"), uid("victim"), uid("j")
    junk = encode(JobCancel(mallory, "nothing"))
    await js._nc.publish(subjects.job(mallory, "cancel"), junk, reply=subjects.env(victim, job))
    dead = await dead_with(js, "ENV", victim, "malformed env task")
    assert dead.payload.startswith(b"{") and b'"seq"' in dead.payload  # the server's ack
    assert not [e for e in await events_of(js, victim, job) if isinstance(e, ErrorEvent)]


async def test_dataset_limits_are_checked_before_any_frame_is_read(
    js: JetStreamContext, tmp_path: Path
) -> None:
    """A dataset past the operator's limits is refused from its metadata alone: its frames
    (here unreadable) are never opened."""
    from bus.datasets import register_path
    from bus.errors import PoisonError
    from services.envs.datasets import record as record_dataset
    from services.master.plans import Datasets
    from vla.data import read_meta

    tenant = uid("limits-first")
    record_dataset(REACH2D_ID, 3, tmp_path / "demos", seed=0)
    frames = read_meta(tmp_path / "demos").num_frames
    for frame_file in (tmp_path / "demos" / "data").rglob("*.parquet"):
        frame_file.write_bytes(b"not parquet")
    await register_path(js, tenant, "demos", tmp_path / "demos")
    datasets = Datasets(js, DatasetCache(tmp_path / "cache"))
    with pytest.raises(PoisonError, match=f"exceeds max_dataset_frames {frames - 1}"):
        await datasets.open(tenant, "demos", InputLimits(max_dataset_frames=frames - 1))
    with pytest.raises(PoisonError, match="dataset 'demos'") as within:
        await datasets.open(tenant, "demos", InputLimits())
    assert "max_dataset_frames" not in str(within.value)  # within limits: the frames fail
