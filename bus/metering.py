"""Busy time of a service: how long it was actually computing, for utilisation (busy / held).

A role's work can overlap (an env worker steps several tasks' simulators at once, each in its
own thread), so the busy time is the length of the *union* of the intervals during which at
least one piece of work runs, never their sum: a service is either busy or not, and its
utilisation cannot pass 1. :class:`BusyMeter` is driven from the event loop (``with
meter.busy(): await asyncio.to_thread(...)``), so it needs no lock.

:class:`LinearFit` keeps the running sums of a least-squares line ``seconds = fixed +
per_unit * units`` (e.g. an inference batch's time against its observations), so a service
reports the cost model of its operations in a few gauges instead of every sample.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass


@dataclass
class BusyMeter:
    """Union of the intervals during which work runs; ``busy_s`` includes the open one."""

    _active: int = 0
    _since: float = 0.0
    _closed_s: float = 0.0

    def start(self) -> None:
        if self._active == 0:
            self._since = time.perf_counter()
        self._active += 1

    def stop(self) -> None:
        if self._active <= 0:
            raise RuntimeError("BusyMeter.stop() without a start()")
        self._active -= 1
        if self._active == 0:
            self._closed_s += time.perf_counter() - self._since

    @contextmanager
    def busy(self) -> Iterator[None]:
        self.start()
        try:
            yield
        finally:
            self.stop()

    @property
    def running(self) -> int:
        """Pieces of work started and not yet stopped."""
        return self._active

    @property
    def busy_s(self) -> float:
        """Seconds busy so far (the interval in progress counted up to now)."""
        open_s = time.perf_counter() - self._since if self._active else 0.0
        return self._closed_s + open_s


@dataclass
class LinearFit:
    """Running sums for the least-squares line ``seconds = fixed + per_unit * units``."""

    n: int = 0
    sum_units: float = 0.0
    sum_units2: float = 0.0
    sum_s: float = 0.0
    sum_units_s: float = 0.0

    def add(self, units: float, seconds: float) -> None:
        self.n += 1
        self.sum_units += units
        self.sum_units2 += units * units
        self.sum_s += seconds
        self.sum_units_s += units * seconds

    def gauges(self, prefix: str) -> dict[str, float]:
        """The sums as heartbeat gauges ``<prefix>_n``, ``_units``, ``_units2``, ``_s``,
        ``_units_s``: additive, so a reader can take the difference of two readings and
        fit the line over just the work in between (:func:`fit`)."""
        return {
            f"{prefix}_n": float(self.n),
            f"{prefix}_units": self.sum_units,
            f"{prefix}_units2": self.sum_units2,
            f"{prefix}_s": self.sum_s,
            f"{prefix}_units_s": self.sum_units_s,
        }


def fit(gauges: dict[str, float], prefix: str) -> tuple[float, float, int]:
    """``(fixed_s, per_unit_s, n)`` of the line fitted to the sums :meth:`LinearFit.gauges`
    wrote under ``prefix`` (or to their difference between two readings). With too few or
    identical sizes the line is through the origin: ``fixed`` 0, ``per_unit`` the mean."""
    n = gauges.get(f"{prefix}_n", 0.0)
    if n <= 0:
        return 0.0, 0.0, 0
    su, su2 = gauges[f"{prefix}_units"], gauges[f"{prefix}_units2"]
    ss, sus = gauges[f"{prefix}_s"], gauges[f"{prefix}_units_s"]
    denominator = n * su2 - su * su
    if n >= 2 and denominator > 1e-9 * max(1.0, n * su2):
        per_unit = (n * sus - su * ss) / denominator
        fixed = (ss - per_unit * su) / n
        if per_unit < 0:  # noise over a flat cost: the mean, per operation
            return ss / n, 0.0, int(n)
        if fixed < 0:  # noise over a proportional cost: the line through the origin
            return 0.0, sus / su2, int(n)
        return fixed, per_unit, int(n)
    # One size only: the cost cannot be told apart into fixed and per unit; per unit.
    return 0.0, ss / su if su > 0 else 0.0, int(n)
