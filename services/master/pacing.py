"""Per-tenant pacing of the master's answers: one tenant's flood of requests takes at most
its rate of the master's (and, through it, the inferencers' and the trainers') time.

Each tenant has a token bucket (``rate`` tokens a second, at most ``burst`` saved up). A
request takes a token when it arrives, and one more per :data:`BYTES_PER_TOKEN` of its
payload (a 0.8 MB act request costs 4: bytes are what a flood of large requests spends of
the broker's and the master's time); one that finds none is not refused but *waits* for
its token before it is handled, so a client asking in a closed loop is slowed to the rate
and still gets every answer, and one within its rate never waits. How many of a tenant's
requests may wait at once is bounded elsewhere (the master's in-flight cap per tenant), so
the wait is bounded too: at most that many tokens' time.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

#: A tenant's requests a second, sustained, and at once after a pause (MasterConfig's
#: defaults): well above a robot controller's act rate or a pipelining low-level client's.
DEFAULT_RATE = 100.0
DEFAULT_BURST = 50.0
#: Payload bytes one token pays for beyond the first (a 224 px RGB view is ~150 KB).
BYTES_PER_TOKEN = 256 * 1024
#: Buckets kept before the refilled ones are dropped (a refilled bucket is a new one).
MAX_BUCKETS = 4096


@dataclass
class _Bucket:
    tokens: float
    at: float


@dataclass
class Pacer:
    """Token buckets per tenant; :meth:`reserve` says how long a request must wait."""

    #: Requests a second one tenant is answered at, sustained (0: unpaced).
    rate: float
    #: Requests a tenant may make at once after being idle, without waiting.
    burst: float
    _buckets: dict[str, _Bucket] = field(default_factory=dict)
    #: Requests that had to wait, per tenant (operators see who is paced).
    paced: dict[str, int] = field(default_factory=dict)

    def reserve(self, tenant: str, size: int = 0, now: float | None = None) -> float:
        """Take the tokens of ``tenant``'s next request (of ``size`` payload bytes); the
        seconds until they are due (0: at once)."""
        if self.rate <= 0:
            return 0.0
        now = time.monotonic() if now is None else now
        bucket = self._buckets.get(tenant)
        if bucket is None:
            bucket = self._buckets[tenant] = _Bucket(self.burst, now)
        cost = 1.0 + size / BYTES_PER_TOKEN
        bucket.tokens = min(self.burst, bucket.tokens + (now - bucket.at) * self.rate) - cost
        bucket.at = now
        if len(self._buckets) > MAX_BUCKETS:
            self._forget_full(now)
        if bucket.tokens >= 0:
            return 0.0
        self.paced[tenant] = self.paced.get(tenant, 0) + 1
        return -bucket.tokens / self.rate

    def _forget_full(self, now: float) -> None:
        """Drop buckets that have refilled (bounded memory with many tenants)."""
        for tenant, bucket in list(self._buckets.items()):
            if bucket.tokens + (now - bucket.at) * self.rate >= self.burst:
                del self._buckets[tenant]
