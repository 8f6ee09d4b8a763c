"""Sharing an inference batch between jobs in proportion to their weights (a pure function,
so the policy is tested without a bus).

When the requests waiting fit one batch, they all go, in arrival order: nobody waits on
anybody. When more observations wait than a batch takes, the batch is filled by deficit round
robin over jobs: each round every job with a request waiting earns ``weight`` observations of
credit, and the jobs, most owed first, send their oldest requests while their credit covers
them and the batch has room. Credit carries over to the
next batch while a job keeps waiting and is dropped once it has nothing waiting, so over many
batches each busy job gets observations in proportion to its weight (its tenant's priority
class times its own priority), and a job flooding the queue cannot crowd out the others.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Waiting:
    """A request waiting for a batch."""

    job: str
    observations: int
    weight: int


def fair_take(waiting: Sequence[Waiting], target: int, credit: dict[str, float]) -> list[int]:
    """Indices (into ``waiting``, oldest first) of the next batch of at most ``target``
    observations (at least one request). ``credit`` is updated in place."""
    if not waiting:
        return []
    if sum(w.observations for w in waiting) <= target:
        credit.clear()  # nobody waits behind anybody: nothing is owed
        return list(range(len(waiting)))
    queues: dict[str, list[int]] = {}
    for i, w in enumerate(waiting):
        queues.setdefault(w.job, []).append(i)
    for job in list(credit):
        if job not in queues:
            del credit[job]  # an idle job banks nothing
    # A request larger than a batch never fits beside others: once its job's credit covers
    # it, it goes alone (else, while other jobs keep the queue busy, it would wait for ever).
    for job, queue in queues.items():
        i = queue[0]
        if waiting[i].observations > target and credit.get(job, 0.0) >= waiting[i].observations:
            credit[job] -= waiting[i].observations
            return [i]
    if all(waiting[queue[0]].observations > target for queue in queues.values()):
        # Every job's next request is larger than a batch: each goes alone, when the credit
        # its job earns at its weight covers it (the rounds until the first is covered run at
        # once). Served in arrival order instead, a flood of large requests kept a weightier
        # job's waiting for as many forwards as the flood had sent before it.
        def rounds(job: str) -> int:
            head = waiting[queues[job][0]]
            owed = head.observations - credit.get(job, 0.0)
            return max(0, math.ceil(owed / max(1, head.weight)))

        earned = min(rounds(job) for job in queues)
        for job, queue in queues.items():
            credit[job] = credit.get(job, 0.0) + earned * max(1, waiting[queue[0]].weight)
        covered = [j for j in queues if credit[j] >= waiting[queues[j][0]].observations]
        job = max(covered, key=lambda j: credit[j] - waiting[queues[j][0]].observations)
        i = queues[job][0]
        credit[job] -= waiting[i].observations
        return [i]
    chosen: list[int] = []
    total = 0
    while True:
        heads = [q[0] for q in queues.values() if q]
        if not heads or all(total + waiting[i].observations > target for i in heads):
            break
        for job, queue in queues.items():
            if queue:
                credit[job] = credit.get(job, 0.0) + max(1, waiting[queue[0]].weight)
        for job in sorted(queues, key=lambda j: -credit.get(j, 0.0)):  # most owed first
            queue = queues[job]
            while queue and waiting[queue[0]].observations <= credit[job]:
                if total + waiting[queue[0]].observations > target:
                    break
                i = queue.pop(0)
                credit[job] -= waiting[i].observations
                total += waiting[i].observations
                chosen.append(i)
    # Some job's next request fits a batch, and rounds run until credit covers one.
    assert chosen, "a request that fits a batch is always covered in the end"
    return sorted(chosen)
