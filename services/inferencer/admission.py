"""What the inferencer checks before a request may join a batch, and what it can salvage from
one it cannot serve.

:func:`parse` decodes a pulled message and checks its envelope (reply subject, tenant);
:func:`validate` checks it against the policy that will serve it. Both raise
:class:`~bus.errors.PoisonError` naming the bad field: such a request can never succeed, so
the consume runtime dead-letters it and the service tells its sender (:func:`envelope` says
who and where, even for a payload that is not an ``ActRequest`` at all). Both check the
operator's :class:`~schemas.limits.InputLimits` (message size, observations per request,
views, image side, instruction length, finite proprio) and name the field and the limit.

Requests are accepted only on ``nexus.infer.<backbone>.<tenant>`` and must name that tenant.
Tenants have no publish permission on ``nexus.infer.>`` (the broker enforces it: only the
service identity, i.e. env workers, may publish there), and a request addresses only its own
tenant's policies: the policy is looked up by the request's (subject-checked) tenant.
"""

from __future__ import annotations

import re
import time

import msgspec
from nats.aio.msg import Msg

from bus.codec import DecodeError, decode
from bus.errors import PoisonError
from schemas import subjects
from schemas.ids import InvalidIdError, validate_id
from schemas.infer import INFER_DECODER, ActRequest
from schemas.limits import InputLimits, exceeds, observation_violation
from services.inferencer.policies import ServedPolicy

#: A subject we may publish to: dot-separated non-empty tokens, no whitespace or wildcards
#: (a malformed one would be a protocol error that costs us the connection).
_SUBJECT_RE = re.compile(r"^[^\s.*>]+(\.[^\s.*>]+)*$")


def answerable(reply_to: str) -> bool:
    """Whether ``reply_to`` is a subject we can publish a reply on."""
    return bool(_SUBJECT_RE.fullmatch(reply_to))


class Envelope(msgspec.Struct):
    """What can be salvaged from any request payload to tell its sender why it failed."""

    request_id: str = ""
    reply_to: str = ""


_ENVELOPE_DECODER = msgspec.msgpack.Decoder(Envelope)


def envelope(msg: Msg) -> Envelope:
    """The sender's request id and reply subject, if the payload has them."""
    try:
        return _ENVELOPE_DECODER.decode(msg.data)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return Envelope()


def expired(request: ActRequest, now: float | None = None) -> bool:
    """Whether the requester has stopped waiting: its ``expires_at`` (0: none) has passed."""
    return 0 < request.expires_at < (time.time() if now is None else now)


def parse(msg: Msg, limits: InputLimits | None = None) -> ActRequest:
    """The request in ``msg``; :class:`PoisonError` if it is larger than the limits allow,
    does not decode, cannot be replied to, names another tenant than its subject's or a job
    id that is none, or has more observations than ``max_observations``."""
    limits = limits or InputLimits()
    if len(msg.data) > limits.max_message_bytes:
        raise PoisonError(
            exceeds(
                "act request",
                f"{len(msg.data)} bytes",
                "max_message_bytes",
                limits.max_message_bytes,
            )
        )
    try:
        request = decode(INFER_DECODER, msg.data)
    except DecodeError as exc:
        raise PoisonError(f"malformed act request: {exc}") from exc
    if not answerable(request.reply_to):
        raise PoisonError(f"reply_to {request.reply_to!r} is not a subject to reply on")
    try:
        tenant = subjects.parse_infer(msg.subject).tenant
    except subjects.SubjectError as exc:
        raise PoisonError(f"not an inference request subject: {exc}") from exc
    if request.tenant != tenant:
        raise PoisonError(f"request for tenant {request.tenant!r} on tenant {tenant!r}'s subject")
    try:
        validate_id(request.job_id, "job_id")
    except InvalidIdError as exc:
        raise PoisonError(str(exc)) from exc
    if request.policy_version < 0:
        raise PoisonError(f"policy_version: {request.policy_version} is negative (0 = latest)")
    if len(request.observations) > limits.max_observations:
        raise PoisonError(
            exceeds(
                "observations",
                len(request.observations),
                "max_observations",
                limits.max_observations,
            )
        )
    return request


def validate(request: ActRequest, policy: ServedPolicy, limits: InputLimits | None = None) -> None:
    """Raise :class:`PoisonError` naming the field if ``request`` cannot be served by
    ``policy``: no observations, num_views/token_budget other than the job's, more views than
    ``max_views``, an image that is not uint8 (H, W, 3) or has a side over
    ``max_image_side``, an instruction over ``max_instruction_chars``, a proprio that is not
    finite float32 of the head's ``proprio_dim``."""
    limits = limits or InputLimits()
    spec, head = policy.spec, policy.head
    if not request.observations:
        raise PoisonError("request has no observations")
    if (request.num_views, request.token_budget) != (spec.num_views, spec.token_budget):
        raise PoisonError(
            f"request normalises with num_views={request.num_views}, "
            f"token_budget={request.token_budget} but {policy.label} was trained with "
            f"num_views={spec.num_views}, token_budget={spec.token_budget}"
        )
    for i, obs in enumerate(request.observations):
        violation = observation_violation(f"observations[{i}]", obs, limits)
        if violation is not None:
            raise PoisonError(violation)
        if len(obs.images) > spec.num_views:
            raise PoisonError(
                f"observations[{i}].images: expected 1 to {spec.num_views} views, "
                f"got {len(obs.images)}"
            )
        if tuple(obs.proprio.shape) != (head.proprio_dim,):
            raise PoisonError(
                f"observations[{i}].proprio: {policy.label}'s head expects float32 "
                f"({head.proprio_dim},), got {obs.proprio.dtype} {tuple(obs.proprio.shape)}"
            )
