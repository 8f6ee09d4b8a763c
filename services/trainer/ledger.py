"""What to do with a training message given what the job has already consumed.

The trainer applies a job's SFT batches strictly in ``step`` order and its RL episodes one
iteration at a time. After a crash the dead instance's unacked messages come back only after
the ack wait, while never-delivered ones arrive at once, and a re-publish after the duplicate
window arrives under a new stream sequence; so the decision is made from the message's
identity (step; iteration and episode), never from delivery order or stream sequence:

* ``CONSUMED``: already applied (or dropped) and contained in the job's progress: ack it
  without applying it again;
* ``APPLY``: the job's next SFT step;
* ``COLLECT``: an episode of the RL iteration being collected, not seen yet: hold it;
* ``WAIT``: a later step or iteration: keep it buffered until the job gets there.

A job's progress (``batches_done``: SFT steps or RL iterations consumed) is restored from its
checkpoint, so these rules hold across restarts; a step dropped for a non-finite loss counts as
consumed only once a commit has made that durable (see :mod:`services.trainer.service`).
"""

from __future__ import annotations

import enum
from collections.abc import Container


class Verdict(enum.Enum):
    CONSUMED = "consumed"
    APPLY = "apply"
    COLLECT = "collect"
    WAIT = "wait"


def sft_verdict(batches_done: int, step: int) -> Verdict:
    """An SFT batch for ``step`` of a job that has consumed ``batches_done`` batches."""
    if step < batches_done:
        return Verdict.CONSUMED
    if step == batches_done:
        return Verdict.APPLY
    return Verdict.WAIT


def episode_verdict(
    iterations_done: int, collected: Container[int], iteration: int, episode: int
) -> Verdict:
    """An RL episode of ``iteration`` for a job that has finished ``iterations_done``
    iterations and holds the episodes in ``collected`` of the current one."""
    if iteration < iterations_done:
        return Verdict.CONSUMED
    if iteration > iterations_done:
        return Verdict.WAIT  # collected with a policy up to max_policy_lag versions ahead
    if episode in collected:
        return Verdict.CONSUMED  # a duplicate of an episode already held
    return Verdict.COLLECT
