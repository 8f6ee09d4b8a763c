"""Deficit round robin over tenants, by samples, under the slot memory budget (a pure
function, so fairness and the budget rule are tested without a bus).

Each round every tenant with a batch ready earns ``quantum * weight`` samples of credit and is
served when its credit covers its batch; an idle tenant banks nothing. Tenants are considered
most-owed first, and a tenant whose slot would not fit beside the slots already chosen this
round waits (keeping its credit), so one round never asks for more resident slots than the
budget holds.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Candidate:
    """A tenant with a batch ready this round."""

    tenant: str
    #: Samples in the tenant's next batch.
    samples: int
    #: Priority weight (1 = fair share).
    weight: int
    #: Resident bytes the tenant's slot needs.
    slot_bytes: int


@dataclass(frozen=True)
class Round:
    """Who is served this round, and everyone's credit after it."""

    chosen: list[str]
    deficits: dict[str, float]


def drr_round(
    deficits: Mapping[str, float],
    candidates: Sequence[Candidate],
    quantum: int,
    budget_bytes: int,
) -> Round:
    """One DRR round. ``deficits`` are the credits after the last round (missing: 0); the
    result has an entry for every candidate (tenants without a batch drop to 0)."""
    credit = {
        c.tenant: deficits.get(c.tenant, 0.0) + quantum * max(1, c.weight) for c in candidates
    }
    chosen: list[str] = []
    used = 0
    for c in sorted(candidates, key=lambda c: (-credit[c.tenant], c.tenant)):
        if credit[c.tenant] < c.samples:
            continue
        if used + c.slot_bytes > budget_bytes:
            continue  # waits for a round with room; keeps its credit
        credit[c.tenant] -= c.samples
        used += c.slot_bytes
        chosen.append(c.tenant)
    order = {c.tenant: i for i, c in enumerate(candidates)}
    chosen.sort(key=order.__getitem__)  # serve in arrival order: stable group layout
    return Round(chosen, credit)
