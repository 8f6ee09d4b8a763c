"""Identities and the rendered authorization config, without a server."""

from __future__ import annotations

import asyncio
import stat
import subprocess
import sys
from functools import partial
from pathlib import Path

import msgspec
import nkeys
import pytest

from bus import tenantadmin
from bus.auth import (
    Registry,
    load_registry,
    registry_path,
    render,
    reply_allowed,
    save_registry,
)
from bus.connect import connect
from bus.identity import IdentityError, load_creds, new_identity, write_creds
from bus.server import EmbeddedServer, free_port
from schemas import subjects
from schemas.ids import InvalidIdError
from schemas.tenants import TenantLimits


def test_creds_round_trip_signs_as_the_registered_key(tmp_path: Path) -> None:
    identity = new_identity("tenant", "alice")
    path = write_creds(tmp_path / "creds", identity)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    loaded = load_creds(path)
    assert (loaded.role, loaded.name, loaded.public_key) == ("tenant", "alice", identity.public_key)
    # the seed signs, and the public key verifies it: what the server checks at connect
    signer = nkeys.from_seed(bytearray(loaded.identity.seed.encode()))
    assert signer.public_key.decode() == identity.public_key
    assert signer.verify(b"nonce", signer.sign(b"nonce"))
    assert identity.seed not in repr(identity)
    assert new_identity("tenant", "alice").public_key != identity.public_key


@pytest.mark.parametrize(
    ("role", "name", "error"),
    [
        ("tenant", "service", IdentityError),
        ("tenant", "operator", IdentityError),
        ("tenant", "a.b", InvalidIdError),
        ("tenant", "*", InvalidIdError),
        ("admin", "x", IdentityError),
    ],
)
def test_bad_identity_names_are_refused(role: str, name: str, error: type[Exception]) -> None:
    with pytest.raises(error):
        new_identity(role, name)  # type: ignore[arg-type]


def test_a_file_without_an_identity_is_refused(tmp_path: Path) -> None:
    bad = tmp_path / "x.creds"
    bad.write_text("-----BEGIN USER NKEY SEED-----\nSUXXX\n------END USER NKEY SEED------\n")
    with pytest.raises(IdentityError, match="no '# joynexus identity"):
        load_creds(bad)
    with pytest.raises(IdentityError, match="cannot read"):
        load_creds(tmp_path / "missing.creds")


def test_render_grants_a_tenant_only_its_own_subjects(tmp_path: Path) -> None:
    tenantadmin.init_home(tmp_path)
    tenantadmin.add_tenant(tmp_path, "alice", TenantLimits(2, 1 << 20))
    text = render(load_registry(tmp_path))
    alice = next(line for line in text.splitlines() if "nexus.ctl.tenant.alice.>" in line)
    publish = (
        'publish: { allow: ["nexus.ctl.tenant.alice.>", "nexus.envinfo.describe.alice", '
        '"nexus.ctl.backbones.alice"] }'
    )
    assert publish in alice
    assert 'subscribe: { allow: ["_INBOX_alice.>", "nexus.event.alice.>"] }' in alice
    assert "$JS" not in alice and "$KV" not in alice and "$O." not in alice  # no JetStream
    assert text.count("nkey: U") == 3  # service, operator, alice
    tenantadmin.revoke_tenant(tmp_path, "alice")
    assert "nexus.ctl.tenant.alice" not in render(load_registry(tmp_path))


def test_tenant_admin_refuses_what_it_cannot_do(tmp_path: Path) -> None:
    tenantadmin.add_tenant(tmp_path, "alice")
    with pytest.raises(tenantadmin.TenantAdminError, match="already exists"):
        tenantadmin.add_tenant(tmp_path, "alice")
    with pytest.raises(tenantadmin.TenantAdminError, match="unknown tenant 'bob'"):
        tenantadmin.rotate_tenant(tmp_path, "bob")
    with pytest.raises(tenantadmin.TenantAdminError, match=r"--max-jobs must be within 1\.\."):
        tenantadmin.set_limits(tmp_path, "alice", max_jobs=0)
    # Found by an audit: a limit past 64 bits was saved, then broke every sync and `up`.
    with pytest.raises(
        tenantadmin.TenantAdminError,
        match=r"--max-storage must be within 1\.\.9223372036854775807, got 1000000",
    ):
        tenantadmin.set_limits(tmp_path, "alice", max_storage=10**24)
    tenantadmin.revoke_tenant(tmp_path, "alice")
    with pytest.raises(tenantadmin.TenantAdminError, match="revoked"):
        tenantadmin.rotate_tenant(tmp_path, "alice")
    assert tenantadmin.add_tenant(tmp_path, "alice").exists()  # re-added with a new key


def test_registry_rejects_unknown_fields(tmp_path: Path) -> None:
    save_registry(tmp_path, Registry())
    path = registry_path(tmp_path)
    path.write_text('{"identities": [], "limits": {}, "typo": 1}')
    with pytest.raises(msgspec.ValidationError, match="typo"):
        load_registry(tmp_path)


def tenant_command(home: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """``joynexus tenant ARGS --home HOME`` as the operator runs it; output captured."""
    return subprocess.run(
        [str(Path(sys.executable).parent / "joynexus"), "tenant", *args, "--home", str(home)],
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_tenant_commands_on_a_stopped_home(tmp_path: Path) -> None:
    run = partial(tenant_command, tmp_path)
    added = run("add", "acme", "--max-jobs", "2", "--max-storage", "5000")
    assert added.returncode == 0, added.stderr
    assert str(tmp_path / "creds" / "acme.creds") in added.stdout
    assert "applied" in added.stdout or "applies it" in added.stdout
    key = load_creds(tmp_path / "creds" / "acme.creds").public_key
    listed = run("list")
    assert "acme" in listed.stdout and "active" in listed.stdout and " 5000 " in listed.stdout
    limits = run("set", "acme", "--priority", "high", "--max-env-sessions", "8", "--max-slots", "3")
    assert limits.returncode == 0, limits.stderr
    entry = next(t for t in load_registry(tmp_path).tenants() if t.name == "acme")
    assert (entry.limits.priority, entry.limits.weight) == ("high", 4)
    assert (entry.limits.max_env_sessions, entry.limits.max_slots) == (8, 3)
    assert entry.limits.max_concurrent_jobs == 2  # unchanged
    assert " high " in run("list").stdout
    refused = run("set", "acme", "--max-inflight-samples", "0")
    assert refused.returncode == 2 and "--max-inflight-samples must be within 1.." in refused.stderr
    assert run("set", "acme", "--priority", "urgent").returncode == 2  # not a class
    assert run("rotate", "acme").returncode == 0
    assert load_creds(tmp_path / "creds" / "acme.creds").public_key != key
    bad = run("add", "operator")
    assert bad.returncode == 2 and "operator identity's name" in bad.stderr
    assert run("revoke", "acme").returncode == 0
    assert "revoked" in run("list").stdout
    assert "nexus.job.acme" not in (tmp_path / "nats" / "auth.conf").read_text()


def test_services_answer_only_into_inboxes() -> None:
    assert reply_allowed("_INBOX.abc.1") and reply_allowed("_INBOX_alice.abc", "alice")
    assert not reply_allowed("_INBOX_alice.abc", "bob")
    assert not reply_allowed("_INBOX_alicex.abc", "alice")
    assert not reply_allowed("nexus.event.alice.j.state", "bob")
    assert not reply_allowed("nexus.job.alice.cancel")
    # The services' own inboxes (their pull consumers' deliveries arrive there): only for a
    # request on a subject no tenant may publish to.
    assert reply_allowed("_INBOX_SVC.abc.1")
    assert not reply_allowed("_INBOX_SVC.abc.1", "alice")
    assert not reply_allowed("_INBOX_SVCX.abc.1")


def test_tenant_add_writes_to_a_bus_before_its_services_start_or_says_it_was_not_reached(
    tmp_path: Path, fresh_server: EmbeddedServer
) -> None:
    """compose's order: NATS is up, the roles have not declared the layout yet; and a bus
    that does not answer is named with the command that finishes the job later."""
    home = tmp_path / "home"
    run = partial(tenant_command, home)
    added = run("add", "acme", "--url", fresh_server.url)
    assert added.returncode == 0, added.stderr
    assert f"tenant records and buckets written to {fresh_server.url}" in added.stdout

    async def records() -> tuple[bytes, list[str | None]]:
        nc = await connect(fresh_server.url)
        try:
            js = nc.jetstream()
            entry = await (await js.key_value(subjects.KV_TENANTS)).get("acme")
            assert entry.value is not None
            return entry.value, [info.config.name for info in await js.streams_info()]
        finally:
            await nc.close()

    record, streams = asyncio.run(records())
    assert b"acme" in record and "OBJ_data-acme" in streams and "KV_tenants" in streams

    dead = f"nats://127.0.0.1:{free_port()}"
    unreached = run("add", "bob", "--url", dead)
    assert unreached.returncode == 1
    assert f"saved in {home}, but the bus at {dead} was not reached" in unreached.stderr
    # A bus that answers and refuses (a bucket larger than its storage) says so, not that
    # it was not reached.
    refused = run("set", "acme", "--max-storage", str(2**62), "--url", fresh_server.url)
    assert refused.returncode == 1
    assert f"saved in {home}, but the bus at {fresh_server.url} refused it (" in refused.stderr
    assert "insufficient storage" in refused.stderr
    fixed = run("set", "acme", "--max-storage", str(1 << 30), "--url", fresh_server.url)
    assert fixed.returncode == 0, fixed.stderr
    assert "joynexus tenant sync --url URL" in unreached.stderr
    synced = run("sync", "--url", fresh_server.url)
    assert synced.returncode == 0, synced.stderr
