"""Listing KV keys without leaving consumers behind.

nats.py's ``KeyValue.keys()`` creates a watcher (an ephemeral consumer) per call; polled in a
loop, those pile up on the server. A KV bucket is a stream ``KV_<bucket>`` whose subjects are
``$KV.<bucket>.<key>``, so the stream's per-subject state lists the live keys in one request.
"""

from __future__ import annotations

from nats.js import JetStreamContext
from nats.js.errors import KeyDeletedError, KeyNotFoundError, NotFoundError


async def kv_keys(js: JetStreamContext, bucket: str, prefix: str = "") -> list[str]:
    """Keys of ``bucket`` (starting with ``prefix``) that hold a message: a value, or the
    marker of a deletion (use :func:`kv_values` for live values)."""
    prefix_subject = f"$KV.{bucket}."
    try:
        info = await js.stream_info(f"KV_{bucket}", subjects_filter=f"{prefix_subject}>")
    except NotFoundError:
        return []
    keys = [s[len(prefix_subject) :] for s in (info.state.subjects or {})]
    return sorted(k for k in keys if k.startswith(prefix))


async def kv_values(js: JetStreamContext, bucket: str, prefix: str = "") -> dict[str, bytes]:
    """Live ``key → value`` of ``bucket`` under ``prefix`` (deleted and purged keys skipped)."""
    kv = await js.key_value(bucket)
    values: dict[str, bytes] = {}
    for key in await kv_keys(js, bucket, prefix):
        try:
            entry = await kv.get(key)
        except (KeyNotFoundError, KeyDeletedError):  # deleted, purged or expired
            continue
        if entry.value:
            values[key] = entry.value
    return values
