"""``joynexus usage``: what each tenant used of the services, as a bill.

Reads the ``USAGE`` stream (every service instance's per-tenant reports, :mod:`bus.usage`)
from ``--since`` on, and the checkpoints each tenant has stored now. The last lines check the
bill: for each service, the compute seconds charged to the tenants against the busy seconds
the service measured itself.
"""

from __future__ import annotations

import re
import time
from dataclasses import asdict
from datetime import UTC, datetime
from typing import Any

from nats.js import JetStreamContext
from nats.js.errors import NotFoundError

from bus.kv import list_objects
from bus.usage import Bill, Charges, read_bill, stored_checkpoint_bytes
from schemas import subjects

_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_since(text: str, now: float | None = None) -> float:
    """Epoch seconds of ``text``: a duration back from now (``90s``, ``30m``, ``2h``,
    ``7d``) or an ISO date/time (UTC unless it says otherwise)."""
    now = time.time() if now is None else now
    duration = re.fullmatch(r"(\d+(?:\.\d+)?)([smhd])", text.strip())
    if duration:
        return now - float(duration.group(1)) * _UNITS[duration.group(2)]
    try:
        moment = datetime.fromisoformat(text.strip())
    except ValueError:
        raise ValueError(
            f"--since {text!r}: give a duration (90s, 30m, 2h, 7d) or an ISO date/time "
            "(2026-12-03 or 2026-12-03T15:00)"
        ) from None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=UTC)
    return moment.timestamp()


async def stored_now(js: JetStreamContext) -> dict[str, int]:
    """Bytes of checkpoints each tenant has in the object store now."""
    try:
        store = await js.object_store(subjects.OBJ_CHECKPOINTS)
    except NotFoundError:
        return {}
    infos = await list_objects(store)
    return stored_checkpoint_bytes((i.name or "", i.size or 0) for i in infos)


async def collect(js: JetStreamContext, since: float | None, tenant: str | None) -> dict[str, Any]:
    """The bill as a JSON-able document."""
    bill = await read_bill(js, since, tenant)
    stored = await stored_now(js)
    return as_document(bill, stored, since, tenant)


def as_document(
    bill: Bill, stored: dict[str, int], since: float | None, tenant: str | None
) -> dict[str, Any]:
    tenants = [tenant] if tenant else sorted(set(bill.tenants()) | set(stored))
    charged = bill.charged_s()
    document = {
        "since": since if since is not None else bill.first,
        "until": bill.last,
        "reports": bill.reports,
        "tenants": {
            t: {
                "services": {service: asdict(c) for service, c in bill.of(t).items()},
                "jobs": {
                    job_id: {service: asdict(c) for service, c in services.items()}
                    for job_id, services in bill.jobs_of(t).items()
                },
                "checkpoint_bytes_stored": stored.get(t, 0),
            }
            for t in tenants
        },
        # Per service: what it measured itself, and what the tenants were charged of it
        # (of the whole bill only: one tenant's charges are not meant to add up to it).
        "services": {}
        if tenant
        else {
            service: {"busy_s": busy, "charged_s": charged.get(service, 0.0)}
            for service, busy in sorted(bill.busy_s.items())
        },
    }
    return document


def _when(epoch: float | None) -> str:
    if epoch is None:
        return "-"
    return datetime.fromtimestamp(epoch, UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def render(document: dict[str, Any], whole_bill: bool = True, by_job: bool = False) -> str:
    """The bill as a table: one line per tenant and service (``by_job``: per tenant, job and
    service), a total per tenant; with ``whole_bill``, each service's measured busy time
    against what was charged."""
    width = 30 if by_job else 11
    label = "job service" if by_job else "service"
    lines = [
        f"usage from {_when(document['since'])} to {_when(document['until'])} "
        f"({document['reports']} reports)",
        "",
        f"{'tenant':<22} {label:<{width}} {'compute s':>10} {'share':>6} {'samples':>9} "
        f"{'env steps':>9} {'acts':>7} {'obs':>8} {'ckpt MB':>8} {'stored MB':>9}",
    ]
    busy = {s: v["busy_s"] for s, v in document["services"].items()}
    for tenant, entry in document["tenants"].items():
        total = Charges()
        for service, c in entry["services"].items():
            charges = Charges(**c)
            total.add(charges)
            share = f"{charges.compute_s / busy[service]:>5.1%}" if busy.get(service) else ""
            if not by_job:
                lines.append(_line(tenant, service, charges, share, ""))
        if by_job:
            for job_id, services in entry["jobs"].items():
                for service, c in services.items():
                    row = _line(tenant, f"{job_id} {service}", Charges(**c), "", "", width)
                    lines.append(row)
        stored = f"{entry['checkpoint_bytes_stored'] / 1e6:>9.2f}"
        lines.append(_line(tenant, "total", total, "", stored, width))
    if whole_bill and document["services"]:
        lines += ["", f"{'service':<11} {'busy s (measured)':>18} {'charged s':>10} {'charged':>8}"]
        for service, v in document["services"].items():
            ratio = v["charged_s"] / v["busy_s"] if v["busy_s"] > 0 else 1.0
            lines.append(
                f"{service:<11} {v['busy_s']:>18.3f} {v['charged_s']:>10.3f} {ratio:>8.1%}"
            )
    if not document["tenants"]:
        lines.append("(no usage recorded in this period)")
    return "\n".join(lines)


def _line(tenant: str, label: str, c: Charges, share: str, stored: str, width: int = 11) -> str:
    return (
        f"{tenant:<22} {label:<{width}} {c.compute_s:>10.3f} {share:>6} {int(c.samples):>9} "
        f"{int(c.env_steps):>9} {int(c.act_requests):>7} {int(c.observations):>8} "
        f"{c.checkpoint_bytes / 1e6:>8.2f} {stored:>9}"
    ).rstrip()
