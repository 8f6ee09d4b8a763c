"""Who may do what on the bus: the identities registry and the server's authorization config.

The operator's registry ``<home>/auth/identities.json`` lists every identity (tenants, the
services, the operator) by its NKey public key, with each tenant's limits, plus the
server-wide connection limits. :func:`render` turns it into the ``nats-server`` config that
the server includes (``<home>/nats/auth.conf``); a reload (SIGHUP) applies a new one to live
connections: a revoked key is disconnected, a rotated one replaced.

One account, per-user permissions (README "Tenants and security" says why). A tenant's
identity is allowed exactly this and denied everything else:

* publish its own requests to the master (``nexus.ctl.tenant.<t>.>``: submit, cancel, read
  its events, push datasets, export policies, read its records) and the shared read-only
  queries (env describe, served backbones);
* subscribe to its own inbox prefix ``_INBOX_<t>`` (the replies) and, core NATS only, to its
  own live events ``nexus.event.<t>.>`` (a wake-up; the events themselves are read from the
  master, :mod:`clients.follow`).

No JetStream at all, not even on its own data: JetStream answers a publish (its ack), an API
call (its response) and a pull (the messages) at whatever reply subject the request names,
and the server does not check that subject against the requester's permissions. A tenant
allowed to publish into a stream could name ``$KV.jobs.<other>.<job>`` as the reply and have
the server write the ack into another tenant's job record. The services answer a tenant
only on its own inbox (:func:`reply_allowed`).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import msgspec

from bus.identity import OPERATOR_NAME, SERVICE_NAME, Identity, check_name
from schemas import subjects as s
from schemas.ids import InvalidIdError, validate_id
from schemas.tenants import IdentityRole, TenantLimits

AUTH_DIR = "auth"
REGISTRY_FILE = "identities.json"


class ServerLimits(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Server-wide per-connection limits (config mode has no per-user ones; see README)."""

    #: Largest message a client may publish, in bytes.
    max_payload: int = 1 << 20
    #: Bytes buffered for a slow client before the server disconnects it.
    max_pending: int = 64 << 20
    #: Subscriptions per connection (0 = unlimited).
    max_subscriptions: int = 1000
    #: Client connections on the server (0 = unlimited).
    max_connections: int = 0


class RegisteredIdentity(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One identity the server knows by its public key."""

    role: IdentityRole
    name: str
    public_key: str
    created_at: float
    rotated_at: float = 0.0
    revoked: bool = False
    #: A tenant's limits (ignored for the service and operator).
    limits: TenantLimits = TenantLimits()


class Registry(msgspec.Struct, forbid_unknown_fields=True):
    """Every identity and the server-wide limits; the source the auth config is rendered from."""

    identities: list[RegisteredIdentity] = msgspec.field(default_factory=list)
    limits: ServerLimits = ServerLimits()

    def find(self, name: str) -> RegisteredIdentity | None:
        """The identity named ``name`` (names are unique across roles)."""
        return next((i for i in self.identities if i.name == name), None)

    def tenants(self) -> list[RegisteredIdentity]:
        return [i for i in self.identities if i.role == "tenant"]

    def put(self, entry: RegisteredIdentity) -> None:
        """Add ``entry`` or replace the identity of the same name."""
        self.identities = [i for i in self.identities if i.name != entry.name] + [entry]

    def register(
        self, identity: Identity, limits: TenantLimits | None = None, *, rotated: bool = False
    ) -> RegisteredIdentity:
        """Record ``identity`` (new, or a rotation of the same name: created_at kept)."""
        check_name(identity.role, identity.name)
        old = self.find(identity.name)
        if old is not None and old.role != identity.role:
            raise ValueError(f"{identity.name!r} is already a {old.role} identity")
        now = time.time()
        entry = RegisteredIdentity(
            identity.role,
            identity.name,
            identity.public_key,
            old.created_at if old else now,
            rotated_at=now if rotated else (old.rotated_at if old else 0.0),
            revoked=False,
            limits=limits or (old.limits if old else TenantLimits()),
        )
        self.put(entry)
        return entry


def registry_path(home: Path) -> Path:
    return Path(home) / AUTH_DIR / REGISTRY_FILE


def load_registry(home: Path) -> Registry:
    """The registry under ``home`` (an empty one if none was written yet)."""
    path = registry_path(home)
    if not path.exists():
        return Registry()
    return msgspec.json.decode(path.read_bytes(), type=Registry)


def save_registry(home: Path, registry: Registry) -> Path:
    """Write the registry atomically (mode 0600)."""
    path = registry_path(home)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.parent.chmod(0o700)
    tmp = path.with_suffix(".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as out:
        out.write(msgspec.json.format(msgspec.json.encode(registry)))
    os.replace(tmp, path)
    return path


def tenant_publish(tenant: str) -> list[str]:
    """Subjects a tenant may publish to (everything else is denied): core NATS requests the
    services answer, none of them captured by a stream."""
    return [
        f"{s.PREFIX}.ctl.tenant.{tenant}.>",
        s.env_describe(tenant),
        s.backbones_query(tenant),
    ]


def tenant_subscribe(tenant: str) -> list[str]:
    """Subjects a tenant may subscribe to: its own inbox prefix and its own live events."""
    return [f"{s.tenant_inbox_prefix(tenant)}.>", f"{s.PREFIX}.event.{tenant}.>"]


def _quote(values: list[str]) -> str:
    return "[" + ", ".join(f'"{v}"' for v in values) + "]"


def _user(entry: RegisteredIdentity) -> str:
    if entry.role != "tenant":
        # Services and the operator run the backbone: every subject, every JetStream API.
        perms = 'publish: { allow: [">"] }, subscribe: { allow: [">"] }'
    else:
        t = entry.name
        perms = (
            f"publish: {{ allow: {_quote(tenant_publish(t))} }}, "
            f"subscribe: {{ allow: {_quote(tenant_subscribe(t))} }}"
        )
    user = f"{{ nkey: {entry.public_key}, permissions: {{ {perms} }} }}"
    return f"    # {entry.role} {entry.name}\n    {user}"


def render(registry: Registry) -> str:
    """The ``nats-server`` config text for ``registry``: the server-wide limits and one
    ``authorization`` user per unrevoked identity. Raises ValueError without a service
    identity (no service could connect)."""
    live = [i for i in registry.identities if not i.revoked]
    if not any(i.role == "service" for i in live):
        raise ValueError("the registry has no service identity: no service could connect")
    lim = registry.limits
    lines = [
        "# Rendered by JoyNexus from the identities registry; edit with `joynexus tenant`.",
        f"max_payload: {lim.max_payload}",
        f"max_pending: {lim.max_pending}",
    ]
    if lim.max_subscriptions:
        lines.append(f"max_subscriptions: {lim.max_subscriptions}")
    if lim.max_connections:
        lines.append(f"max_connections: {lim.max_connections}")
    users = ",\n".join(_user(i) for i in sorted(live, key=lambda i: (i.role, i.name)))
    lines.append(f"authorization {{\n  users: [\n{users}\n  ]\n}}")
    return "\n".join(lines) + "\n"


def base_identities(registry: Registry, creds_dir: Path) -> list[Path]:
    """Ensure the service and operator identities exist (creds written); return the paths of
    those created."""
    from bus.identity import new_identity, write_creds

    made = []
    for role, name in (("service", SERVICE_NAME), ("operator", OPERATOR_NAME)):
        entry = registry.find(name)
        path = creds_dir / f"{name}.creds"
        if entry is None or entry.revoked or not path.exists():
            identity = new_identity(role, name)  # type: ignore[arg-type]
            registry.register(identity, rotated=entry is not None)
            made.append(write_creds(creds_dir, identity))
    return made


def reply_allowed(reply: str, tenant: str | None = None) -> bool:
    """Whether a service may answer a request at ``reply``. The broker checks what a client
    publishes to, never the reply subject it names, so a tenant could name another tenant's
    inbox, a stream's subject (``nexus.event.<other>...``) or a service's own inbox (where a
    pull consumer's deliveries arrive: a foreign message there stopped its consume loop) and
    have the service's answer (which may publish anywhere) land there. Allowed: the
    operator's (and every client's in open mode) ``_INBOX.``; for a request on ``tenant``'s
    subject its own ``_INBOX_<tenant>.``; for one on a subject only services and the operator
    may publish to (``tenant`` None), the services' ``_INBOX_SVC.``."""
    if reply.startswith("_INBOX."):
        return True
    if tenant is None:
        return reply.startswith(f"{s.SERVICE_INBOX_PREFIX}.")
    return reply.startswith(f"{s.tenant_inbox_prefix(tenant)}.")


def query_reply_allowed(subject: str, base: str, reply: str) -> bool:
    """Whether a shared query (env describe, backbones) on ``subject`` may be answered at
    ``reply``: one under a tenant's token (:func:`schemas.subjects.env_describe`) only on
    that tenant's inbox; the bare subject, which only services and the operator may publish
    to, only on theirs (``_INBOX.``, ``_INBOX_SVC.``)."""
    try:
        tenant = s.shared_query_tenant(subject, base)
    except s.SubjectError:
        return False
    if tenant is None:
        return reply_allowed(reply)
    return reply.startswith(f"{s.tenant_inbox_prefix(tenant)}.")


def any_inbox(reply: str) -> bool:
    """Whether ``reply`` is some identity's inbox (``_INBOX.``, ``_INBOX_SVC.`` or
    ``_INBOX_<tenant>.``): the test for answering a request only services and the operator
    may publish (health), whose answer must never be published onto a stream's subject.
    (A subject a tenant may publish to is answered on that tenant's inbox only:
    :func:`reply_allowed`, :func:`query_reply_allowed`.)"""
    if reply.startswith(("_INBOX.", f"{s.SERVICE_INBOX_PREFIX}.")):
        return True
    prefix, dot, rest = reply.partition(".")
    if not dot or not rest or not prefix.startswith("_INBOX_"):
        return False
    try:
        validate_id(prefix.removeprefix("_INBOX_"), "tenant")
    except InvalidIdError:
        return False
    return True
