"""TRAIN messages too large for one NATS message travel by reference (DESIGN.md §2).

An env worker's episode of many steps or views, or an SFT batch of large images, can be over
the server's ``max_payload`` (1 MiB by default). :func:`publish_train` then stores the
message's bytes in the :data:`~schemas.subjects.OBJ_PAYLOADS` object store under a name of its
own, ``train/<tenant>/<job>/<uuid>``, and publishes a :class:`~schemas.train.PayloadRef` in
its place with the same message id and headers. A retried publish that the stream drops as a
duplicate deletes the object it stored (the message kept names another one). Every message
has an object of its own, so a message re-published after the duplicate window (a replay
the trainer acknowledges as already applied) never loses its object to the first one's
deletion.

The trainer resolves a reference with :func:`fetch_train` (size and digest checked, the
object must be under its tenant's and job's prefix) and deletes the object with
:func:`discard` once the message it stood for is acknowledged. An object nobody consumes (a
sender that died between storing and publishing, a message dead-lettered: kept for an
operator to read) goes after the bucket's max age
(:attr:`bus.declare.BusLayout.payloads_max_age_s`).
"""

from __future__ import annotations

import hashlib
import logging
import uuid

from nats.errors import Error as NatsError
from nats.js import JetStreamContext
from nats.js.api import PubAck
from nats.js.errors import (
    BadObjectMetaError,
    DigestMismatchError,
    NotFoundError,
    ObjectNotFoundError,
)

from bus.codec import encode
from bus.errors import PoisonError, RetryableError
from bus.kv import ObjectGoneError, ReferenceMismatchError, read_referenced
from bus.publish import check_payload, headers_for, wire_size
from schemas import subjects
from schemas.limits import exceeds
from schemas.train import PayloadRef, RolloutBatch, SFTBatch

__all__ = [
    "LargeTrainMessage",
    "PayloadGoneError",
    "discard",
    "fetch_train",
    "object_prefix",
    "publish_train",
]

log = logging.getLogger(__name__)

#: The TRAIN messages that may travel by reference (the ones whose size grows with a tenant's
#: data: images of a batch or an episode).
LargeTrainMessage = SFTBatch | RolloutBatch


class PayloadGoneError(PoisonError):
    """A reference whose object is no longer stored: deleted after its message was
    acknowledged (this is a redelivery of it), or expired."""


def object_prefix(tenant: str, job_id: str) -> str:
    """Where the payloads of ``tenant``'s job ``job_id`` are stored."""
    return f"train/{tenant}/{job_id}/"


def _tag(message: LargeTrainMessage) -> str:
    return str(type(message).__struct_config__.tag)


async def publish_train(
    js: JetStreamContext,
    subject: str,
    message: LargeTrainMessage,
    *,
    message_id: str,
    headers: dict[str, str] | None = None,
    max_bytes: int,
    timeout: float = 5.0,
) -> PubAck:
    """Publish ``message`` on its TRAIN ``subject``: inline when it fits the server's
    ``max_payload`` with its headers, else stored and sent as a :class:`PayloadRef`.

    ``max_bytes`` is the largest message the trainer accepts (the operator's
    ``max_message_bytes``): a bigger one is refused here (:class:`PoisonError` naming its
    size) before anything is stored, so its sender learns why instead of the trainer."""
    data, sent_headers = encode(message), headers_for(message_id, headers)
    what = f"{_tag(message)} of job {message.job_id!r}"
    if len(data) > max_bytes:
        raise PoisonError(exceeds(what, f"{len(data)} bytes", "max_message_bytes", max_bytes))
    max_payload = js._nc.max_payload
    if wire_size(data, sent_headers) > max_payload:
        sha = hashlib.sha256(data).hexdigest()
        name = object_prefix(message.tenant, message.job_id) + uuid.uuid4().hex
        store = await js.object_store(subjects.OBJ_PAYLOADS)
        await store.put(name, data)
        step = message.step if isinstance(message, SFTBatch) else message.iteration
        ref = PayloadRef(
            message.tenant, message.job_id, _tag(message), name, len(data), sha, step=step
        )
        data = encode(ref)
        check_payload(max_payload, data, sent_headers, f"a reference to {what}")
        ack = await js.publish(subject, data, timeout=timeout, headers=sent_headers)
        if ack.duplicate:  # the stream kept an earlier publish, which names its own object
            await discard(js, ref)
        return ack
    return await js.publish(subject, data, timeout=timeout, headers=sent_headers)


async def fetch_train(js: JetStreamContext, ref: PayloadRef, max_bytes: int) -> bytes:
    """The stored bytes ``ref`` names, checked against its size and digest.

    Raises :class:`PayloadGoneError` for an object no longer stored, :class:`PoisonError` for
    a reference that can never be honoured (an object name that is not its tenant's and
    job's, a size over ``max_bytes``, an object damaged or not the one referenced) and
    :class:`RetryableError` when the broker does not answer."""
    if not ref.object_name.startswith(object_prefix(ref.tenant, ref.job_id)):
        raise PoisonError(
            f"object_name: {ref.object_name!r} is not where tenant {ref.tenant!r}'s job "
            f"{ref.job_id!r} stores its payloads"
        )
    if ref.size > max_bytes:
        size = f"{ref.size} bytes"
        raise PoisonError(exceeds(f"referenced {ref.kind}", size, "max_message_bytes", max_bytes))
    try:
        return await read_referenced(
            js, subjects.OBJ_PAYLOADS, ref.object_name, ref.size, ref.sha256
        )
    except ObjectGoneError as exc:
        raise PayloadGoneError(
            f"payload {exc} (kept until its message is acknowledged, at most the bucket's max age)"
        ) from exc
    except ReferenceMismatchError as exc:
        raise PoisonError(f"payload {exc}") from exc
    except (DigestMismatchError, BadObjectMetaError) as exc:
        raise PoisonError(f"payload object {ref.object_name} is damaged: {exc!r}") from exc
    except (NatsError, TimeoutError) as exc:
        raise RetryableError(f"reading payload object {ref.object_name}: {exc!r}") from exc


async def discard(js: JetStreamContext, ref: PayloadRef) -> None:
    """Delete ``ref``'s object (its message is acknowledged). A failure only leaves the
    object to the bucket's max age."""
    try:
        store = await js.object_store(subjects.OBJ_PAYLOADS)
        await store.delete(ref.object_name)
    except (NatsError, TimeoutError, ObjectNotFoundError, NotFoundError) as exc:
        log.info("payload object %s not deleted (%r); its max age removes it", ref.object_name, exc)
