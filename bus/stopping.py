"""Stop requests that arrive before the event loop runs.

A role's ``__main__`` calls :func:`install_early` before its heavy imports (torch,
transformers): a SIGTERM/SIGINT during them ends the process at once with exit 0 — nothing
has connected, fetched or written yet, so there is nothing to hand back, and waiting for the
imports to finish (over 10 s on a loaded 2-core machine) would break the 5 s stop bound.
Once :func:`bus.service.serve` installs its own handlers, a signal is a graceful stop. This
module imports nothing but the standard library, so installing it costs nothing.
"""

from __future__ import annotations

import os
import signal
import threading

_requested = threading.Event()


def install_early() -> None:
    """Exit 0 on SIGTERM/SIGINT until :func:`bus.service.serve` installs its own handlers."""
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, _remember)


def _remember(signum: int, frame: object) -> None:
    _requested.set()
    os._exit(0)  # no finalisation: a half-imported torch must not run its exit hooks


def requested() -> bool:
    """Whether a stop signal arrived before the service's loop took over."""
    return _requested.is_set()
