"""Object chunks that belong to no object, swept away.

nats.py's object store writes an object's chunks (``$O.<bucket>.C.<nuid>``) first and its
metadata (``$O.<bucket>.M.<name>``) last; replacing or deleting an object writes the new
metadata, then purges the old chunks. A process killed in between (a trainer SIGKILLed while
it uploads a checkpoint, a master while it stores a pushed dataset) leaves chunks that no
metadata names. Nothing reads them and nothing deletes them: the ``checkpoints`` bucket has no
max age, so each such crash would keep its bytes for good.

A :class:`ChunkSweeper` purges such chunks in two passes and never by a clock it does not
own: a pass notes each orphan's last chunk sequence, and a later pass, at least
``min_age_s`` later on the sweeper's own monotonic clock, purges it only if no chunk was
added since (a put still running adds chunks; its metadata comes after them). Nothing is
purged unless the listing of the bucket's objects holds one entry per metadata subject of its
stream (a listing cut short must not make live objects look orphaned). The master runs a pass
over every object store :data:`FIRST_PASS_AFTER_S` after it starts and then every
:data:`SWEEP_EVERY_S` (``services.master``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable

from nats.errors import Error as NatsError
from nats.js import JetStreamContext
from nats.js.errors import NotFoundError

from bus.kv import object_listing

log = logging.getLogger(__name__)

#: An orphan is purged once it has kept its last chunk at least this long (by the sweeper's
#: clock, across two passes).
ORPHAN_MIN_AGE_S = 15 * 60.0
#: How often the master sweeps every object store, and its first pass after start (a pass
#: only notes what a later one may purge).
SWEEP_EVERY_S = 3600.0
FIRST_PASS_AFTER_S = 300.0
#: Object stores are the streams named ``OBJ_<bucket>``.
OBJECT_STREAM_PREFIX = "OBJ_"
#: Bound on listing one bucket's objects.
LIST_TIMEOUT_S = 60.0
#: Most pages of streams listed (the server answers 256 streams a page).
MAX_STREAM_PAGES = 1000


class ChunkSweeper:
    """Finds and purges orphaned chunks over passes (see the module docstring)."""

    def __init__(
        self,
        js: JetStreamContext,
        min_age_s: float = ORPHAN_MIN_AGE_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.js = js
        self.min_age_s = min_age_s
        self.clock = clock
        #: (bucket, nuid) of an orphan seen → (its last chunk's sequence, when first seen so).
        self.seen: dict[tuple[str, str], tuple[int, float]] = {}

    async def sweep(self, bucket: str, stop: asyncio.Event | None = None) -> list[str]:
        """One pass over ``bucket``: note its orphans, purge those noted long enough ago and
        unchanged since; return the nuids purged."""
        stream = f"{OBJECT_STREAM_PREFIX}{bucket}"
        prefix = f"$O.{bucket}.C."
        info = await self.js.stream_info(stream, subjects_filter=f"{prefix}>")
        chunk_nuids = {s[len(prefix) :] for s in (info.state.subjects or {})}
        live = await live_nuids(self.js, bucket) if chunk_nuids else set()
        if live is None:
            return []
        now = self.clock()
        orphans = chunk_nuids - live
        for key in [k for k in self.seen if k[0] == bucket and k[1] not in orphans]:
            del self.seen[key]
        aged = []
        for nuid in sorted(orphans):
            if stop is not None and stop.is_set():
                return []
            try:
                last = await self.js.get_last_msg(stream, f"{prefix}{nuid}")
            except NotFoundError:
                continue  # purged meanwhile
            seq = last.seq or 0
            noted = self.seen.get((bucket, nuid))
            if noted is None or noted[0] != seq:
                self.seen[(bucket, nuid)] = (seq, now)
            elif now - noted[1] >= self.min_age_s:
                aged.append(nuid)
        if not aged:
            return []
        # Listed again: an object whose put ended since the first listing is not purged.
        again = await live_nuids(self.js, bucket)
        if again is None:
            return []
        purged = []
        for nuid in aged:
            if nuid in again:
                continue
            await self.js.purge_stream(stream, subject=f"{prefix}{nuid}")
            self.seen.pop((bucket, nuid), None)
            purged.append(nuid)
        if purged:
            log.warning(
                "object store %s: purged the chunks of %d objects no metadata names (a put "
                "or delete cut short)",
                bucket,
                len(purged),
            )
        return purged

    async def sweep_all(self, stop: asyncio.Event | None = None) -> int:
        """:meth:`sweep` every object store; returns how many objects' chunks were purged. A
        bucket that cannot be swept now is left for the next pass."""
        total = 0
        for name in await object_buckets(self.js):
            if stop is not None and stop.is_set():
                break
            try:
                total += len(await self.sweep(name, stop))
            except (NatsError, TimeoutError) as exc:
                log.info("object store %s not swept now: %r", name, exc)
        return total


async def live_nuids(js: JetStreamContext, bucket: str) -> set[str] | None:
    """The nuids the bucket's live (not deleted) objects name; None when the listing does not
    hold one entry per metadata subject of the stream (an object put meanwhile, a listing cut
    short, or more metadata subjects than the server lists at once): no purge then."""
    meta = await js.stream_info(
        f"{OBJECT_STREAM_PREFIX}{bucket}", subjects_filter=f"$O.{bucket}.M.>"
    )
    expected = len(meta.state.subjects or {})
    store = await js.object_store(bucket)
    # Entry by entry (nats.py's own list stopped at a damaged entry and timed out, and with
    # it every sweep of the bucket): a damaged entry names no readable object, so the chunks
    # only it could name are garbage like any orphan's.
    listing = await asyncio.wait_for(object_listing(store), LIST_TIMEOUT_S)
    if len(listing.infos) + listing.unreadable != expected:
        log.info(
            "object store %s: %d objects listed, %d in the stream; not swept now",
            bucket,
            len(listing.infos) + listing.unreadable,
            expected,
        )
        return None
    return {o.nuid for o in listing.infos if o.nuid and not o.deleted}


async def object_buckets(js: JetStreamContext) -> list[str]:
    """The names of the server's object stores (every page of its stream list)."""
    names: list[str] = []
    for _ in range(MAX_STREAM_PAGES):
        page = await js.streams_info(offset=len(names))
        if not page:
            break
        names += [info.config.name or "" for info in page]
    return [n[len(OBJECT_STREAM_PREFIX) :] for n in names if n.startswith(OBJECT_STREAM_PREFIX)]


async def sweep_every(
    js: JetStreamContext,
    stop: asyncio.Event,
    every_s: float = SWEEP_EVERY_S,
    first_after_s: float = FIRST_PASS_AFTER_S,
    min_age_s: float = ORPHAN_MIN_AGE_S,
) -> None:
    """Until ``stop``: a pass over every object store ``first_after_s`` after start (out of
    the way of a starting stack) and then every ``every_s``."""
    sweeper = ChunkSweeper(js, min_age_s)
    wait = first_after_s
    while not stop.is_set():
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), wait)
        if stop.is_set():
            return
        try:
            await sweeper.sweep_all(stop)
        except (NatsError, TimeoutError) as exc:
            log.info("object stores not swept now: %r", exc)
        wait = every_s
