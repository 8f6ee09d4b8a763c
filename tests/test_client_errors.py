"""What a tenant's client says when it cannot do what was asked: an unreachable broker, a
request for another tenant, a submit that got no answer, a bad id on the command line —
each a clear error, soon, instead of a hang or a traceback."""

from __future__ import annotations

import socket
import time
from pathlib import Path

import pytest
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from bus.connect import connect
from bus.server import EmbeddedServer
from clients import cli, sdk
from clients.errors import RequestError
from schemas import subjects
from tests.helpers import uid


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def test_a_first_connect_to_no_server_gives_up_with_a_connection_error() -> None:
    url = f"nats://127.0.0.1:{free_port()}"
    t0 = time.monotonic()
    with pytest.raises(ConnectionError, match=f"no NATS server answered at {url} within 1 s"):
        await connect(url, first_connect_s=1.0)
    assert time.monotonic() - t0 < 10


async def test_a_connection_that_gave_up_waiting_reconnects_after_it_connected(
    fresh_server: EmbeddedServer,
) -> None:
    """The first-connect bound does not carry over: once connected, reconnects go on."""
    nc = await connect(fresh_server.url, first_connect_s=1.0)
    try:
        assert nc.options["max_reconnect_attempts"] == -1 and nc.options["allow_reconnect"]
    finally:
        await nc.close()


async def test_a_tenant_connection_asking_for_another_tenant_is_refused_at_once(
    nc: NATS,
) -> None:
    client = sdk.Client(nc, tenant="alice")
    t0 = time.monotonic()
    with pytest.raises(RequestError, match=r"tenant 'alice'.*cannot act for tenant 'bob'") as info:
        await client.status("bob", "job-1")
    assert info.value.code == "tenant_mismatch" and not info.value.retryable
    assert time.monotonic() - t0 < 1.0


async def test_a_submit_that_got_no_answer_is_sent_again_and_names_its_job_id(
    nc: NATS, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sdk, "REQUEST_TIMEOUT_S", 0.5)
    tenant = uid("quiet")
    seen: list[bytes] = []

    async def swallow(msg: Msg) -> None:  # a master that takes the request, never answers
        seen.append(msg.data)

    sub = await nc.subscribe(subjects.tenant_ctl(tenant, "submit"), cb=swallow)
    try:
        spec = {
            "kind": "session",
            "tenant": tenant,
            "head": {"kind": "oft", "action_dim": 2, "proprio_dim": 4},
        }
        with pytest.raises(RequestError, match="job id 'my-job' is safe") as info:
            await sdk.Client(nc).submit(spec, job_id="my-job")
        assert info.value.retryable and f"submit of job {tenant}/my-job" in str(info.value)
        assert len(seen) == sdk.SUBMIT_ATTEMPTS and len(set(seen)) == 1  # the same command
    finally:
        await sub.unsubscribe()


def test_a_bad_job_id_on_the_command_line_is_one_line_not_a_traceback(
    nats_server: EmbeddedServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    spec = tmp_path / "spec.yaml"
    spec.write_text(
        "kind: session\ntenant: alice\nhead: {kind: oft, action_dim: 2, proprio_dim: 4}\n"
    )
    argv = ["submit", str(spec), "--job-id", "Bad_Id", "--url", nats_server.url]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("joynexus: InvalidIdError: ") and "Traceback" not in err
