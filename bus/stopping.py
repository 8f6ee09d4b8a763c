"""Stop requests that arrive before the event loop runs.

A role's ``__main__`` calls :func:`install_early` before its heavy imports (torch,
transformers): a SIGTERM/SIGINT during them is remembered instead of killing the process, and
:func:`bus.service.serve` turns it into a clean stop (exit 0) as soon as its loop runs. This
module imports nothing but the standard library, so installing it costs nothing.
"""

from __future__ import annotations

import signal
import threading

_requested = threading.Event()


def install_early() -> None:
    """Remember SIGTERM/SIGINT until :func:`bus.service.serve` installs its own handlers."""
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, _remember)


def _remember(signum: int, frame: object) -> None:
    _requested.set()


def requested() -> bool:
    """Whether a stop signal arrived before the service's loop took over."""
    return _requested.is_set()
