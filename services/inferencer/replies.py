"""What the inferencer tells a request's sender: the actions of a served request (then its
ack), or the error it failed with, settled by the consume runtime, whose dead-letter hook
answers the sender with the reason and reports it on the job's ``EVENTS``."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

from nats.aio.msg import Msg
from nats.errors import Error as NatsError
from opentelemetry import trace

from bus import metrics
from bus.codec import DecodeError, decode, encode
from bus.errors import PoisonError
from bus.fate import retry_decision
from bus.publish import msg_id, publish
from bus.service import Runtime
from schemas import subjects
from schemas.events import ErrorEvent
from schemas.infer import INFER_DECODER, ActReply
from schemas.tensor import Tensor
from services.inferencer.admission import answerable, envelope
from services.inferencer.batching import Outcome, Work

log = logging.getLogger(__name__)


@dataclass
class Pending:
    """An admitted request waiting for (or in) a batch; its message is held meanwhile."""

    msg: Msg
    work: Work
    observations: int
    #: Loop time when it was pulled: T counts from here.
    arrived: float
    #: Its admission span, linked from the span of the forward that serves it.
    span: trace.SpanContext


class Replies:
    """Answers and fates of the inferencer's requests, with the counts its gauges report."""

    def __init__(self, rt: Runtime) -> None:
        self.rt = rt
        #: Served policy version of a request being failed after its forward, for the
        #: error reply on_dead sends (keyed by message identity).
        self._failing: dict[int, int] = {}
        self.served = 0
        self.failed = 0
        self.observations = 0
        #: Seconds requests spent here, from their pull to their answer (served ones).
        self.residence_s = 0.0
        self.act_latency = metrics.meter().create_histogram(
            "joynexus.act.latency",
            unit="s",
            description="From an act request's sending to its answer.",
        )

    async def answer(self, pending: Pending, outcome: Outcome) -> None:
        """Reply with the actions and ack, or let the runtime settle the request's error."""
        msg, request, policy = pending.msg, pending.work.request, pending.work.policy
        with self.rt.consumer.span(msg):
            if outcome.error is not None:
                await self._refuse(msg, policy.version, outcome.error)
                return
            assert outcome.actions_B_C_A is not None and outcome.log_prob_B is not None
            reply = ActReply(
                request.request_id,
                policy.version,
                actions=Tensor.from_numpy(outcome.actions_B_C_A),
                log_probs=Tensor.from_numpy(outcome.log_prob_B),
                values=None if outcome.value_B is None else Tensor.from_numpy(outcome.value_B),
                group_size=outcome.group_size,
            )
            data = encode(reply)
            if len(data) > self.rt.nc.max_payload:  # the server would refuse it: say why
                too_big = PoisonError(
                    f"the answer to {pending.observations} observations of {policy.label} has "
                    f"{len(data)} bytes, over the server's max_payload "
                    f"({self.rt.nc.max_payload}): ask for fewer observations at once"
                )
                await self._refuse(msg, policy.version, too_big)
                return
            await self._send(request.reply_to, data)
            if request.sent_at > 0:  # the requester's clock: on one host, the whole wait
                self.act_latency.record(
                    max(0.0, time.time() - request.sent_at), {"joynexus.tenant": request.tenant}
                )
            self.served += 1
            self.observations += pending.observations
            self.residence_s += asyncio.get_running_loop().time() - pending.arrived
            await self.rt.consumer.settle(msg, None)

    async def _refuse(self, msg: Msg, version: int, error: Exception) -> None:
        """Let the runtime settle ``msg`` with ``error`` (its dead letter answers the sender,
        naming the policy ``version`` it was refused by)."""
        self._failing[id(msg)] = version
        try:
            await self.rt.consumer.settle(msg, error)
        finally:
            self._failing.pop(id(msg), None)

    async def reply(self, reply_to: str, reply: ActReply) -> None:
        await self._send(reply_to, encode(reply))

    async def _send(self, reply_to: str, data: bytes) -> None:
        if not answerable(reply_to):
            return  # nobody to tell (the dead letter still records why)
        try:
            await self.rt.nc.publish(reply_to, data)
        except NatsError as exc:  # an invalid inbox must not stop the ack or the service
            log.warning("cannot reply to %r: %s", reply_to, exc)

    async def on_dead(self, msg: Msg, reason: str, error: BaseException) -> None:
        """The durable's dead-letter hook: answer the sender with the reason (so it is not
        left waiting for a timeout) and report it on the job's ``EVENTS`` (non-fatal)."""
        self.failed += 1
        sender = envelope(msg)
        version = self._failing.get(id(msg), 0)
        # Given up on a transient failure, a new request may succeed; a refusal never will.
        # (An error of ours that is no HandlerError, a forward's or a head's, was retried as
        # transient: the sender is told so too.)
        retryable, _ = retry_decision(error, 1)
        answer = ActReply(sender.request_id, version, error=reason, retryable=retryable)
        await self.reply(sender.reply_to, answer)
        try:
            request = decode(INFER_DECODER, msg.data)
            subject = subjects.event(request.tenant, request.job_id, "error")
        except (DecodeError, ValueError):
            return  # no valid tenant/job to address: the dead letter is the record
        event = ErrorEvent(
            request.tenant,
            request.job_id,
            f"inference request {request.request_id}: {reason}",
            retryable=False,
            fatal=False,
            at=time.time(),
        )
        seq = msg.metadata.sequence.stream
        await publish(self.rt.js, subject, event, message_id=msg_id("ev", "infer-dead", seq))
