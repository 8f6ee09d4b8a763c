"""In-memory state of one job's slot on the trainer, and what is pending commit."""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from nats.aio.msg import Msg

from schemas.train import OpenSlot, RolloutBatch
from vla.normalize import Normaliser
from vla.slot import TenantSlot


@dataclass
class JobSlot:
    """A tenant job's slot plus its commit bookkeeping.

    ``applied_seq`` is the highest TRAIN stream sequence applied to ``slot`` (committed or
    not); ``committed_seq`` the highest one contained in the last committed checkpoint.
    ``held`` are messages applied but not yet acknowledged: they are acked right after the
    checkpoint that contains them is committed (and kept alive with in-progress acks until).
    """

    spec: OpenSlot
    slot: TenantSlot
    normaliser: Normaliser
    kv_revision: int
    applied_seq: int = 0
    committed_seq: int = 0
    committed_step: int = 0
    #: Batches consumed (applied or dropped); the next batch to apply has ``step`` >= this.
    batches_done: int = 0
    committed_batches: int = 0
    held: list[Msg] = field(default_factory=list)
    last_commit_at: float = field(default_factory=time.monotonic)
    versions: deque[str] = field(default_factory=deque)
    metrics: dict[str, float] = field(default_factory=dict)
    closed: bool = False
    #: RL: the current iteration's episodes collected so far (episode index → message, body).
    rollouts: dict[int, tuple[Msg, RolloutBatch]] = field(default_factory=dict)

    @property
    def iteration_complete(self) -> bool:
        rl = self.spec.rl
        return rl is not None and len(self.rollouts) >= rl.episodes_per_iteration

    @property
    def key(self) -> str:
        return f"{self.spec.tenant}/{self.spec.job_id}"

    @property
    def finished(self) -> bool:
        return self.batches_done >= self.spec.total_steps

    def commit_due(self, every_s: float) -> bool:
        if self.batches_done == self.committed_batches:
            return False
        return (
            self.finished
            or self.batches_done - self.committed_batches >= self.spec.checkpoint_every
            or time.monotonic() - self.last_commit_at >= every_s
        )
