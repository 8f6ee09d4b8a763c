"""An inferencer process for the crash test: the real service, whose batch runner dies
(``os._exit``, as an out-of-memory kill or a crashing kernel would: no exception, no settle)
on any batch that holds a request of the poison tenant. Each batch's tenants are appended to
a file first. ``python -m tests.crashing_inferencer POISON_TENANT BATCHES_FILE [inferencer
flags]``; runs until SIGTERM."""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from pathlib import Path

from bus.config import main_config
from bus.service import main
from services.inferencer.batching import BatchRunner, BatchStats, Outcome, Work
from services.inferencer.config import InferencerConfig
from services.inferencer.service import run

CRASHED = 3  # the exit status when a batch holds the poison


def crash_on(poison: str, batches: Path) -> None:
    """Make every batch runner of this process die on a batch holding ``poison``'s requests."""
    real_run = BatchRunner.run

    def run_or_die(self: BatchRunner, batch: Sequence[Work]) -> tuple[list[Outcome], BatchStats]:
        tenants = [work.request.tenant for work in batch]
        with batches.open("a") as f:
            f.write(" ".join(tenants) + "\n")
        if poison in tenants:
            os._exit(CRASHED)
        return real_run(self, batch)

    BatchRunner.run = run_or_die  # type: ignore[method-assign]


if __name__ == "__main__":
    crash_on(sys.argv[1], Path(sys.argv[2]))
    del sys.argv[1:3]
    main(run, main_config(InferencerConfig, "python -m tests.crashing_inferencer"))
