"""Identities on the bus: NKey user keys and the creds files that hold them.

Every tenant, the services and the operator each hold their own NKey (an Ed25519 key; the
server knows only its public ``U...`` key and checks a signed nonce at connect). A creds file
``<home>/creds/<name>.creds`` (mode 0600) holds one identity::

    # joynexus identity role=tenant name=alice public_key=UAB...
    -----BEGIN USER NKEY SEED-----
    SUAB...
    ------END USER NKEY SEED------

The seed block is the one NATS tools write in their ``.creds`` files; nats.py's
``nkeys_seed`` option reads a file that holds only a seed, so :func:`bus.connect.connect`
reads the seed with :func:`load_creds` and passes it in memory (``nkeys_seed_str``).
"""

from __future__ import annotations

import os
import re
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import get_args

import nkeys

from schemas.ids import validate_id
from schemas.tenants import IdentityRole

CREDS_DIR = "creds"
SEED_BEGIN = "-----BEGIN USER NKEY SEED-----"
SEED_END = "------END USER NKEY SEED------"
HEADER = "# joynexus identity"
#: The service and operator identities' names; no tenant may take one.
SERVICE_NAME = "service"
OPERATOR_NAME = "operator"
RESERVED_NAMES = (SERVICE_NAME, OPERATOR_NAME)
_HEADER_RE = re.compile(r"^# joynexus identity role=(\S+) name=(\S+) public_key=(U[A-Z2-7]+)\s*$")


class IdentityError(ValueError):
    """A creds file that cannot be read as an identity, or an invalid identity name."""


@dataclass(frozen=True)
class Identity:
    """One NKey identity. ``seed`` is the secret (``SU...``); keep it out of logs."""

    role: IdentityRole
    name: str
    public_key: str
    seed: str

    def __repr__(self) -> str:  # the seed never reaches a log line or a traceback
        return f"Identity(role={self.role!r}, name={self.name!r}, public_key={self.public_key!r})"


@dataclass(frozen=True)
class CredsFile:
    """What :func:`load_creds` read: the identity and the file it came from."""

    identity: Identity
    path: Path

    @property
    def role(self) -> IdentityRole:
        return self.identity.role

    @property
    def name(self) -> str:
        return self.identity.name

    @property
    def public_key(self) -> str:
        return self.identity.public_key


def check_name(role: IdentityRole, name: str) -> str:
    """``name`` if it is a valid identity name for ``role``: a tenant's is an id
    (:func:`schemas.ids.validate_id`) and not one of :data:`RESERVED_NAMES`."""
    if role not in get_args(IdentityRole):
        raise IdentityError(
            f"unknown identity role {role!r}; expected one of {get_args(IdentityRole)}"
        )
    validate_id(name, f"{role} name")
    if role == "tenant" and name in RESERVED_NAMES:
        raise IdentityError(f"tenant name {name!r} is reserved for the {name} identity")
    return name


def new_identity(role: IdentityRole, name: str) -> Identity:
    """A fresh NKey user identity (32 random bytes from the OS as the Ed25519 seed)."""
    check_name(role, name)
    seed = nkeys.encode_seed(secrets.token_bytes(32), nkeys.PREFIX_BYTE_USER)
    key_pair = nkeys.from_seed(bytearray(seed))
    public_key = key_pair.public_key.decode()
    key_pair.wipe()
    return Identity(role, name, public_key, seed.decode())


def creds_path(creds_dir: Path, name: str) -> Path:
    """``<creds_dir>/<name>.creds``."""
    return Path(creds_dir) / f"{name}.creds"


def render_creds(identity: Identity) -> str:
    """The creds file's text for ``identity``."""
    return (
        f"{HEADER} role={identity.role} name={identity.name} public_key={identity.public_key}\n"
        f"{SEED_BEGIN}\n{identity.seed}\n{SEED_END}\n"
    )


def write_creds(creds_dir: Path, identity: Identity) -> Path:
    """Write ``identity``'s creds file (mode 0600, atomically: a reader never sees half a
    key) and return its path. The directory is made 0700."""
    creds_dir = Path(creds_dir)
    creds_dir.mkdir(parents=True, exist_ok=True)
    creds_dir.chmod(0o700)
    path = creds_path(creds_dir, identity.name)
    tmp = path.with_suffix(".creds.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as out:
        out.write(render_creds(identity))
    os.replace(tmp, path)
    return path


def parse_creds(text: str, source: str = "creds") -> Identity:
    """The identity in a creds file's text; :class:`IdentityError` naming what is wrong."""
    lines = [ln.strip() for ln in text.splitlines()]
    header = next((ln for ln in lines if ln.startswith(HEADER)), None)
    if header is None:
        raise IdentityError(f"{source}: no '{HEADER} role=... name=...' line")
    match = _HEADER_RE.match(header)
    if match is None:
        raise IdentityError(f"{source}: malformed identity line {header!r}")
    role, name, public_key = match.groups()
    if role not in get_args(IdentityRole):
        raise IdentityError(f"{source}: unknown role {role!r}")
    try:
        seed = lines[lines.index(SEED_BEGIN) + 1]
    except (ValueError, IndexError):
        raise IdentityError(f"{source}: no {SEED_BEGIN} block") from None
    try:
        key_pair = nkeys.from_seed(bytearray(seed.encode()))
    except nkeys.NkeysError as exc:
        raise IdentityError(f"{source}: the seed is not a valid NKey seed ({exc})") from None
    actual = key_pair.public_key.decode()
    key_pair.wipe()
    if actual != public_key:
        raise IdentityError(
            f"{source}: the seed's public key {actual} is not the named {public_key}"
        )
    return Identity(role, name, public_key, seed)  # type: ignore[arg-type]


def is_joynexus_creds(path: Path) -> bool:
    """Whether ``path`` is one of our identity files (else e.g. a standard JWT ``.creds``)."""
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.readline().startswith(HEADER)
    except OSError:
        return False


def load_creds(path: str | Path) -> CredsFile:
    """Read an identity's creds file; :class:`IdentityError` if it is not one."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise IdentityError(f"cannot read creds file {path}: {exc.strerror}") from None
    return CredsFile(parse_creds(text, str(path)), path)
