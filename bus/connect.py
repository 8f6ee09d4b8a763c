"""Connecting to NATS: URL, credentials file (our NKey identities or a standard JWT
``.creds``), user/password, TLS."""

from __future__ import annotations

import ssl
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from nats.aio.client import Client as NATS
from nats.errors import NoServersError

from bus.identity import is_joynexus_creds, load_creds
from schemas.subjects import SERVICE_INBOX_PREFIX, tenant_inbox_prefix


async def connect(
    url: str,
    *,
    name: str = "joynexus",
    creds: str | Path | None = None,
    user: str | None = None,
    password: str | None = None,
    tls: ssl.SSLContext | None = None,
    max_reconnect_attempts: int = -1,
    error_cb: Callable[[Exception], Awaitable[None]] | None = None,
    first_connect_s: float | None = None,
) -> NATS:
    """Connect with reconnects on (a broker restart is survivable); ``url`` may name several
    servers, comma-separated (a cluster's nodes). ``creds`` is an identity
    file of :mod:`bus.identity` (its NKey signs the server's nonce; a tenant's connection
    uses the tenant's inbox prefix, the only one it may subscribe to) or a standard NATS
    ``.creds`` file (JWT + nkey); ``user``/``password`` plain auth (empty = none), ``tls`` a
    client context. Raises :class:`bus.identity.IdentityError` for an unreadable creds file.
    ``first_connect_s``: give up the first connect after about this long, raising
    :class:`ConnectionError` (a client pointed at the wrong host; without it the first
    connect, like every reconnect, is tried for ever: a service waits for its broker)."""
    options: dict[str, Any] = {
        # A cluster's nodes, comma-separated: a client whose node dies goes to another.
        "servers": [u.strip() for u in url.split(",") if u.strip()],
        "name": name,
        "max_reconnect_attempts": max_reconnect_attempts,
        "reconnect_time_wait": 0.2,
        "connect_timeout": 5,
        # 0: one attempt, no retries (nats.py otherwise retries a refused first connect)
        "allow_reconnect": max_reconnect_attempts != 0,
    }
    if creds is not None:
        options.update(creds_options(Path(creds)))
    if user:
        options["user"] = user
        options["password"] = password or ""
    if tls is not None:
        options["tls"] = tls
    report = error_cb or _quiet_error
    nc = NATS()
    connected = False
    give_up_at = None if first_connect_s is None else time.monotonic() + first_connect_s
    errors: list[Exception] = []

    async def on_error(exc: Exception) -> None:
        errors[:] = [exc]
        if not connected and "authorization violation" in str(exc).lower():
            # A refused key (unknown, revoked, rotated away) is refused again on every retry:
            # fail the first connect at once instead of retrying forever. nats.py reads this
            # option after each failed attempt; later reconnects keep retrying.
            nc.options["allow_reconnect"] = False
        if not connected and give_up_at is not None and time.monotonic() > give_up_at:
            # nats.py drops a server tried more than this many times, and with none left
            # the first connect fails (restored below for the reconnects of a connection).
            nc.options["max_reconnect_attempts"] = 1
            nc.options["allow_reconnect"] = False
        await report(exc)

    options["error_cb"] = on_error
    try:
        await nc.connect(**options)
    except NoServersError as exc:
        await nc.close()
        if first_connect_s is None:
            raise  # the caller's own bound on attempts (max_reconnect_attempts) ran out
        raise ConnectionError(
            f"no NATS server answered at {url} within {first_connect_s:g} s"
            + (f" ({errors[-1]})" if errors else "")
        ) from exc
    except BaseException:
        # a refused connect leaves nats.py's socket open otherwise
        await nc.close()
        raise
    connected = True
    nc.options["max_reconnect_attempts"] = max_reconnect_attempts
    nc.options["allow_reconnect"] = max_reconnect_attempts != 0
    return nc


def creds_options(creds: Path) -> dict[str, Any]:
    """nats.py connect options for a creds file: our identity's seed in memory (nats.py's
    ``nkeys_seed`` would read a file holding only the seed) and, for a tenant, its inbox
    prefix; a standard JWT ``.creds`` file is handed to nats.py as it is."""
    if is_joynexus_creds(creds):
        identity = load_creds(creds).identity
        options: dict[str, Any] = {"nkeys_seed_str": identity.seed}
        if identity.role == "tenant":
            options["inbox_prefix"] = tenant_inbox_prefix(identity.name)
        elif identity.role == "service":
            options["inbox_prefix"] = SERVICE_INBOX_PREFIX
        return options
    if not creds.is_file():
        raise FileNotFoundError(f"creds file {creds} does not exist")
    return {"user_credentials": str(creds)}


async def _quiet_error(exc: Exception) -> None:
    # nats.py logs reconnect errors itself; the default callback would print tracebacks for
    # every reconnect attempt while a broker restarts.
    return None
