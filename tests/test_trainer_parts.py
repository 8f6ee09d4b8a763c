"""The trainer's parts on their own: the DRR scheduler (a pure function) and the ledger,
driven through redelivery orders, policy lag and crash points like a trainer would see."""

from __future__ import annotations

import random

import pytest

from services.trainer.ledger import Verdict, episode_verdict, sft_verdict
from services.trainer.scheduler import Candidate, drr_round

MB = 2**20


def test_drr_serves_tenants_in_proportion_to_their_weights() -> None:
    deficits: dict[str, float] = {}
    served = {"a": 0, "b": 0, "c": 0}
    for _ in range(300):
        cands = [Candidate("a", 4, 1, MB), Candidate("b", 4, 2, MB), Candidate("c", 8, 1, MB)]
        # A quantum below the batch size: credit, not the one-batch-per-round cap, decides.
        r = drr_round(deficits, cands, quantum=1, budget_bytes=10 * MB)
        deficits = r.deficits
        for t in r.chosen:
            served[t] += next(c.samples for c in cands if c.tenant == t)
    # Samples served follow the weights (a:b:c = 1:2:1), whatever the batch sizes.
    assert served["b"] == pytest.approx(2 * served["a"], rel=0.05)
    assert served["c"] == pytest.approx(served["a"], rel=0.05)


def test_drr_idle_tenants_bank_no_credit() -> None:
    r = drr_round({"a": 50.0}, [Candidate("b", 4, 1, MB)], quantum=4, budget_bytes=10 * MB)
    assert "a" not in r.deficits and r.chosen == ["b"]


def test_drr_never_chooses_more_slots_than_the_budget_holds_and_rotates_who_waits() -> None:
    deficits: dict[str, float] = {}
    turns = {t: 0 for t in "abcd"}
    for _ in range(40):
        cands = [Candidate(t, 4, 1, 3 * MB) for t in "abcd"]
        r = drr_round(deficits, cands, quantum=4, budget_bytes=7 * MB)  # two slots fit
        deficits = r.deficits
        assert len(r.chosen) <= 2
        for t in r.chosen:
            turns[t] += 1
    assert min(turns.values()) >= 19  # nobody starves behind the budget


def test_drr_a_tenant_waiting_for_room_keeps_its_credit() -> None:
    cands = [Candidate("a", 4, 1, 6 * MB), Candidate("b", 4, 1, 6 * MB)]
    r = drr_round({"a": 10.0, "b": 0.0}, cands, quantum=4, budget_bytes=7 * MB)
    assert r.chosen == ["a"] and r.deficits["b"] == 4.0


# -- the ledger, driven like the trainer drives it -------------------------------------------


def run_sft(deliveries: list[int], crash_at: set[int], commit_every: int = 3) -> list[int]:
    """Feed SFT step indices in delivery order through the ledger as the trainer does: applied
    batches are held until a commit (every ``commit_every`` applications); a crash after the
    n-th delivery (n in ``crash_at``) falls back to the last commit and redelivers every
    message that was not acked. Returns the steps applied, in order, in the history that
    survives."""
    queue = list(deliveries)
    buffer: list[int] = []
    held: list[int] = []
    done = committed = 0
    applied: list[int] = []
    delivered = 0
    while queue or buffer:
        if queue:
            buffer.append(queue.pop(0))
            delivered += 1
        progressed = True
        while progressed:
            progressed = False
            for step in list(buffer):
                verdict = sft_verdict(done, step, committed)
                if verdict is Verdict.WAIT:
                    continue
                buffer.remove(step)
                progressed = True
                if verdict is Verdict.APPLY:
                    applied.append(step)
                    done = step + 1
                    held.append(step)
                    if len(held) >= commit_every or done == max(deliveries) + 1:
                        committed, held = done, []
        if delivered in crash_at:
            crash_at.discard(delivered)
            done, applied = committed, applied[:committed]
            queue = held + buffer + queue
            held, buffer = [], []
        waiting = all(sft_verdict(done, s, committed) is Verdict.WAIT for s in buffer)
        if not queue and buffer and waiting:
            break  # stuck: a gap nobody will fill (the test then fails)
    return applied


@pytest.mark.parametrize("seed", range(20))
def test_sft_steps_apply_once_each_in_order_under_redelivery_and_crashes(seed: int) -> None:
    rng = random.Random(seed)
    steps = 12
    deliveries = list(range(steps))
    rng.shuffle(deliveries)
    # Duplicates: re-publishes after the duplicate window, anywhere in the stream.
    deliveries += [rng.randrange(steps) for _ in range(4)]
    rng.shuffle(deliveries)
    crashes = set(rng.sample(range(1, len(deliveries)), 2))
    assert run_sft(deliveries, crashes) == list(range(steps))


def test_episode_verdicts_with_policy_lag() -> None:
    # Iteration 0 collecting, episode 0 held: iteration 1's episode 0 must wait, not be
    # taken for a duplicate (defect B).
    assert episode_verdict(0, {0}, 1, 0, 0) is Verdict.WAIT
    assert episode_verdict(0, {0}, 0, 1, 0) is Verdict.COLLECT
    assert episode_verdict(1, set(), 0, 1, 1) is Verdict.CONSUMED  # replay of a done iteration
    assert episode_verdict(1, set(), 1, 0, 1) is Verdict.COLLECT


def test_a_copy_of_a_message_held_for_a_commit_waits_for_that_commit() -> None:
    """A held message whose in-progress acks stalled past the ack wait is redelivered as a
    second copy of the same stream message; acking that copy deletes the held one, and a
    crash before the commit then lost the step (or episode) for good."""
    # SFT (and session calls): steps 0..2 applied, none committed.
    assert sft_verdict(3, 1, 0) is Verdict.WAIT
    assert sft_verdict(3, 1, 2) is Verdict.CONSUMED  # in the checkpoint: ack it
    assert sft_verdict(3, 3, 0) is Verdict.APPLY
    # RL: episode 0 of iteration 0 held; iteration 1 updated, not committed.
    assert episode_verdict(0, {0}, 0, 0, 0) is Verdict.WAIT
    assert episode_verdict(2, set(), 1, 0, 1) is Verdict.WAIT
    assert episode_verdict(2, set(), 1, 0, 2) is Verdict.CONSUMED


@pytest.mark.parametrize("seed", range(20))
def test_every_episode_of_overlapping_iterations_is_used_exactly_once(seed: int) -> None:
    rng = random.Random(seed)
    iterations, per_iteration = 4, 3
    stream = [(i, e) for i in range(iterations) for e in range(per_iteration)]
    rng.shuffle(stream)  # lag > 0: several iterations' episodes interleave in TRAIN
    stream += rng.sample(stream, 3)  # redeliveries
    done = 0
    held: dict[int, tuple[int, int]] = {}
    used: list[tuple[int, int]] = []
    buffer = list(stream)
    for _ in range(100):
        for item in list(buffer):
            verdict = episode_verdict(done, held, *item, done)  # each update commits at once
            if verdict is Verdict.WAIT:
                continue
            buffer.remove(item)
            if verdict is Verdict.COLLECT:
                held[item[1]] = item
        if len(held) == per_iteration:
            used += sorted(held.values())
            held, done = {}, done + 1
        if not buffer:
            break
    assert done == iterations
    assert used == [(i, e) for i in range(iterations) for e in range(per_iteration)]
