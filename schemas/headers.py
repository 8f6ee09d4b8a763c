"""Names of the message headers JoyNexus reads or writes (besides W3C trace context, which
:mod:`bus.tracing` carries under the propagator's own names)."""

from __future__ import annotations

#: JetStream's de-duplication id: a publish retried with the same id inside the stream's
#: duplicate window is stored once (DESIGN.md §2: derived from the content's identity).
MSG_ID = "Nats-Msg-Id"

#: The job id of a job command, readable without decoding the payload (the SDK sets it on
#: every command), so even a command whose payload does not decode can be tied to its job.
JOB_ID = "Joynexus-Job-Id"
