"""Object chunks that belong to no object, swept away.

nats.py's object store writes an object's chunks (``$O.<bucket>.C.<nuid>``) first and its
metadata (``$O.<bucket>.M.<name>``) last; replacing or deleting an object writes the new
metadata, then purges the old chunks. A process killed in between (a trainer SIGKILLed while
it uploads a checkpoint, a master while it stores a pushed dataset) leaves chunks that no
metadata names. Nothing reads them and nothing deletes them: the ``checkpoints`` bucket has no
max age, so each such crash would keep its bytes for good.

:func:`sweep_orphan_chunks` purges, in one bucket, the chunk subjects whose nuid no live
object names and whose last chunk is older than ``min_age_s`` (a put still running writes
chunks every moment, and its metadata comes after them). :func:`sweep_all` does it for every
object store of the server; the master runs it at start and then every
:data:`SWEEP_EVERY_S` (``services.master``).
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import logging

from nats.errors import Error as NatsError
from nats.js import JetStreamContext
from nats.js.errors import NotFoundError

log = logging.getLogger(__name__)

#: Chunks younger than this may belong to a put still running: kept.
ORPHAN_MIN_AGE_S = 15 * 60.0
#: How often the master sweeps every object store.
SWEEP_EVERY_S = 3600.0
#: Object stores are the streams named ``OBJ_<bucket>``.
OBJECT_STREAM_PREFIX = "OBJ_"


async def sweep_orphan_chunks(
    js: JetStreamContext, bucket: str, min_age_s: float = ORPHAN_MIN_AGE_S
) -> list[str]:
    """Purge ``bucket``'s chunks that no live object names and that are older than
    ``min_age_s``; return the nuids purged. Nothing is purged unless the listing of the
    bucket's objects holds every object metadata the stream holds (a partial listing would
    make live objects look like orphans)."""
    stream = f"{OBJECT_STREAM_PREFIX}{bucket}"
    prefix = f"$O.{bucket}.C."
    info = await js.stream_info(stream, subjects_filter=f"{prefix}>")
    chunk_nuids = {s[len(prefix) :] for s in (info.state.subjects or {})}
    if not chunk_nuids:
        return []
    live = await _live_nuids(js, bucket)
    if live is None:
        return []
    now = dt.datetime.now(dt.UTC)
    purged = []
    for nuid in sorted(chunk_nuids - live):
        subject = f"{prefix}{nuid}"
        try:
            last = await js.get_last_msg(stream, subject)
        except NotFoundError:
            continue  # purged meanwhile
        if last.time is not None and (now - last.time).total_seconds() < min_age_s:
            continue
        # Listed again: an object whose put ended since the listing is not purged.
        again = await _live_nuids(js, bucket)
        if again is None or nuid in again:
            continue
        await js.purge_stream(stream, subject=subject)
        purged.append(nuid)
    if purged:
        log.warning(
            "object store %s: purged the chunks of %d objects no metadata names (a put or "
            "delete cut short)",
            bucket,
            len(purged),
        )
    return purged


async def _live_nuids(js: JetStreamContext, bucket: str) -> set[str] | None:
    """The nuids the bucket's live (not deleted) objects name; None when the listing does not
    hold one entry per metadata subject of the stream (an object put meanwhile, or a listing
    cut short): no sweep then."""
    meta = await js.stream_info(
        f"{OBJECT_STREAM_PREFIX}{bucket}", subjects_filter=f"$O.{bucket}.M.>"
    )
    expected = len(meta.state.subjects or {})
    store = await js.object_store(bucket)
    try:
        objects = await store.list()
    except NotFoundError:  # nats.py: no entries at all
        objects = []
    if len(objects) != expected:
        log.info(
            "object store %s: %d objects listed, %d in the stream; not swept now",
            bucket,
            len(objects),
            expected,
        )
        return None
    return {o.nuid for o in objects if o.nuid and not o.deleted}


async def sweep_all(js: JetStreamContext, min_age_s: float = ORPHAN_MIN_AGE_S) -> int:
    """:func:`sweep_orphan_chunks` in every object store; returns how many objects' chunks
    were purged. A bucket that cannot be swept now is left for the next sweep."""
    total = 0
    for name in await object_buckets(js):
        try:
            total += len(await sweep_orphan_chunks(js, name, min_age_s))
        except (NatsError, TimeoutError) as exc:
            log.info("object store %s not swept now: %r", name, exc)
    return total


#: Most pages of streams listed (the server answers 256 streams a page).
MAX_STREAM_PAGES = 1000


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
    js: JetStreamContext, stop: asyncio.Event, every_s: float = SWEEP_EVERY_S
) -> None:
    """Until ``stop``: :func:`sweep_all` now and then every ``every_s``."""
    while not stop.is_set():
        try:
            await sweep_all(js)
        except (NatsError, TimeoutError) as exc:
            log.info("object stores not swept now: %r", exc)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), every_s)
