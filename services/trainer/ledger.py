"""What to do with a training message given what the job has already consumed.

The trainer applies a job's SFT batches strictly in ``step`` order and its RL episodes one
iteration at a time. After a crash the dead instance's unacked messages come back only after
the ack wait, while never-delivered ones arrive at once, and a re-publish after the duplicate
window arrives under a new stream sequence; so the decision is made from the message's
identity (step; iteration and episode), never from delivery order or stream sequence:

* ``CONSUMED``: already applied (or dropped) and contained in the job's last checkpoint:
  ack it without applying it again (one applied but not committed yet waits for the commit:
  it may be a redelivered copy of the message held for it, which an ack would delete);
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


def sft_verdict(batches_done: int, step: int, committed: int) -> Verdict:
    """An SFT batch (or session call) for ``step`` of a job that has consumed
    ``batches_done`` batches, ``committed`` of them in its last checkpoint."""
    if step < committed:
        return Verdict.CONSUMED
    if step < batches_done:
        # Applied, not committed yet: this may be a redelivery of the message held for that
        # commit (its in-progress acks stalled past the ack wait); acked now, the stream
        # would delete the held one, and a crash before the commit would lose the step.
        return Verdict.WAIT
    if step == batches_done:
        return Verdict.APPLY
    return Verdict.WAIT


def episode_verdict(
    iterations_done: int,
    collected: Container[int],
    iteration: int,
    episode: int,
    committed: int,
) -> Verdict:
    """An RL episode of ``iteration`` for a job that has finished ``iterations_done``
    iterations (``committed`` of them in its last checkpoint) and holds the episodes in
    ``collected`` of the current one."""
    if iteration < committed:
        return Verdict.CONSUMED
    if iteration < iterations_done:
        return Verdict.WAIT  # its update is not committed yet (see sft_verdict)
    if iteration > iterations_done:
        return Verdict.WAIT  # collected with a policy up to max_policy_lag versions ahead
    if episode in collected:
        return Verdict.WAIT  # a copy of an episode held: settled once the update commits
    return Verdict.COLLECT
