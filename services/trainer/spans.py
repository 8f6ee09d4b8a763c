"""The trainer's spans, made after the work they time (it runs in a worker thread).

A round serves several tenants' messages at once, so it is a trace of its own: a ``trainer
round`` span linked to every message it applied, with a child per backbone forward (linked to
the messages whose samples it carried) and one for the heads and optimizer. Each message's
part — its tenant's ``train step`` — is a child of the message's own span, in its job's
trace, linked back to the round.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from nats.aio.msg import Msg
from opentelemetry import trace
from opentelemetry.context import Context

from bus import tracing
from schemas.trace import AttributeValue
from vla.grouping import Phase

#: A job's update links to at most this many of the rollouts it learned from (an iteration
#: can have hundreds; the first is its parent).
MAX_LINKS = 64


def trace_round(
    applied: Sequence[tuple[str, Msg, int]],
    results: Mapping[str, object],
    timeline: Sequence[Phase],
    start_ns: int,
    end_ns: int,
) -> None:
    """Spans of one grouped step: ``applied`` is (job key, message, step) of each batch the
    round computed, ``results`` each job's outcome (an exception if its step failed)."""
    links = {key: tracing.link_to(msg.headers) for key, msg, _ in applied}
    samples = sum(p.samples for p in timeline if p.name == "backbone forward")
    round_span = tracing.tracer().start_span(
        "trainer round",
        context=Context(),  # a root: it belongs to no one job's trace
        start_time=start_ns,
        links=[link for link in links.values() if link is not None],
        attributes={
            "messaging.system": "nats",
            "messaging.batch.message_count": len(applied),
            "joynexus.samples": samples,
        },
    )
    inside_round = trace.set_span_in_context(round_span)
    for phase in timeline:
        phase_links = [links[k] for k in phase.tenants if links.get(k) is not None]
        tracing.span_between(
            phase.name,
            phase.start_ns,
            phase.end_ns,
            context=inside_round,
            attributes={
                "joynexus.samples": phase.samples,
                "joynexus.jobs": list(phase.tenants),
                "messaging.batch.message_count": len(phase.tenants),
            },
            links=[link for link in phase_links if link is not None],
        )
    round_span.end(end_time=end_ns)
    back_to_round = [trace.Link(round_span.get_span_context())]
    for key, msg, step in applied:
        tenant, job_id = key.split("/", 1)
        result = results.get(key)
        attributes: dict[str, AttributeValue] = {
            **tracing.job_attributes(tenant, job_id),
            **tracing.messaging_attributes(msg),
            "joynexus.step": step,
        }
        loss = getattr(result, "loss", None)
        if isinstance(loss, float):
            attributes["joynexus.loss"] = loss
        tracing.span_between(
            "train step",
            start_ns,
            end_ns,
            context=tracing.extract(msg.headers),
            attributes=attributes,
            links=back_to_round,
            error=str(result) if isinstance(result, Exception) else None,
        )


def trace_update(
    key: str, msgs: Sequence[Msg], iteration: int, start_ns: int, end_ns: int, error: str | None
) -> None:
    """The span of one RL update, a child of its first rollout's span, linked to the rest."""
    tenant, job_id = key.split("/", 1)
    links = [tracing.link_to(m.headers) for m in msgs[1:MAX_LINKS]]
    tracing.span_between(
        "rl update",
        start_ns,
        end_ns,
        context=tracing.extract(msgs[0].headers) if msgs else None,
        attributes={
            **tracing.job_attributes(tenant, job_id),
            "joynexus.iteration": iteration,
            "messaging.batch.message_count": len(msgs),
        },
        links=[link for link in links if link is not None],
        error=error,
    )
