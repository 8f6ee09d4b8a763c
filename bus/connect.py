"""Connecting to NATS: URL, credentials file, user/password, TLS."""

from __future__ import annotations

import ssl
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import nats
from nats.aio.client import Client as NATS


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
) -> NATS:
    """Connect with reconnects on (a broker restart is survivable); ``creds`` is a NATS
    ``.creds`` file (JWT + nkey), ``user``/``password`` plain auth, ``tls`` a client context."""
    options: dict[str, Any] = {
        "servers": [url],
        "name": name,
        "max_reconnect_attempts": max_reconnect_attempts,
        "reconnect_time_wait": 0.2,
        "connect_timeout": 5,
        "allow_reconnect": True,
    }
    if creds is not None:
        options["user_credentials"] = str(creds)
    if user is not None:
        options["user"] = user
        options["password"] = password or ""
    if tls is not None:
        options["tls"] = tls
    if error_cb is not None:
        options["error_cb"] = error_cb
    else:
        options["error_cb"] = _quiet_error
    return await nats.connect(**options)


async def _quiet_error(exc: Exception) -> None:
    # nats.py logs reconnect errors itself; the default callback would print tracebacks for
    # every reconnect attempt while a broker restarts.
    return None
