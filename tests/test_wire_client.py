"""A third-party client written from docs/wire.md alone: plain nats-py and msgpack maps, no
JoyNexus class on the client side. It submits an SFT job, follows its events a page at a
time until it succeeds, reads its record and downloads the policy in parts, checking the
SHA-256 — against the real roles, as subprocesses (the operator's dataset registration is
the only step done with our helpers)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import msgspec
import pytest
from nats.aio.client import Client as NATS
from nats.errors import NoRespondersError

from bus.connect import connect
from bus.datasets import register_path
from bus.declare import declare
from bus.server import EmbeddedServer
from services.envs.datasets import record as record_dataset
from services.envs.sims import REACH2D_ID
from tests.conftest import Procs
from tests.helpers import eventually, start_service, uid


async def ask(nc: NATS, tenant: str, op: str, **fields: Any) -> dict[str, Any]:
    """One request as wire.md says: a msgpack map tagged by ``type`` equal to the op."""
    body = msgspec.msgpack.encode({"type": op, "tenant": tenant, **fields})
    reply = await nc.request(f"nexus.ctl.tenant.{tenant}.{op}", body, timeout=15)
    answer: dict[str, Any] = msgspec.msgpack.decode(reply.data)
    assert answer["type"] != "error", answer
    return answer


@pytest.mark.timeout(240)
async def test_a_raw_msgpack_client_submits_follows_and_downloads_an_sft_job(
    fresh_server: EmbeddedServer, procs: Procs, tmp_path: Path
) -> None:
    tenant, job = uid("raw"), uid("sft")
    operator = await connect(fresh_server.url)
    await declare(operator.jetstream())
    record_dataset(REACH2D_ID, 4, tmp_path / "demos", seed=0)
    await register_path(operator.jetstream(), tenant, "demos", tmp_path / "demos")
    await operator.close()
    for role in ("master", "envs", "trainer"):
        procs.add(start_service(role, fresh_server.url, tmp_path / f"{role}.log"))

    nc = NATS()
    await nc.connect(fresh_server.url, inbox_prefix=f"_INBOX_{tenant}")
    try:
        spec = {
            "kind": "sft",
            "tenant": tenant,
            "dataset": "demos",
            "head": {"kind": "oft", "action_dim": 2, "chunk_len": 4, "proprio_dim": 4},
            "steps": 4,
            "batch_size": 4,
        }
        submit = {"job_id": job, "spec_json": json.dumps(spec).encode()}
        queued = await eventually(
            lambda: _try(ask(nc, tenant, "submit", **submit)), timeout=60, what="a master"
        )
        assert queued["type"] == "queued" and queued["stream_seq"] > 0

        seen: list[dict[str, Any]] = []
        seqs: list[int] = []
        after = 0

        async def finished() -> bool | None:
            nonlocal after
            page = await ask(nc, tenant, "events", job_id=job, after_seq=after)
            for stored in page["events"]:
                seqs.append(stored["seq"])
                seen.append(msgspec.msgpack.decode(stored["data"]))
            after = page["last_seq"]
            done = [e for e in seen if e["type"] == "state" and e["status"] == "succeeded"]
            return True if done else None

        await eventually(finished, timeout=180, interval=0.5, what="the job to succeed")
        kinds = [e["type"] for e in seen]
        assert kinds[0] == "accepted" and "progress" in kinds and "policy" in kinds
        assert seqs == sorted(set(seqs)), "each event once, in stream order"

        record = (await ask(nc, tenant, "job", job_id=job))["record"]
        assert record["status"] == "succeeded" and record["tenant"] == tenant
        exported = await ask(nc, tenant, "export", job_id=job)
        data = b""
        while len(data) < exported["size"]:
            piece = await ask(
                nc, tenant, "export-read", object_name=exported["object_name"], offset=len(data)
            )
            assert piece["offset"] == len(data) and piece["data"]
            data += piece["data"]
        assert hashlib.sha256(data).hexdigest() == exported["sha256"]
    finally:
        await nc.close()


async def _try(call: Any) -> dict[str, Any] | None:
    """The answer, or None while no master is subscribed yet."""
    try:
        return await call
    except NoRespondersError:
        return None
