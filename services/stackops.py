"""What a command does to a running local stack from outside it: connect as its operator,
declare the layout (and the tenants written while it was down), wait until its roles
heartbeat, and ask the ``joynexus up`` supervising it for another number of a role's
processes (through its ``desired.json``; it answers in ``processes.json``)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import sys
import time
from pathlib import Path

from nats.aio.client import Client as NATS
from nats.errors import Error as NatsError

from bus import tenantadmin
from bus.auth import load_registry
from bus.codec import DecodeError, decode
from bus.connect import connect
from bus.declare import BusLayout, declare
from bus.identity import OPERATOR_NAME
from bus.kv import kv_values
from bus.local import StackInfo
from schemas import subjects
from schemas.health import HEARTBEAT_DECODER

log = logging.getLogger("joynexus.up")

#: Roles that run once per served backbone (each process holds one resident backbone, or
#: with ``--backbone-service`` the backbone role holds it and the others only heads).
PER_BACKBONE = ("trainer", "inferencer", "backbone")


async def operator_connect(info: StackInfo, name: str) -> NATS:
    """Connect to the local stack as its operator (or with the open mode's password)."""
    return await connect(
        info.url,
        name=name,
        creds=info.creds(OPERATOR_NAME),
        user=info.user,
        password=info.password,
    )


async def declare_layout(info: StackInfo, home: Path | None = None) -> None:
    """Declare the layout; with auth, also write the registry's tenants (records in the
    ``tenants`` KV, their buckets): what ``joynexus tenant`` did while the stack was down."""
    nc = await operator_connect(info, "joynexus-up")
    try:
        await declare(nc.jetstream(), BusLayout(replicas=info.replicas))
        if info.auth and home is not None:
            await tenantadmin.sync_bus(nc, load_registry(home), info.replicas)
    finally:
        await nc.close()


async def wait_healthy(
    info: StackInfo, roles: list[str], timeout: float
) -> tuple[dict[str, str], list[str]]:
    """Wait (bounded) until each role has a fresh heartbeat; return (role → instance, missing)."""
    nc = await operator_connect(info, "joynexus-check")
    try:
        js = nc.jetstream()
        seen: dict[str, str] = {}
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and len(seen) < len(roles):
            try:
                for value in (await kv_values(js, subjects.KV_HEARTBEATS)).values():
                    with contextlib.suppress(DecodeError):
                        beat = decode(HEARTBEAT_DECODER, value)
                        # Held by the bucket = fresh: its TTL (the server's clock) drops a
                        # heartbeat that stops; the sender's clock may be skewed.
                        if beat.role in roles:
                            seen[beat.role] = f"{beat.instance} pid={beat.pid}"
            except NatsError as exc:  # bucket not declared yet, or no keys yet: keep polling
                log.debug("waiting for heartbeats: %s", exc)
            if len(seen) < len(roles):
                await asyncio.sleep(0.2)
        return seen, [r for r in roles if r not in seen]
    finally:
        await nc.close()


def request_scale(home: Path, role: str, count: int, timeout: float = 30.0) -> int:
    """Ask the ``joynexus up`` running under ``home`` to run ``count`` ``role`` processes;
    wait until its process table shows it."""
    if count < 0:
        print("count must be >= 0", file=sys.stderr)
        return 2
    if not (home / "stack.json").exists():
        print(f"no local stack runs under {home}; start one with `joynexus up`", file=sys.stderr)
        return 1
    path = home / "desired.json"
    try:
        desired = json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        desired = {}
    desired[role] = count
    tmp = home / "desired.json.tmp"
    tmp.write_text(json.dumps(desired))
    os.replace(tmp, path)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            table = json.loads((home / "processes.json").read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            table = {}
        copies = table.get("per_backbone", 1) if role in PER_BACKBONE else 1
        if len(table.get(role, [])) == count * copies:
            print(f"{role}: {count} running (pids {table.get(role, [])})")
            return 0
        time.sleep(0.1)
    print(f"the stack did not reach {count} {role} processes in {timeout}s", file=sys.stderr)
    return 1
