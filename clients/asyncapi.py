"""The tenant-facing wire contract as an AsyncAPI 3.0 document, generated from ``schemas/``.

``python -m clients.asyncapi > docs/asyncapi.yaml`` writes it; ``tests/test_asyncapi.py``
fails when the committed document and the schemas drift apart. Payload schemas come from the
msgspec Structs themselves (:func:`msgspec.json.schema_components`), the job spec document from
its pydantic models, stream settings from :class:`bus.declare.BusLayout` — nothing here
restates a field by hand. ``docs/wire.md`` is the prose beside it (encoding, ids,
idempotency, following a job, dead letters, retention).

Operations are written from the tenant's side: ``send`` is what a tenant publishes,
``receive`` what it gets.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Any

import msgspec
import yaml
from pydantic import TypeAdapter

from bus.declare import BusLayout
from schemas import subjects
from schemas.envdesc import DescribeEnv, DescribeReply
from schemas.events import Event
from schemas.health import HEALTH_SUBJECT, HealthReport
from schemas.specs import JobSpec
from schemas.tenants import DatasetManifest

VERSION = "0.1.0"
REF = "#/components/schemas/{name}"


@dataclass(frozen=True)
class Channel:
    """One subject family as a tenant sees it."""

    key: str
    address: str
    description: str
    #: Message name → the msgspec type of its payload (a tagged union is one message per tag).
    messages: dict[str, Any]
    #: ``send`` (the tenant publishes) or ``receive``.
    action: str
    parameters: dict[str, dict[str, Any]] = field(default_factory=dict)
    #: For a request: its reply's message name → payload type (sent to the request's inbox).
    replies: dict[str, Any] = field(default_factory=dict)
    #: JetStream stream the subject is stored in, or "" for core NATS request-reply.
    stream: str = ""
    headers: tuple[str, ...] = ()
    #: Messages whose payload is not a Struct: name → (content type, inline JSON schema).
    raw: dict[str, tuple[str, dict[str, Any]]] = field(default_factory=dict)


TENANT = {
    "description": "Tenant id: [a-z0-9][a-z0-9-]{0,63}; the broker lets a tenant use only its own."
}
JOB = {"description": "Job id, chosen by the client: [a-z0-9][a-z0-9-]{0,63}."}


def _tagged(union: Any) -> dict[str, Any]:
    """One message per member of a tagged union, named by the member's class."""
    members = getattr(union, "__args__", (union,))
    return {m.__name__: m for m in members}


def channels() -> list[Channel]:
    """Every subject a tenant publishes to or receives from. A tenant has no JetStream
    (:mod:`schemas.tenantctl` says why): everything it does is a core NATS request answered
    on its own inbox prefix ``_INBOX_{tenant}``."""
    from schemas import tenantctl

    event_kinds = sorted(m.__struct_config__.tag for m in Event.__args__)
    return [
        Channel(
            "tenantRequests",
            "nexus.ctl.tenant.{tenant}.{op}",
            "Core NATS request-reply, answered by the master on the requester's own inbox "
            "(`_INBOX_{tenant}.>`; a reply subject anywhere else gets no answer). The request's "
            "tag equals {op} and its `tenant` equals {tenant}. `submit` / `cancel` queue a job "
            "command (`SubmitJob.spec_json` is a JSON job spec document, "
            "components.schemas.JobSpecDocument; a bad spec is answered by a `rejected` event); "
            "`events` pages through a job's events by stream sequence; `dataset-plan`, "
            "`dataset-part` and `dataset-add` push a dataset in parts of at most "
            f"{tenantctl.PART_BYTES} bytes; `dataset-rm` removes one (refused while a job "
            "that has not ended names it); `export` then `export-read` download a policy, "
            "`export-rm` deletes the copies exports leave; "
            "`job-rm` removes a job that has ended with its versions and events.",
            _tagged(tenantctl.TenantRequest),
            "send",
            {"tenant": TENANT, "op": {"enum": list(subjects.TENANT_CTL_OPS)}},
            replies=_tagged(tenantctl.TenantReply),
        ),
        Channel(
            "jobEvents",
            "nexus.event.{tenant}.{job}.{kind}",
            "What happens to a job, live (core NATS subscribe; the tenant may subscribe to "
            "`nexus.event.{tenant}.>`). Events published while a subscriber was away are "
            "not resent: read the job's history, in order and each once, with the `events` "
            "request, and use the live subject only to learn when to ask. The message's tag "
            "equals {kind}.",
            _tagged(Event),
            "receive",
            {"tenant": TENANT, "job": JOB, "kind": {"enum": event_kinds}},
            headers=("traceparent",),
        ),
        Channel(
            "envDescribe",
            "nexus.envinfo.describe.{tenant}",
            "Core NATS request-reply: what an env looks like to a head (action space, proprio "
            "layout, cameras, episode limit). One env worker answers, on the requester's own "
            "inbox only.",
            {"DescribeEnv": DescribeEnv},
            "send",
            {"tenant": TENANT},
            replies={"DescribeReply": DescribeReply},
        ),
        Channel(
            "backbones",
            "nexus.ctl.backbones.{tenant}",
            "Core NATS request-reply: the backbones served now (answered on the requester's own "
            "inbox only).",
            {"BackbonesQuery": tenantctl.BackbonesQuery},
            "send",
            {"tenant": TENANT},
            replies=_tagged(tenantctl.BackbonesReply),
        ),
        Channel(
            "health",
            HEALTH_SUBJECT,
            "Core NATS request-reply with an empty payload: the health manager's view of every "
            "role instance (operators only).",
            {},
            "send",
            replies={"HealthReport": HealthReport},
        ),
    ]


def _fix_schema(node: Any) -> Any:
    """msgspec writes OpenAPI's discriminator object and base64 for bytes (its JSON view);
    on this wire bytes are msgpack ``bin`` and AsyncAPI's discriminator is a property name."""
    if isinstance(node, dict):
        out = {k: _fix_schema(v) for k, v in node.items()}
        if isinstance(out.get("discriminator"), dict):
            out["x-discriminator-mapping"] = out["discriminator"].get("mapping", {})
            out["discriminator"] = out["discriminator"]["propertyName"]
        if out.get("contentEncoding") == "base64":
            del out["contentEncoding"]
            out["format"] = "binary"
            out["description"] = (out.get("description", "") + " (msgpack bin)").strip()
        return out
    if isinstance(node, list):
        return [_fix_schema(v) for v in node]
    return node


def _stream_notes(layout: BusLayout) -> dict[str, dict[str, Any]]:
    notes = {}
    for cfg in layout.streams():
        assert cfg.name is not None
        notes[cfg.name] = {
            "subjects": list(cfg.subjects or []),
            "retention": str(cfg.retention.value if cfg.retention else ""),
            "max_age_s": cfg.max_age,
            "duplicate_window_s": cfg.duplicate_window,
        }
    return notes


def document() -> dict[str, Any]:
    """The AsyncAPI 3.0 document, as plain data."""
    chans = channels()
    types: dict[str, Any] = {}
    for ch in chans:
        types.update(ch.messages)
        types.update(ch.replies)
    types["DatasetManifest"] = DatasetManifest
    _, components = msgspec.json.schema_components(list(types.values()), ref_template=REF)
    schemas: dict[str, Any] = {k: _fix_schema(v) for k, v in sorted(components.items())}
    spec_schema = TypeAdapter(JobSpec).json_schema(ref_template="#/components/schemas/{model}")
    for name, sub in sorted(spec_schema.pop("$defs", {}).items()):
        schemas.setdefault(name, sub)
    schemas["JobSpecDocument"] = spec_schema

    header_schemas = {
        "traceparent": "W3C trace context; each service continues the trace.",
    }
    messages: dict[str, Any] = {}
    channel_docs: dict[str, Any] = {}
    operations: dict[str, Any] = {}
    for ch in chans:
        msg_refs = {}
        for name in ch.messages:
            message: dict[str, Any] = {
                "name": name,
                "contentType": "application/msgpack",
                "payload": {"$ref": REF.format(name=name)},
            }
            if ch.headers:
                message["headers"] = {
                    "type": "object",
                    "properties": {
                        h: {"type": "string", "description": header_schemas[h]} for h in ch.headers
                    },
                }
            messages[name] = message
            msg_refs[name] = {"$ref": f"#/components/messages/{name}"}
        for name, (content_type, payload) in ch.raw.items():
            messages[name] = {"name": name, "contentType": content_type, "payload": payload}
            msg_refs[name] = {"$ref": f"#/components/messages/{name}"}
        if not ch.messages and not ch.raw:  # an empty request
            messages[f"{ch.key}Request"] = {
                "name": f"{ch.key}Request",
                "payload": {"type": "string", "maxLength": 0, "description": "empty"},
            }
            msg_refs[f"{ch.key}Request"] = {"$ref": f"#/components/messages/{ch.key}Request"}
        doc: dict[str, Any] = {
            "address": ch.address,
            "description": ch.description,
            "messages": msg_refs,
        }
        if ch.parameters:
            doc["parameters"] = ch.parameters
        if ch.stream:
            doc["x-jetstream-stream"] = ch.stream
        channel_docs[ch.key] = doc
        op: dict[str, Any] = {
            "action": ch.action,
            "channel": {"$ref": f"#/channels/{ch.key}"},
            "messages": [{"$ref": f"#/channels/{ch.key}/messages/{m}"} for m in msg_refs],
        }
        if ch.replies:
            reply_key = f"{ch.key}Reply"
            for name in ch.replies:
                messages[name] = {
                    "name": name,
                    "contentType": "application/msgpack",
                    "payload": {"$ref": REF.format(name=name)},
                }
            channel_docs[reply_key] = {
                "address": None,
                "description": f"The reply to a {ch.key} request, on the requester's inbox.",
                "messages": {n: {"$ref": f"#/components/messages/{n}"} for n in ch.replies},
            }
            op["reply"] = {
                "channel": {"$ref": f"#/channels/{reply_key}"},
                "messages": [{"$ref": f"#/channels/{reply_key}/messages/{n}"} for n in ch.replies],
            }
        operations[f"{ch.action}{ch.key[0].upper()}{ch.key[1:]}"] = op

    return {
        "asyncapi": "3.0.0",
        "info": {
            "title": "JoyNexus tenant wire contract",
            "version": VERSION,
            "description": "Every subject a tenant publishes to or receives from. Payloads are "
            "msgpack maps of the schemas below; a tagged union's member is named by its `type` "
            "field. See docs/wire.md for encoding, ids, idempotency and retention. Generated "
            "by `python -m clients.asyncapi`; do not edit by hand.",
        },
        "defaultContentType": "application/msgpack",
        "servers": {
            "local": {
                "host": "127.0.0.1:4222",
                "protocol": "nats",
                "description": "`joynexus up`'s embedded server (its port is in stack.json).",
            }
        },
        "channels": channel_docs,
        "operations": operations,
        "components": {
            "messages": dict(sorted(messages.items())),
            "schemas": schemas,
        },
        "x-jetstream-streams": _stream_notes(BusLayout()),
    }


class _Dumper(yaml.SafeDumper):
    def ignore_aliases(self, data: Any) -> bool:
        return True  # a reader should not need YAML anchors to read a parameter


def render() -> str:
    """The document as YAML (stable key order, so a diff shows only real changes)."""
    return yaml.dump(document(), Dumper=_Dumper, sort_keys=False, allow_unicode=True, width=100)


def main() -> int:
    sys.stdout.write(render())
    return 0


if __name__ == "__main__":
    sys.exit(main())
