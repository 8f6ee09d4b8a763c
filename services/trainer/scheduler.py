"""Deficit round robin over tenants, by samples, under the slot memory budget (a pure
function, so fairness and the budget rule are tested without a bus).

Each round every tenant with a batch ready earns ``quantum * weight`` samples of credit and is
served when its credit covers its batch; an idle tenant banks nothing. Tenants are considered
most-owed first, and a tenant whose slot would not fit beside the slots already chosen this
round waits (keeping its credit), so one round never asks for more resident slots than the
budget holds. A round in which no credit would cover any batch (batches larger than the
quantum) runs the credit-only rounds it would take at once, so the trainer never spends a
loop, and an idle wait, on a round that serves nobody.
"""

from __future__ import annotations

import math
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
    chosen = _serve(candidates, credit, budget_bytes)
    if not chosen:
        # Nobody's credit covers its batch yet (batches larger than the quantum): the rounds
        # that would only bank credit are run at once rather than one per trainer loop.
        short = [
            math.ceil((c.samples - credit[c.tenant]) / (quantum * max(1, c.weight)))
            for c in candidates
            if c.slot_bytes <= budget_bytes and credit[c.tenant] < c.samples
        ]
        if short:
            rounds = min(short)
            for c in candidates:
                credit[c.tenant] += rounds * quantum * max(1, c.weight)
            chosen = _serve(candidates, credit, budget_bytes)
    order = {c.tenant: i for i, c in enumerate(candidates)}
    chosen.sort(key=order.__getitem__)  # serve in arrival order: stable group layout
    return Round(chosen, credit)


def _serve(candidates: Sequence[Candidate], credit: dict[str, float], budget: int) -> list[str]:
    """Most-owed first, everyone whose credit covers its batch and whose slot fits beside
    the ones chosen (their credit is spent)."""
    chosen: list[str] = []
    used = 0
    for c in sorted(candidates, key=lambda c: (-credit[c.tenant], c.tenant)):
        if credit[c.tenant] < c.samples:
            continue
        if used + c.slot_bytes > budget:
            continue  # waits for a round with room; keeps its credit
        credit[c.tenant] -= c.samples
        used += c.slot_bytes
        chosen.append(c.tenant)
    return chosen
