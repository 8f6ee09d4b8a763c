"""The master: consumes ``JOBS``, validates job specs, owns the ``jobs`` KV state machine."""

from services.master.service import MasterConfig, run

__all__ = ["MasterConfig", "run"]
