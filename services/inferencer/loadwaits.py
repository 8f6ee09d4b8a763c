"""The bounded places where admissions wait for their policy's load.

A request whose policy is not resident waits for its load (a checkpoint read) without
taking a place in the pull room: one job's slow load must not stop the pulls of every other
job. The places to wait beyond the room are bounded: :data:`LOAD_WAITERS_PER_PLACE` per
place in the room for all jobs, of which the last :data:`LOAD_WAITERS_KEPT_PER_PLACE` per
place are kept for other jobs (each job taking at most half of those left). A request past
either bound is turned away with :class:`LoadBusy`: it comes back after
:data:`LOAD_BUSY_DELAY_S`, and at its last delivery it is answered "ask again".
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager

from bus.errors import RetryableError

#: Admissions that may wait on a policy load (a read or a checkpoint) beyond the pull room,
#: per place in it: a job whose policy loads slowly holds these, not the room other jobs'
#: requests are pulled through.
LOAD_WAITERS_PER_PLACE = 4
#: Of those, this many per place are kept for other jobs, each job taking at most half of
#: those left: a job flooding requests at a policy that loads slowly takes the others but
#: not these (and without any bound it would take every place: then nothing more would be
#: pulled, and the other jobs' requests would wait for its load too).
LOAD_WAITERS_KEPT_PER_PLACE = 1
#: A request turned away because the places to wait for loads are taken comes back this
#: much later (and is answered "ask again" at its last delivery).
LOAD_BUSY_DELAY_S = 1.0


class LoadBusy(RetryableError):
    """The request's policy is not loaded here and the places to wait for loads are taken
    (to it): it comes back later; at its last delivery it is answered "ask again"
    (retryable)."""


class LoadWaits:
    """The places to wait for policy loads of an inferencer whose pull room holds ``room``
    requests, and who holds them."""

    def __init__(self, room: int) -> None:
        self.most = room * LOAD_WAITERS_PER_PLACE
        #: Of those, how many are kept for other jobs (each job taking at most half of those
        #: left).
        self.kept_for_others = room * LOAD_WAITERS_KEPT_PER_PLACE
        #: Admissions waiting for a load now, in all and per (tenant, job).
        self.waiting = 0
        self.per_job: Counter[tuple[str, str]] = Counter()
        #: Requests turned away (to come back later) because the places were taken (to them).
        self.turned_away = 0

    @contextmanager
    def place(self, tenant: str, job_id: str) -> Iterator[None]:
        """Hold a place for one admission of ``tenant``'s job ``job_id`` while it waits for
        its policy's load; :class:`LoadBusy` if there is none for it."""
        job = (tenant, job_id)
        free = self.most - self.waiting
        waiting = self.per_job[job]
        busy = ""
        if free <= 0:
            busy = f"{self.waiting} requests already wait for policy loads here, the most"
        elif free <= self.kept_for_others and waiting >= max(1, free // 2):
            # The last places are kept for other jobs' loads, each job taking at most half
            # of those left (while more are free, a large job's cold start may use them):
            # neither one flood nor two take them all.
            busy = (
                f"{waiting} of its requests already wait for it here, and the places left "
                "are kept for other jobs"
            )
        if busy:
            self.turned_away += 1
            raise LoadBusy(
                f"the policy of {tenant}/{job_id} is not loaded here and {busy}; ask again shortly",
                delay_s=LOAD_BUSY_DELAY_S,
            )
        self.waiting += 1
        self.per_job[job] += 1
        try:
            yield
        finally:
            self.waiting -= 1
            self.per_job[job] -= 1
            if not self.per_job[job]:
                del self.per_job[job]
