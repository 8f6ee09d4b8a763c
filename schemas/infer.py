"""The Inference Queue ``nexus.infer.<backbone>.<tenant>`` (stream INFER).

A requester (an env worker) publishes an :class:`ActRequest` into the work queue with its own
inbox in ``reply_to``; any inferencer replica pulls it, groups it with compatible requests of
other tenants, and answers with an :class:`ActReply` on ``reply_to`` (core NATS). A request
that cannot be served (unknown policy, bad shapes) is answered with ``error`` set, and
dead-lettered.
"""

from __future__ import annotations

import msgspec

from schemas.model import Observation
from schemas.tensor import Tensor


class ActRequest(msgspec.Struct, frozen=True, tag="act"):
    """Actions for ``observations`` (one per env session) from a tenant job's policy."""

    tenant: str
    job_id: str
    request_id: str
    reply_to: str
    observations: list[Observation]
    #: Policy version to use; 0 = the latest committed one.
    policy_version: int = 0
    #: Mean / argmax actions instead of samples (evaluation).
    deterministic: bool = False
    #: Draw the sampling noise from this seed (reproducible rollouts); -1 = the serving
    #: slot's own generator.
    seed: int = -1
    #: Compatibility: the normalised model inputs of this request.
    num_views: int = 1
    token_budget: int = 16
    sent_at: float = 0.0
    #: Unix time after which the requester no longer waits for the answer (0: no deadline).
    #: An inferencer that takes the request later drops it unanswered instead of spending a
    #: forward on it (hosts' clocks are assumed to agree to well under the timeout).
    expires_at: float = 0.0
    #: The job's weight (its tenant's priority class times its own priority, set by the
    #: master in the job's tasks): when more observations wait than fit a batch, the
    #: inferencer shares the batch between tenants in proportion to it.
    priority: int = 1


class ActReply(msgspec.Struct, frozen=True):
    """Shapes: ``actions`` float32 (B, C, A); ``log_probs`` float32 (B,); ``values`` float32
    (B,) when the policy has a value head, else None."""

    request_id: str
    policy_version: int
    actions: Tensor | None = None
    log_probs: Tensor | None = None
    values: Tensor | None = None
    error: str = ""
    #: Requests that shared this reply's backbone forward (observability of grouping).
    group_size: int = 1
    #: With ``error``: whether asking again (a new request) may succeed (the inferencer gave
    #: up on a transient failure, e.g. its checkpoint store away); False for a refusal.
    retryable: bool = False


INFER_DECODER = msgspec.msgpack.Decoder(ActRequest)
ACT_REPLY_DECODER = msgspec.msgpack.Decoder(ActReply)
