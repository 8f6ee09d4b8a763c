"""Suspects: requests that were in flight when an inferencer died (:mod:`bus.crashes`).

A suspect is served alone, with nothing else fetched, admitted or batched until it is
answered, and counted only then: a request that kills the process (an out-of-memory
forward, a crash in a kernel) then dies alone, and the requests that shared its batch are
answered instead of dead-lettered beside it.

Its policy is loaded first, one suspect at a time, uncounted, while the other jobs'
requests are pulled and served: after a restart every policy is cold, and a suspect's load
would otherwise hold up every other job's requests on the replica for as long as it takes
(up to ``--checkpoint-read-s``). The load is marked in the crash ledger, so that a load
that never returned (it killed the process) is not tried beside others again: that suspect
loads its policy inside its counted run alone.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from nats.aio.msg import Msg

from bus.crashes import CrashLedger
from bus.errors import Interrupted, PoisonError
from schemas.limits import InputLimits
from services.inferencer.admission import expired, parse
from services.inferencer.policies import PolicyCache

log = logging.getLogger(__name__)

Policy = tuple[str, str, int]
"""A policy: (tenant, job id, version)."""


class Suspects:
    """The suspects an inferencer's fetch loop has found, in turn: one's policy loading
    beside the other work, then that one run alone. ``on_loaded`` is called when a load
    ends (the fetch loop may be waiting for room)."""

    def __init__(
        self,
        ledger: CrashLedger,
        policies: PolicyCache,
        limit: InputLimits,
        on_loaded: Callable[[], None],
    ) -> None:
        self.ledger = ledger
        self.policies = policies
        self.limit = limit
        self.on_loaded = on_loaded
        self.waiting: list[Msg] = []
        self._warming: tuple[Msg, asyncio.Task[None]] | None = None
        #: A suspect whose policy is loaded: the next to run alone.
        self._loaded: Msg | None = None
        #: A suspect's run alone is under way.
        self._alone = False

    def add(self, found: list[Msg]) -> None:
        """Suspects a pull found, served after those found before."""
        self.waiting += found

    def advance(self) -> None:
        """Start loading the next suspect's policy, or take the one whose load ended."""
        if self._warming is None and self._loaded is None and not self._alone and self.waiting:
            suspect = self.waiting.pop(0)
            cold = self._cold(suspect)
            if cold is None:
                self._loaded = suspect
            else:
                warm = asyncio.create_task(self._warm(suspect, cold))
                warm.add_done_callback(lambda _: self.on_loaded())
                self._warming = (suspect, warm)
        if self._warming is not None and self._warming[1].done():
            suspect, warm = self._warming
            self._warming = None
            if not warm.cancelled() and warm.exception() is not None:
                # Its load is done inside its run alone instead.
                log.warning("loading a suspect's policy failed: %r", warm.exception())
            self._loaded = suspect

    @property
    def exclusive(self) -> bool:
        """A suspect is to run alone, or runs alone: nothing else may be pulled or started
        until everything in flight has ended."""
        return self._loaded is not None or self._alone

    def next_alone(self) -> Msg | None:
        """With nothing else in flight (the last suspect's run alone is over): the suspect
        to run alone now, if its policy is loaded; call :meth:`running_alone` once it is
        started."""
        self._alone = False
        suspect, self._loaded = self._loaded, None
        return suspect

    def running_alone(self) -> None:
        """The suspect :meth:`next_alone` gave is started: nothing else starts until it ends."""
        self._alone = True

    async def close(self, grace_s: float) -> list[Msg]:
        """Stopping: the suspects not yet run, to hand back. A load under way is not
        cancelled: it gives up once stopping (``Interrupted``) and clears its mark when it
        returns; it is waited for up to ``grace_s``."""
        left = list(self.waiting)
        self.waiting.clear()
        if self._warming is not None:
            suspect, warm = self._warming
            self._warming = None
            await asyncio.wait({warm}, timeout=grace_s)
            left.append(suspect)
        if self._loaded is not None:
            left.append(self._loaded)
            self._loaded = None
        return left

    def _cold(self, suspect: Msg) -> Policy | None:
        """The policy ``suspect`` asks for, if it must be loaded before the suspect runs
        alone; None if it is resident, or the suspect is malformed or expired (its
        admission settles it at once)."""
        try:
            request = parse(suspect, self.limit)
        except PoisonError:
            return None
        policy = (request.tenant, request.job_id, request.policy_version)
        if expired(request) or self.policies.resident(*policy) is not None:
            return None
        return policy

    async def _warm(self, suspect: Msg, policy: Policy) -> None:
        """Load ``policy``, which ``suspect`` asks for, while other requests are served. The
        suspect is not counted for it (a crash of another request meanwhile must not climb
        its count), but the load is marked in the crash ledger: a load that never returned
        is not tried beside others again, and the suspect loads it inside its counted run
        alone. What the load raises is left to the suspect's own admission, which resolves
        the policy again and settles it."""
        if not await self.ledger.begin_preparing(suspect):
            return
        try:
            await self.policies.resolve(*policy)
        except Interrupted:
            pass  # stopping: the suspect is handed back
        except Exception as exc:  # noqa: BLE001 - not its fate: its admission meets it again
            log.info("loading the policy of suspect %s/%s failed: %r", *policy[:2], exc)
        finally:
            await self.ledger.end_preparing(suspect)
