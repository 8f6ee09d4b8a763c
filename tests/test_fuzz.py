"""Fuzzing every subject a tenant may publish to, against a real stack of role subprocesses.

Hypothesis draws over a thousand malformed payloads (random bytes, truncated and garbled
msgpack of the real Structs, other Structs' tags, wrong types, huge and negative numbers,
another tenant named in the body, absurd specs built from the real spec models) for every
subject a tenant may publish to: ``nexus.ctl.tenant.<t>.<op>`` for every op (submit and
cancel among them: absurd specs travel inside well-formed submits, so the master queues them
and its ``JOBS`` consumer must refuse them), ``nexus.envinfo.describe.<t>`` and
``nexus.ctl.backbones.<t>``, asked from the tenant's own inbox prefix. The services' own
``JOBS`` subjects get garbled commands too. Meanwhile a well-formed SFT job of another tenant
runs. Shown: no service crashes or restarts (same pids, heartbeats without a gap), every
request gets an error reply (never another tenant's data) or, for a queued command, a
dead letter (counted), and the other tenant's job ends with exactly the parameters and losses
it has when it runs alone.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

import msgspec
import pytest
import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from nats.aio.client import Client as NATS
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeoutError
from nats.js import JetStreamContext

from bus.codec import decode, encode
from bus.connect import connect
from bus.datasets import register_path
from bus.declare import declare
from bus.records import get_job
from bus.server import EmbeddedServer
from schemas import headers, subjects
from schemas.envdesc import DESCRIBE_REPLY_DECODER, DESCRIBE_REQUEST_DECODER, DescribeEnv
from schemas.events import Accepted, Progress
from schemas.health import HEARTBEAT_DECODER
from schemas.jobs import JobCancel, JobPause, JobResume, JobSubmit
from schemas.tenantctl import (
    BACKBONES_QUERY_DECODER,
    BACKBONES_REPLY_DECODER,
    TENANT_REPLY_DECODER,
    AddDataset,
    BackbonesQuery,
    CtlError,
    ExportPolicy,
    GetJob,
    ListDatasets,
    ListJobs,
    Queued,
    SubmitJob,
)
from schemas.train import CloseSlot
from services.envs.datasets import record as record_dataset
from services.envs.sims import REACH2D_ID
from services.master.queries import MAX_IN_FLIGHT_PER_TENANT
from tests.conftest import Procs
from tests.helpers import eventually, start_service, uid
from tests.sft_helpers import final_policy
from tests.test_trainer_defects import events_of

T = TypeVar("T")

#: Payloads per family; 1120 in all.
N_JOBS, N_SUBMITS, N_CTL, N_DESCRIBE, N_BACKBONES = 300, 400, 300, 80, 40
ROLES = ("master", "envs", "trainer")
#: A tenant's requests in flight at once: under the master's per-tenant limit
#: (services.master.queries.MAX_IN_FLIGHT_PER_TENANT), past which it answers "busy".
AT_ONCE = 12


# -- drawing payloads ------------------------------------------------------------------------
def draw(strategy: st.SearchStrategy[T], n: int) -> list[T]:
    """``n`` examples of ``strategy``, the same on every run (derandomized, no database)."""
    out: list[T] = []

    @settings(
        max_examples=n,
        derandomize=True,
        database=None,
        deadline=None,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(strategy)
    def collect(example: T) -> None:
        out.append(example)

    collect()
    return out


#: Integers msgpack can carry.
INTS = st.integers(min_value=-(2**63), max_value=2**63 - 1)
IDS = st.from_regex(r"[a-z0-9][a-z0-9-]{0,20}", fullmatch=True)
TEXT = st.text(max_size=40)
#: Values every bounded numeric spec field below refuses: negative, past every bound
#: (spec bounds and the default operator limits are all below 10^7), not finite.
JUNK_NUMBER = st.one_of(
    st.integers(min_value=-(2**63), max_value=-1),
    st.integers(min_value=10**7, max_value=2**63 - 1),
    st.sampled_from([math.nan, math.inf, -math.inf, -1e308, 1e308]),
)
WRONG_TYPE = st.one_of(
    st.lists(INTS, min_size=1, max_size=3),
    st.dictionaries(st.text(max_size=5), INTS, min_size=1, max_size=2),
    st.text(alphabet="xyz!", min_size=1, max_size=5),
)
JSONISH = st.recursive(
    st.none() | st.booleans() | INTS | st.floats() | st.text(max_size=10),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)

#: Bounded numeric fields of each base spec (dotted path).
SFT_FIELDS = [
    "batch_size",
    "steps",
    "val_fraction",
    "num_views",
    "token_budget",
    "priority",
    "head.action_dim",
    "head.chunk_len",
    "head.hidden_dim",
    "head.num_layers",
    "optimizer.lr",
]
RL_FIELDS = [
    "iterations",
    "episodes_per_iteration",
    "parallel_envs",
    "max_episode_steps",
    "image_size",
    "num_views",
    "head.chunk_len",
    "rl.epochs",
]


def base_specs(tenant: str) -> dict[str, dict[str, Any]]:
    """Specs that the fuzz tenant can never get accepted even unmutated (a dataset and a
    policy it does not have, an env that does not exist), so a mutation that happens to be
    valid still fails: every fuzz command must be refused."""
    head = {"kind": "oft", "action_dim": 2, "chunk_len": 4, "proprio_dim": 4}
    sft = {"kind": "sft", "tenant": tenant, "dataset": "demos", "head": head, "steps": 5}
    rl = {
        "kind": "rl",
        "tenant": tenant,
        "env": "Nope/NoSuchEnv-v0",
        "head": head,
        "rl": {"algorithm": "grpo"},
        "iterations": 3,
    }
    ev = {"kind": "eval", "tenant": tenant, "policy_job": "no-such-job", "env": REACH2D_ID}
    pipe = {"kind": "pipeline", "tenant": tenant, "stages": [sft, ev]}
    return {"sft": sft, "rl": rl, "eval": ev, "pipeline": pipe}


def _set(spec: dict[str, Any], path: str, value: object) -> dict[str, Any]:
    spec = json.loads(json.dumps(spec))
    node = spec
    *parents, last = path.split(".")
    for key in parents:
        node = node.setdefault(key, {})
    node[last] = value
    return spec


def spec_documents(tenant: str, other: str) -> st.SearchStrategy[bytes]:
    """Spec JSON that is always refused: a bounded field set to junk or a wrong type, an
    unknown key, an unknown kind, another tenant, not JSON, not an object, too large."""
    bases = base_specs(tenant)
    field_values = JUNK_NUMBER | WRONG_TYPE

    def mutated(kind: str, fields: list[str]) -> st.SearchStrategy[dict[str, Any]]:
        return st.builds(_set, st.just(bases[kind]), st.sampled_from(fields), field_values)

    any_base = st.sampled_from(sorted(bases)).map(lambda k: bases[k])
    documents = st.one_of(
        mutated("sft", SFT_FIELDS),
        mutated("rl", RL_FIELDS),
        st.builds(lambda b, k, v: {**b, f"zz{k}": v}, any_base, TEXT, JSONISH),
        st.builds(lambda b, k: {**b, "kind": f"x{k}"}, any_base, TEXT),
        any_base.map(lambda b: {**b, "tenant": other}),
        any_base.map(lambda b: {**b, "dataset": "/etc"} if b["kind"] == "sft" else {**b, "x": 1}),
    )
    as_bytes = documents.map(lambda d: json.dumps(d, allow_nan=True).encode())
    return st.one_of(
        as_bytes,
        as_bytes.map(lambda b: b + b" " * (70 << 10)),  # past max_spec_bytes
        st.binary(max_size=200),
        JSONISH.filter(lambda d: not isinstance(d, dict)).map(lambda d: json.dumps(d).encode()),
    )


def mangled(encoded: st.SearchStrategy[bytes]) -> st.SearchStrategy[bytes]:
    """The encodings themselves, truncated, or with bytes overwritten."""

    def truncate(data: bytes, at: int) -> bytes:
        return data[: at % max(1, len(data))]

    def garble(data: bytes, spots: list[tuple[int, int]]) -> bytes:
        out = bytearray(data)
        for pos, byte in spots:
            if out:
                out[pos % len(out)] = byte
        return bytes(out)

    spots = st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 255)), min_size=1, max_size=4)
    return st.one_of(
        encoded,
        st.builds(truncate, encoded, st.integers(0, 10**6)),
        st.builds(garble, encoded, spots),
    )


def job_payloads(tenant: str, other: str, other_job: str) -> st.SearchStrategy[tuple[str, bytes]]:
    """(verb, payload) for the fuzz tenant's job subjects."""
    tenants = st.sampled_from([tenant, other])
    job_ids = st.one_of(IDS, TEXT, st.just(other_job))
    commands = st.one_of(
        st.builds(JobSubmit, tenants, job_ids, spec_documents(tenant, other), st.floats()),
        st.builds(JobCancel, tenants, job_ids, TEXT),
        st.builds(JobPause, tenants, job_ids),
        st.builds(JobResume, tenants, job_ids),
        st.builds(CloseSlot, tenants, job_ids, TEXT),  # a tag no job subject takes
        st.builds(GetJob, tenants, job_ids),
    )
    payloads = st.one_of(
        mangled(commands.map(encode)),
        st.binary(max_size=512),
        JSONISH.map(msgspec.msgpack.encode),
    )
    return st.tuples(st.sampled_from(subjects.JOB_VERBS), payloads)


def ctl_payloads(tenant: str, other: str, other_job: str) -> st.SearchStrategy[tuple[str, bytes]]:
    """(op, payload) for the fuzz tenant's requests: each one deserves an error (another
    tenant named, an unknown job/dataset/version, the wrong op, a broken encoding)."""
    ids = st.one_of(IDS, TEXT)
    requests = st.one_of(
        st.builds(GetJob, st.just(other), st.just(other_job)),
        st.builds(GetJob, st.just(tenant), ids),
        st.builds(ListJobs, st.just(other)),
        st.builds(ListDatasets, st.just(other)),
        st.builds(AddDataset, st.sampled_from([tenant, other]), ids),
        st.builds(ExportPolicy, st.just(tenant), ids, INTS),
        st.builds(ExportPolicy, st.just(other), st.just(other_job), st.integers(0, 3)),
    )
    payloads = st.one_of(
        mangled(requests.map(encode)), st.binary(max_size=256), JSONISH.map(msgspec.msgpack.encode)
    )
    return st.tuples(st.sampled_from(subjects.TENANT_CTL_OPS), payloads)


def submit_requests(tenant: str, other: str, n: int) -> list[bytes]:
    """``n`` well-formed submits of the fuzz tenant, each with a spec that must be refused,
    each under a job id of its own (a repeated id would be the same command to ``JOBS``)."""
    specs = draw(spec_documents(tenant, other), n)
    return [encode(SubmitJob(tenant, f"fz-{i}", spec)) for i, spec in enumerate(specs)]


def describe_payloads() -> st.SearchStrategy[bytes]:
    """Describe requests no env can answer: unknown ids, unknown kwargs, images out of range."""
    kwargs = st.dictionaries(
        st.text(min_size=1, max_size=10).map(lambda k: "zz" + k),
        st.one_of(INTS, st.floats(), st.text(max_size=20), st.booleans()),
        min_size=1,
        max_size=4,
    )
    requests = st.one_of(
        st.builds(DescribeEnv, st.one_of(IDS, TEXT), st.just({}), st.integers(8, 64)),
        st.builds(DescribeEnv, st.just(REACH2D_ID), kwargs, st.integers(8, 64)),
        st.builds(
            DescribeEnv,
            st.just(REACH2D_ID),
            st.just({}),
            st.one_of(
                st.integers(min_value=-(2**63), max_value=7),
                st.integers(min_value=513, max_value=2**63 - 1),
            ),
        ),
    )
    return st.one_of(mangled(requests.map(encode)), st.binary(max_size=256))


def well_formed_describe(payload: bytes) -> bool:
    """Whether a describe payload is a request the env workers can answer."""
    try:
        request = msgspec.msgpack.decode(payload, type=DescribeEnv)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return False
    return (
        request.env_id == REACH2D_ID and not request.env_kwargs and 8 <= request.image_size <= 512
    )


def well_formed(decoder: msgspec.msgpack.Decoder[Any], payload: bytes) -> bool:
    try:
        decoder.decode(payload)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return False
    return True


def backbones_payloads() -> st.SearchStrategy[bytes]:
    other_structs = st.builds(GetJob, IDS, IDS).map(encode) | st.just(encode(BackbonesQuery()))
    return st.one_of(
        st.binary(min_size=1, max_size=128).filter(lambda b: b != encode(BackbonesQuery())),
        st.builds(lambda b, n: b[:n], other_structs, st.integers(1, 5)),
        JSONISH.map(msgspec.msgpack.encode),
    )


# -- the stack -------------------------------------------------------------------------------
@dataclass
class Beats:
    """Heartbeats of each role instance, sampled while the fuzz runs."""

    pids: dict[str, int]
    started: dict[str, float] = field(default_factory=dict)
    last: dict[str, float] = field(default_factory=dict)
    max_gap_s: float = 0.0
    restarts: list[str] = field(default_factory=list)

    async def sample(self, js: JetStreamContext, stop: asyncio.Event) -> None:
        kv = await js.key_value(subjects.KV_HEARTBEATS)
        while not stop.is_set():
            now = time.time()
            for role in ROLES:
                try:
                    entry = await kv.get(f"{role}.fuzz-{role}")
                    beat = decode(HEARTBEAT_DECODER, entry.value or b"")
                except Exception:  # noqa: BLE001 - missing: counted as a gap below
                    beat = None
                if beat is not None:
                    if (
                        beat.pid != self.pids[role]
                        or self.started.setdefault(role, beat.started_at) != beat.started_at
                    ):
                        self.restarts.append(f"{role}: pid {beat.pid}")
                    self.last[role] = beat.at
                seen = self.last.get(role)
                if seen is not None:
                    self.max_gap_s = max(self.max_gap_s, now - seen)
            try:
                await asyncio.wait_for(stop.wait(), 0.3)
            except TimeoutError:
                pass


def good_spec(tenant: str) -> dict[str, object]:
    return {
        "kind": "sft",
        "tenant": tenant,
        "dataset": "demos",
        "head": {"kind": "oft", "action_dim": 2, "chunk_len": 4, "proprio_dim": 4},
        "steps": 8,
        "batch_size": 8,
        "seed": 7,
        "checkpoint_every": 4,
        "optimizer": {"lr": 3e-3},
    }


async def submit(js: JetStreamContext, spec: dict[str, object], job: str) -> None:
    tenant = str(spec["tenant"])
    command = JobSubmit(tenant, job, json.dumps(spec).encode(), time.time())
    await js.publish(subjects.job(tenant, "submit"), encode(command))


async def finished(js: JetStreamContext, tenant: str, job: str) -> str | None:
    record, _ = await get_job(await js.key_value(subjects.KV_JOBS), tenant, job)
    return (
        record.status
        if record is not None and record.status != "running" and record.status != "accepted"
        else None
    )


async def result(
    js: JetStreamContext, tenant: str, job: str
) -> tuple[dict[int, float], dict[str, torch.Tensor]]:
    status = await eventually(lambda: finished(js, tenant, job), timeout=120, what=f"{job} ends")
    assert status == "succeeded", status
    losses = {
        e.step: e.metrics["loss"]
        for e in await events_of(js, tenant, job)
        if isinstance(e, Progress)
    }
    _, params = await final_policy(js, tenant, job)
    return losses, params


async def count(js: JetStreamContext, stream: str, subject: str) -> int:
    info = await js.stream_info(stream, subjects_filter=subject)
    return int((info.state.subjects or {}).get(subject, 0))


async def ask(nc: NATS, subject: str, payload: bytes) -> bytes | None:
    """The reply to one request; None when nobody answers that subject."""
    try:
        return (await nc.request(subject, payload, timeout=15)).data
    except NoRespondersError:
        return None
    except NatsTimeoutError as exc:
        raise AssertionError(f"no reply on {subject} to {payload!r}") from exc


async def in_chunks(calls: list[Callable[[], Any]], size: int) -> list[Any]:
    out: list[Any] = []
    for i in range(0, len(calls), size):
        out.extend(await asyncio.gather(*(c() for c in calls[i : i + size])))
    return out


@pytest.mark.timeout(300)
@pytest.mark.stack
async def test_a_thousand_malformed_payloads_leave_every_service_and_another_tenants_job_alone(
    fresh_server: EmbeddedServer, procs: Procs, tmp_path: Path
) -> None:
    nc = await connect(fresh_server.url)
    js = nc.jetstream()
    await declare(js)
    record_dataset(REACH2D_ID, 4, tmp_path / "demos", seed=0)
    fuzz, alone, during = uid("fuzz"), uid("alone"), uid("during")
    for tenant in (alone, during):
        await register_path(js, tenant, "demos", tmp_path / "demos")
    started = {
        role: procs.add(
            start_service(
                role,
                fresh_server.url,
                tmp_path / f"{role}.log",
                "--instance",
                f"fuzz-{role}",
                *(["--deterministic"] if role == "trainer" else []),
            )
        )
        for role in ROLES
    }
    pids = {role: p.pid for role, p in started.items()}

    # The well-formed job alone, for reference.
    await submit(js, good_spec(alone), "sft")
    losses_alone, params_alone = await result(js, alone, "sft")

    t0 = time.monotonic()
    jobs = draw(job_payloads(fuzz, during, "sft"), N_JOBS)
    submits = submit_requests(fuzz, during, N_SUBMITS)
    ctl = draw(ctl_payloads(fuzz, during, "sft"), N_CTL)
    describes = draw(describe_payloads(), N_DESCRIBE)
    backbones = draw(backbones_payloads(), N_BACKBONES)
    drawn_s = time.monotonic() - t0
    assert AT_ONCE < MAX_IN_FLIGHT_PER_TENANT
    total = len(jobs) + len(submits) + len(ctl) + len(describes) + len(backbones)
    assert total >= 1000, total

    beats = Beats(pids)
    stop = asyncio.Event()
    sampler = asyncio.create_task(beats.sample(js, stop))
    # The same job of another tenant, submitted at the same time as the fuzz.
    await submit(js, good_spec(during), "sft")
    t1 = time.monotonic()
    await in_chunks(
        [
            partial(
                js.publish,
                subjects.job(fuzz, verb),
                data,
                headers={headers.JOB_ID: f"fz{i}"} if i % 2 else None,
            )
            for i, (verb, data) in enumerate(jobs)
        ],
        50,
    )
    # The tenant's requests come from its own inbox prefix, as its identity's would: the
    # services answer a tenant's subject on nothing else.
    tenant_nc = NATS()
    await tenant_nc.connect(fresh_server.url, inbox_prefix=subjects.tenant_inbox_prefix(fuzz))
    submit_replies = await in_chunks(
        [partial(ask, tenant_nc, subjects.tenant_ctl(fuzz, "submit"), d) for d in submits],
        AT_ONCE,
    )
    ctl_replies = await in_chunks(
        [partial(ask, tenant_nc, subjects.tenant_ctl(fuzz, op), data) for op, data in ctl],
        AT_ONCE,
    )
    describe_replies = await in_chunks(
        [partial(ask, tenant_nc, subjects.env_describe(fuzz), data) for data in describes], 10
    )
    backbone_replies = await in_chunks(
        [partial(ask, tenant_nc, subjects.backbones_query(fuzz), d) for d in backbones],
        AT_ONCE,
    )
    sent_s = time.monotonic() - t1

    # Every job command is dead-lettered (the garbled ones on JOBS, and every submit the
    # master queued), none accepted; a submit not queued got an error reply.
    queued = 0
    for reply in submit_replies:
        assert reply is not None, "the master answers every submit"
        submitted = decode(TENANT_REPLY_DECODER, reply)
        assert isinstance(submitted, Queued | CtlError), submitted
        queued += isinstance(submitted, Queued)
        assert isinstance(submitted, CtlError) or not submitted.duplicate, submitted
    dead_subject = subjects.dead("JOBS", fuzz)
    dead_wanted = len(jobs) + queued
    await eventually(
        lambda: _at_least(count(js, subjects.STREAM_DEAD, dead_subject), dead_wanted),
        timeout=120,
        what=f"{dead_wanted} dead letters",
    )
    assert await count(js, subjects.STREAM_DEAD, dead_subject) == dead_wanted
    accepted = [
        e
        for e in await _events(js, f"{subjects.PREFIX}.event.{fuzz}.*.accepted")
        if isinstance(e, Accepted)
    ]
    assert not accepted

    # Every request answered with an error, never with another tenant's data.
    answered_ctl = [r for r in ctl_replies if r is not None]
    for reply in answered_ctl:
        decoded = decode(TENANT_REPLY_DECODER, reply)
        assert isinstance(decoded, CtlError), decoded  # never a record of another tenant
    for payload, reply in zip(describes, describe_replies, strict=True):
        assert reply is not None, "env workers answer describe requests"
        answer = decode(DESCRIBE_REPLY_DECODER, reply)
        if answer.retryable:
            # Busy: the flood had two builds of this tenant in hand already (ask again).
            # Only a request that decoded and passed the checks before a build gets there.
            assert well_formed(DESCRIBE_REQUEST_DECODER, payload), (payload, answer)
            assert "being built already" in answer.error, answer
            continue
        # A garbled request can turn into a well-formed one: that one is answered.
        assert bool(answer.error) != well_formed_describe(payload), (payload, answer)
    answered_backbones = [
        (p, r) for p, r in zip(backbones, backbone_replies, strict=True) if r is not None
    ]
    for payload, reply in answered_backbones:
        refused = isinstance(decode(BACKBONES_REPLY_DECODER, reply), CtlError)
        assert refused != well_formed(BACKBONES_QUERY_DECODER, payload), payload

    # The other tenant's job: the same result as alone.
    losses_during, params_during = await result(js, during, "sft")
    assert losses_during == losses_alone
    assert params_during.keys() == params_alone.keys()
    for name, value in params_alone.items():
        assert torch.equal(params_during[name], value), name

    stop.set()
    await sampler
    assert all(p.poll() is None for p in started.values()), {
        r: p.poll() for r, p in started.items()
    }
    assert not beats.restarts and beats.max_gap_s < 5.0, (beats.restarts, beats.max_gap_s)
    for role in ROLES:
        log = (tmp_path / f"{role}.log").read_text()
        assert "unexpected error" not in log, f"{role}: {log[-3000:]}"
    print(
        f"fuzz: {total} payloads drawn in {drawn_s:.1f}s, sent in {sent_s:.1f}s; "
        f"{dead_wanted} job commands dead-lettered ({queued} queued by the master); "
        f"ctl answered {len(answered_ctl)}/{len(ctl)}, "
        f"backbones answered {len(answered_backbones)}/{len(backbones)}; "
        f"max heartbeat gap {beats.max_gap_s:.2f}s"
    )
    await tenant_nc.close()
    await nc.close()


async def _at_least(value: Any, n: int) -> bool:
    return bool(await value >= n)


async def _events(js: JetStreamContext, subject: str) -> list[object]:
    from schemas.events import EVENT_DECODER

    sub = await js.subscribe(subject, ordered_consumer=True)
    found: list[object] = []
    try:
        while True:
            msg = await sub.next_msg(timeout=0.5)
            found.append(decode(EVENT_DECODER, msg.data))
    except NatsTimeoutError:
        return found
    finally:
        await sub.unsubscribe()
