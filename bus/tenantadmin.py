"""The operator's tenant administration: add, list, rotate, revoke, set limits.

State lives in the home (``joynexus up``'s ``--home``): the identities registry
(:mod:`bus.auth`), the creds files under ``<home>/creds/``, and the server's rendered
``<home>/nats/auth.conf``. Each change is applied to a running local stack at once (config
re-rendered, server reloaded: a revoked key is disconnected), then written to the bus as the
operator: the tenant's :class:`schemas.tenants.TenantRecord` in the ``tenants`` KV and its
object store bucket ``data-<t>`` (``max_bytes`` = its storage limit). On a stopped home the
same is applied by the next ``joynexus up`` (:func:`sync_bus`).
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from pathlib import Path

import msgspec
from nats.aio.client import Client as NATS
from nats.js import JetStreamContext
from nats.js.api import ObjectStoreConfig, StorageType
from nats.js.errors import NotFoundError

from bus.auth import (
    RegisteredIdentity,
    Registry,
    ServerLimits,
    base_identities,
    load_registry,
    render,
    save_registry,
)
from bus.codec import encode
from bus.connect import connect
from bus.declare import BusLayout, declare
from bus.identity import CREDS_DIR, OPERATOR_NAME, creds_path, new_identity, write_creds
from bus.server import auth_file, reload_running, running_pid, write_auth_file
from schemas import subjects as s
from schemas.tenants import PRIORITY_WEIGHTS, TenantLimits, TenantRecord

#: Where ``joynexus up`` keeps its server's store, config and pid file under the home.
SERVER_DIR = "nats"
SERVER_LOG = Path("logs") / "nats-server.log"


class TenantAdminError(ValueError):
    """A tenant command that cannot be done (unknown tenant, already exists, ...)."""


@dataclass(frozen=True)
class Applied:
    """What applying a change reached: the server reloaded, the bus records written."""

    reloaded: bool
    synced: bool


def creds_dir(home: Path) -> Path:
    return Path(home) / CREDS_DIR


def server_dir(home: Path) -> Path:
    return Path(home) / SERVER_DIR


def node_dirs(home: Path, nodes: int) -> list[Path]:
    """Each cluster node's store dir: the lone server's for the first, ``nats-<i>`` after."""
    return [server_dir(home)] + [Path(home) / f"{SERVER_DIR}-{i}" for i in range(2, nodes + 1)]


def node_logs(home: Path, nodes: int) -> list[Path]:
    """Each cluster node's log: the lone server's for the first, ``nats-server-<i>.log``."""
    log = Path(home) / SERVER_LOG
    return [log] + [log.with_name(f"nats-server-{i}.log") for i in range(2, nodes + 1)]


def init_home(home: Path) -> Registry:
    """Ensure the service and operator identities exist and the auth config is rendered;
    return the registry."""
    registry = load_registry(home)
    base_identities(registry, creds_dir(home))
    save_registry(home, registry)
    write_auth_file(server_dir(home), render(registry))
    return registry


def ensure_tenant(home: Path, name: str, limits: TenantLimits | None = None) -> bool:
    """Register tenant ``name`` unless it already is (unrevoked, creds present); True if a
    new identity was made. Used by ``joynexus up`` for the demo tenants."""
    registry = load_registry(home)
    entry = registry.find(name)
    if entry is not None and not entry.revoked and creds_path(creds_dir(home), name).exists():
        return False
    identity = new_identity("tenant", name)
    registry.register(identity, limits)
    write_creds(creds_dir(home), identity)
    save_registry(home, registry)
    return True


def add_tenant(home: Path, name: str, limits: TenantLimits | None = None) -> Path:
    """Create tenant ``name`` (a revoked one may be added again: it gets a new key); return
    its creds file."""
    registry = init_home(home)
    entry = registry.find(name)
    if entry is not None and entry.role != "tenant":
        raise TenantAdminError(f"{name!r} is the {entry.role} identity's name, not a tenant's")
    if entry is not None and not entry.revoked:
        raise TenantAdminError(
            f"tenant {name!r} already exists; `joynexus tenant rotate {name}` gives it a new key"
        )
    identity = new_identity("tenant", name)
    registry.register(identity, limits or TenantLimits())
    path = write_creds(creds_dir(home), identity)
    save_registry(home, registry)
    return path


def _tenant(registry: Registry, name: str) -> RegisteredIdentity:
    entry = registry.find(name)
    if entry is None or entry.role != "tenant":
        known = ", ".join(sorted(t.name for t in registry.tenants())) or "none"
        raise TenantAdminError(f"unknown tenant {name!r} (tenants: {known})")
    return entry


def rotate_tenant(home: Path, name: str) -> Path:
    """Give tenant ``name`` a new key (its creds file is rewritten; the old key stops working
    at the reload)."""
    registry = init_home(home)
    entry = _tenant(registry, name)
    if entry.revoked:
        raise TenantAdminError(f"tenant {name!r} is revoked; `joynexus tenant add {name}` again")
    identity = new_identity("tenant", name)
    registry.register(identity, entry.limits, rotated=True)
    path = write_creds(creds_dir(home), identity)
    save_registry(home, registry)
    return path


def revoke_tenant(home: Path, name: str) -> None:
    """Revoke tenant ``name``: its key is removed from the server (its connections are
    closed at the reload) and its creds file deleted. Its data stays (nothing accepted is
    lost); the master refuses its work once its record says revoked."""
    registry = init_home(home)
    entry = _tenant(registry, name)
    registry.put(msgspec.structs.replace(entry, revoked=True))
    creds_path(creds_dir(home), name).unlink(missing_ok=True)
    save_registry(home, registry)


#: ``joynexus tenant add/set`` flags and the :class:`TenantLimits` field each sets.
LIMIT_FLAGS: dict[str, str] = {
    "max_jobs": "max_concurrent_jobs",
    "max_storage": "max_storage_bytes",
    "max_slots": "max_slots",
    "max_env_sessions": "max_env_sessions",
    "max_inflight_samples": "max_inflight_samples",
    "priority": "priority",
    "max_job_priority": "max_job_priority",
}


def limits_with(limits: TenantLimits, **flags: int | str | None) -> TenantLimits:
    """``limits`` with the flags given (by :data:`LIMIT_FLAGS` name; None = unchanged),
    checked."""
    changes = {LIMIT_FLAGS[k]: v for k, v in flags.items() if v is not None}
    return check_limits(msgspec.structs.replace(limits, **changes))


def set_limits(home: Path, name: str, **flags: int | str | None) -> TenantLimits:
    """Change tenant ``name``'s limits (:data:`LIMIT_FLAGS`); return the new ones."""
    registry = init_home(home)
    entry = _tenant(registry, name)
    limits = limits_with(entry.limits, **flags)
    registry.put(msgspec.structs.replace(entry, limits=limits))
    save_registry(home, registry)
    return limits


def set_server_limits(home: Path, **values: int | None) -> ServerLimits:
    """Change the server-wide per-connection limits (``max_payload``, ``max_pending``,
    ``max_subscriptions``, ``max_connections``; None = unchanged); return the new ones."""
    registry = init_home(home)
    changes = {k: v for k, v in values.items() if v is not None}
    for name, value in changes.items():
        if name not in ServerLimits.__struct_fields__:
            raise TenantAdminError(f"unknown server limit {name!r}")
        if value < 0 or (value == 0 and name in ("max_payload", "max_pending")):
            raise TenantAdminError(f"--{name.replace('_', '-')} must be positive, got {value}")
    registry.limits = msgspec.structs.replace(registry.limits, **changes)
    save_registry(home, registry)
    return registry.limits


#: The largest value of any limit: the bus carries them (and JetStream a bucket's size) as
#: 64-bit signed integers; a larger one was saved, then broke every sync and `joynexus up`.
MAX_LIMIT = 2**63 - 1


def check_limits(limits: TenantLimits) -> TenantLimits:
    """Raise :class:`TenantAdminError` naming a limit that is not within 1..``MAX_LIMIT``
    or a priority class that does not exist."""
    for flag, name in LIMIT_FLAGS.items():
        value = getattr(limits, name)
        if name == "priority":
            if value not in PRIORITY_WEIGHTS:
                raise TenantAdminError(
                    f"--priority must be one of {', '.join(PRIORITY_WEIGHTS)}, got {value!r}"
                )
        elif not 1 <= value <= MAX_LIMIT:
            raise TenantAdminError(
                f"--{flag.replace('_', '-')} must be within 1..{MAX_LIMIT}, got {value}"
            )
    return limits


def tenant_record(entry: RegisteredIdentity) -> TenantRecord:
    """The ``tenants`` KV record of a registered tenant."""
    return TenantRecord(
        entry.name,
        entry.public_key,
        entry.created_at,
        entry.limits,
        rotated_at=entry.rotated_at,
        revoked=entry.revoked,
    )


async def ensure_bucket(
    js: JetStreamContext, tenant: str, max_bytes: int, replicas: int = 1
) -> None:
    """Create the tenant's object store bucket with ``max_bytes``, or set its ``max_bytes``
    if it exists with another (the broker then refuses writes past it)."""
    bucket = s.tenant_bucket(tenant)
    try:
        info = await js.stream_info(f"OBJ_{bucket}")
    except NotFoundError:
        await js.create_object_store(
            bucket,
            config=ObjectStoreConfig(
                description=f"datasets and exported policies of tenant {tenant}",
                max_bytes=max_bytes,
                storage=StorageType.FILE,
                replicas=replicas,
            ),
        )
        return
    if info.config.max_bytes != max_bytes:
        await js.update_stream(dataclasses.replace(info.config, max_bytes=max_bytes))


async def sync_bus(nc: NATS, registry: Registry, replicas: int = 1) -> int:
    """Write every tenant's record into the ``tenants`` KV (revoked ones marked) and ensure
    the unrevoked ones' buckets (with ``replicas``: 3 on a cluster); return the number of
    tenants written."""
    js = nc.jetstream()
    kv = await js.key_value(s.KV_TENANTS)
    for entry in registry.tenants():
        await kv.put(entry.name, encode(tenant_record(entry)))
        if not entry.revoked:
            await ensure_bucket(js, entry.name, entry.limits.max_storage_bytes, replicas)
    return len(registry.tenants())


async def apply(
    home: Path, url: str | None = None, timeout: float = 10.0, replicas: int = 1
) -> Applied:
    """Render the registry into the servers' auth config and reload the home's servers that
    run (every node of a cluster); with ``url``, write the tenants' records and buckets (with
    ``replicas``) to that bus as the operator (a server elsewhere, e.g. compose's, is
    reloaded by its own operator: SIGHUP)."""
    home = Path(home)
    registry = load_registry(home)
    rendered = render(registry)
    nodes = max(1, len(list(home.glob(f"{SERVER_DIR}-[0-9]*"))) + 1)
    pid = None
    for store, log in zip(node_dirs(home, nodes), node_logs(home, nodes), strict=True):
        write_auth_file(store, rendered)
        running = running_pid(store)
        if running is not None:
            reload_running(running, log, timeout)
            pid = pid or running
    if url is None:
        return Applied(reloaded=pid is not None, synced=False)
    nc = await connect(
        url,
        name="joynexus-tenant-admin",
        creds=creds_path(creds_dir(home), OPERATOR_NAME),
        max_reconnect_attempts=2,
    )
    try:
        # The layout first: a bus whose services have not started yet (compose's, right
        # after `up`) has no tenants KV; declaring is idempotent and safe beside them.
        await declare(nc.jetstream(), BusLayout(replicas=replicas))
        await sync_bus(nc, registry, replicas)
    finally:
        await nc.close()
    return Applied(reloaded=pid is not None, synced=True)


def auth_conf(home: Path) -> Path:
    """The rendered authorization config of ``home`` (what compose's NATS includes)."""
    return auth_file(server_dir(home))


def describe(registry: Registry) -> list[str]:
    """``joynexus tenant list``'s lines."""
    lines = [
        f"{'tenant':<24} {'state':<8} {'priority':<8} {'jobs':>5} {'slots':>5} {'envs':>5} "
        f"{'samples':>8} {'storage':>12}  key, rotated"
    ]
    for t in sorted(registry.tenants(), key=lambda e: e.name):
        rotated = (
            time.strftime("%Y-%m-%d %H:%M", time.gmtime(t.rotated_at)) if t.rotated_at else "-"
        )
        lim = t.limits
        lines.append(
            f"{t.name:<24} {'revoked' if t.revoked else 'active':<8} {lim.priority:<8} "
            f"{lim.max_concurrent_jobs:>5} {lim.max_slots:>5} {lim.max_env_sessions:>5} "
            f"{lim.max_inflight_samples:>8} {lim.max_storage_bytes:>12}  "
            f"{t.public_key[:12]}…, {rotated}"
        )
    return lines
