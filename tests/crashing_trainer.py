"""A trainer process for the crash test: the real service, whose grouped step and RL update
die (``os._exit``, as an out-of-memory kill or a crashing kernel would: no exception, no
settle) on any round or update that holds work of the poison tenant (mode ``work``; mode
``raise``: raise out of it instead, as a bug would, and the trainer exits 1; mode
``raise-after``: raise out of the poison's second step and later ones after the real step
ran, every tenant of the round stepped and none booked), or whose
restore of a slot from its checkpoint (mode ``restore``), the opening of a new one (mode
``open``) or the writing of a version after the first (mode ``commit``) dies on the poison
tenant's; each round's tenants (or ``MODE TENANT``) are appended to a file first. ``python -m
tests.crashing_trainer MODE POISON_TENANT ROUNDS_FILE [trainer flags]``; runs until
SIGTERM."""

from __future__ import annotations

import asyncio
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bus.config import main_config
from bus.service import main
from services.trainer import rl, steps
from services.trainer.commit import Committer
from services.trainer.config import TrainerConfig
from services.trainer.service import run
from services.trainer.slots import Slots

CRASHED = 3  # the exit status when a round or update holds the poison's work


def crash_on_slot(mode: str, poison: str, rounds: Path) -> None:
    """Make this process die restoring (mode ``restore``) or opening (mode ``open``) a slot
    of ``poison``'s."""
    real = getattr(Slots, "create" if mode == "open" else mode)

    def slot_or_die(self: Slots, key: str, *args: Any) -> Any:
        tenant = key.split("/")[0]
        with rounds.open("a") as f:
            f.write(f"{mode} {tenant}\n")
        if tenant == poison:
            os._exit(CRASHED)
        return real(self, key, *args)

    setattr(Slots, "create" if mode == "open" else mode, slot_or_die)


def crash_on_commit(poison: str, rounds: Path) -> None:
    """Make this process die writing a version of ``poison``'s job (its first, at the
    opening, is written), half a second into the write (as a slow serialisation would: the
    rest of the trainer may go on meanwhile). Written down: the process's start (``start``),
    each commit's (``committing TENANT``) and write's (``commit TENANT``), and each round as
    ``step TENANTS`` when it starts and ``stepped`` when it ends."""
    real = Committer._write
    real_commit = Committer._commit
    real_step = steps.group_train_step

    async def logged_commit(self: Committer, job: Any, *args: Any, **kwargs: Any) -> Any:
        with rounds.open("a") as f:
            f.write(f"committing {job.spec.tenant}\n")
        return await real_commit(self, job, *args, **kwargs)

    def logged_step(encoder: Any, work: list[Any], **kwargs: Any) -> Any:
        with rounds.open("a") as f:
            f.write("step " + " ".join(r.tenant.split("/")[0] for r in work) + "\n")
        try:
            return real_step(encoder, work, **kwargs)
        finally:
            with rounds.open("a") as f:
                f.write("stepped\n")

    steps.group_train_step = logged_step  # type: ignore[assignment]
    with rounds.open("a") as f:
        f.write("start\n")

    async def write_or_die(self: Committer, job: Any, frozen: Any, at: Any, initial: bool) -> Any:
        tenant = job.spec.tenant
        with rounds.open("a") as f:
            f.write(f"commit {tenant}\n")
        if tenant == poison and not initial:
            await asyncio.sleep(0.5)
            os._exit(CRASHED)
        return await real(self, job, frozen, at, initial)

    Committer._write = write_or_die  # type: ignore[method-assign]
    Committer._commit = logged_commit  # type: ignore[method-assign]


def crash_on(poison: str, rounds: Path, raising: bool = False) -> None:
    """Make this process die on a round or RL update holding ``poison``'s work (``raising``:
    raise out of the grouped step or update instead)."""

    def dying(real: Callable[..., Any], tenants_of: Callable[[list[Any]], list[str]]) -> Any:
        def run_or_die(encoder: Any, work: list[Any], **kwargs: Any) -> Any:
            tenants = tenants_of(work)
            with rounds.open("a") as f:
                f.write(" ".join(tenants) + "\n")
            if poison in tenants:
                if raising:
                    raise RuntimeError(f"a bug in the step, on {poison}'s work")
                os._exit(CRASHED)
            return real(encoder, work, **kwargs)

        return run_or_die

    steps.group_train_step = dying(  # type: ignore[assignment]
        steps.group_train_step, lambda requests: [r.tenant.split("/")[0] for r in requests]
    )
    rl.update_iterations = dying(  # type: ignore[assignment]
        rl.update_iterations, lambda its: [it.key.split("/")[0] for it in its]
    )


def raise_after_step(poison: str, rounds: Path) -> None:
    """Make the grouped step raise, after it ran, on a round where ``poison``'s slot took
    its second step or a later one; each round is written down as ``TENANT:STEP ...`` (the
    slots' steps after it), and a raising one as ``raised TENANT:STEP ...``."""
    real = steps.group_train_step

    def step_then_raise(encoder: Any, work: list[Any], **kwargs: Any) -> Any:
        results = real(encoder, work, **kwargs)
        at = {r.tenant.split("/")[0]: r.slot.step for r in work}
        raising = at.get(poison, 0) >= 2
        with rounds.open("a") as f:
            f.write(("raised " if raising else "") + " ".join(f"{t}:{s}" for t, s in at.items()))
            f.write("\n")
        if raising:
            raise RuntimeError(f"a bug after the step, on {poison}'s work")
        return results

    steps.group_train_step = step_then_raise  # type: ignore[assignment]


if __name__ == "__main__":
    mode, poison, rounds = sys.argv[1], sys.argv[2], Path(sys.argv[3])
    if mode in ("work", "raise"):
        crash_on(poison, rounds, raising=mode == "raise")
    elif mode == "raise-after":
        raise_after_step(poison, rounds)
    elif mode == "commit":
        crash_on_commit(poison, rounds)
    else:
        crash_on_slot(mode, poison, rounds)
    del sys.argv[1:4]
    main(run, main_config(TrainerConfig, "python -m tests.crashing_trainer"))
