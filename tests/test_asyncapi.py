"""The committed wire contract (docs/asyncapi.yaml) is what the schemas generate, and real
encoded messages validate against it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jsonschema
import msgspec
import pytest
import yaml

from clients.asyncapi import channels, document, render
from schemas.events import Event

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "asyncapi.yaml"
GOLDEN = ROOT / "tests" / "golden"


def test_committed_document_matches_the_schemas() -> None:
    committed = DOC.read_text()
    assert committed == render(), (
        "docs/asyncapi.yaml is out of date with schemas/: regenerate it with "
        "`python -m clients.asyncapi > docs/asyncapi.yaml` and review the diff"
    )


def _refs(node: Any) -> list[str]:
    if isinstance(node, dict):
        found = [node["$ref"]] if isinstance(node.get("$ref"), str) else []
        return found + [r for v in node.values() for r in _refs(v)]
    if isinstance(node, list):
        return [r for v in node for r in _refs(v)]
    return []


def _resolve(doc: dict[str, Any], ref: str) -> Any:
    assert ref.startswith("#/"), ref
    node: Any = doc
    for part in ref[2:].split("/"):
        assert isinstance(node, dict) and part in node, f"unresolved $ref {ref}"
        node = node[part]
    return node


def test_every_reference_resolves_and_every_operation_names_its_channel() -> None:
    doc = yaml.safe_load(DOC.read_text())
    assert doc["asyncapi"] == "3.0.0"
    for ref in _refs(doc):
        _resolve(doc, ref)
    for name, op in doc["operations"].items():
        assert op["action"] in ("send", "receive"), name
        _resolve(doc, op["channel"]["$ref"])
        for message in op["messages"]:
            assert message["$ref"].startswith(op["channel"]["$ref"] + "/messages/"), name


def test_every_event_kind_and_tenant_request_has_a_message() -> None:
    from schemas.tenantctl import TenantReply, TenantRequest

    doc = document()
    names = set(doc["components"]["messages"])
    for member in (*Event.__args__, *TenantRequest.__args__, *TenantReply.__args__):
        assert member.__name__ in names
    keys = {ch.key for ch in channels()}
    assert keys == {"tenantRequests", "jobEvents", "envDescribe", "backbones", "health"}
    # no channel a tenant uses is a JetStream stream: tenants have no JetStream at all
    assert not [ch.key for ch in channels() if ch.stream]


def _jsonable(value: Any) -> Any:
    # msgpack bin decodes to bytes; the schema says "string, format binary"
    if isinstance(value, bytes):
        return value.hex()
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_jsonable(v) for v in value]
    return value


@pytest.mark.parametrize(
    ("golden", "schema"),
    [
        ("event_accepted", "Accepted"),
        ("event_rejected", "Rejected"),
        ("event_state", "StateChanged"),
        ("event_progress", "Progress"),
        ("event_policy", "PolicyPublished"),
    ],
)
def test_real_encoded_messages_validate_against_the_document(golden: str, schema: str) -> None:
    doc = document()
    raw = msgspec.msgpack.decode((GOLDEN / f"{golden}.msgpack").read_bytes())
    target = {"$ref": f"#/components/schemas/{schema}", "components": doc["components"]}
    jsonschema.validate(_jsonable(raw), target)
    required = [f for f in doc["components"]["schemas"][schema]["required"] if f != "type"]
    broken = dict(raw)
    broken.pop(required[0])
    with pytest.raises(jsonschema.ValidationError, match=required[0]):
        jsonschema.validate(_jsonable(broken), target)


def test_tenant_requests_and_replies_validate_against_the_document() -> None:
    from schemas.tenantctl import (
        CtlError,
        EventsPage,
        GetJob,
        ListDatasets,
        ReadEvents,
        StoredEvent,
        SubmitJob,
    )

    doc = document()
    assert {"tenantRequests", "backbones", "envDescribe"} <= set(doc["channels"])
    for message, schema in [
        (GetJob("alice", "sft-1"), "GetJob"),
        (ListDatasets("alice"), "ListDatasets"),
        (SubmitJob("alice", "sft-1", b'{"kind": "sft"}'), "SubmitJob"),
        (ReadEvents("alice", "sft-1", 41), "ReadEvents"),
        (
            EventsPage([StoredEvent(42, "nexus.event.alice.sft-1.progress", b"\x80")], 42),
            "EventsPage",
        ),
        (CtlError("not_found", "no job 'sft-1' of tenant alice", False), "CtlError"),
    ]:
        raw = msgspec.msgpack.decode(msgspec.msgpack.encode(message))
        target = {"$ref": f"#/components/schemas/{schema}", "components": doc["components"]}
        jsonschema.validate(_jsonable(raw), target)
