"""In-memory state of one job's slot on the trainer, and what is pending commit."""

from __future__ import annotations

import asyncio
import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from nats.aio.msg import Msg

from bus.errors import HandlerError, PoisonError
from schemas.events import CallResult, PolicyPublished
from schemas.train import OpenSlot, RolloutBatch
from vla.normalize import Normaliser
from vla.slot import TenantSlot

if TYPE_CHECKING:
    from services.trainer.commit import PendingCommit


class JobError(PoisonError):
    """A training message that cannot be applied to its job. The tenant is told on the job's
    events; ``fatal`` errors fail the job, others drop just this message."""

    def __init__(self, message: str, job_id: str, *, fatal: bool = True) -> None:
        super().__init__(message)
        self.job_id = job_id
        self.fatal = fatal


@dataclass
class JobSlot:
    """A tenant job's slot plus its commit bookkeeping.

    ``applied_seq`` is the highest TRAIN stream sequence applied to ``slot`` (committed or
    not; recorded in the checkpoint for operators); ``batches_done`` counts SFT batches or RL
    iterations consumed, applied or dropped, and is what replays are recognised by.
    ``held`` are messages whose effect (applied, or dropped with the error they will be
    dead-lettered with) the next checkpoint contains: they are settled right after it commits.
    """

    spec: OpenSlot
    slot: TenantSlot
    normaliser: Normaliser
    kv_revision: int
    applied_seq: int = 0
    committed_seq: int = 0
    committed_step: int = 0
    batches_done: int = 0
    committed_batches: int = 0
    held: list[tuple[Msg, HandlerError | None]] = field(default_factory=list)
    last_commit_at: float = field(default_factory=time.monotonic)
    versions: deque[str] = field(default_factory=deque)
    metrics: dict[str, float] = field(default_factory=dict)
    #: Closed (by CloseSlot) or failed here: its remaining messages are consumed unapplied.
    closed: bool = False
    #: Its commit killed the process too many times in a row (its messages dead-lettered):
    #: nothing of it is committed again; the job fails.
    commit_dead: bool = False
    #: RL: the current iteration's episodes collected so far (episode index → message, body).
    rollouts: dict[int, tuple[Msg, RolloutBatch]] = field(default_factory=dict)
    #: A session's named states (name → checkpoint object), as its latest record has them.
    saved: dict[str, str] = field(default_factory=dict)
    #: The call that saved each of ``saved`` (name → call), as the record has it.
    saved_calls: dict[str, int] = field(default_factory=dict)
    #: A session's ``save_state`` (name, call) applied and not committed yet: the next
    #: commit keeps its version under this name and answers the call.
    save_as: tuple[str, int] | None = None
    #: A session's call results not published yet; a commit publishes them first (a result
    #: must be out before its call is acked, or a crash would lose it).
    results: list[CallResult] = field(default_factory=list)
    #: One publish of ``results`` at a time: a commit must see the outcome of one in flight.
    publish_lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    #: The ``policy`` event of the latest committed version, while it is not out yet (the
    #: master plans RL iterations and ends jobs by it): the next commit only publishes it,
    #: then settles ``awaiting_event``, the messages that version holds.
    unannounced: PolicyPublished | None = None
    awaiting_event: list[tuple[Msg, HandlerError | None]] = field(default_factory=list)
    #: A commit that did not land, tried again as it was (the same version, state and
    #: messages) before anything newer: a version number is never skipped nor written twice.
    pending: PendingCommit | None = None
    #: When to try a failed commit or an owed event again (monotonic).
    retry_at: float = 0.0

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

    @property
    def live(self) -> bool:
        """Still expecting messages (its tenant's queue is worth fetching from)."""
        return not self.closed and not self.finished

    def commit_due(self, every_s: float) -> bool:
        if self.commit_dead:
            return False
        if self.unannounced is not None or self.pending is not None:  # those come first
            return time.monotonic() >= self.retry_at
        if self.batches_done == self.committed_batches and not self.held:
            return False
        return (
            self.finished
            or self.save_as is not None
            or self.batches_done - self.committed_batches >= self.spec.checkpoint_every
            or time.monotonic() - self.last_commit_at >= every_s
        )

    def error(self, message: str, *, fatal: bool = True) -> JobError:
        return JobError(message, self.spec.job_id, fatal=fatal)
