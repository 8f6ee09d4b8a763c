"""An inferencer process for the crash tests: the real service, whose batch runner dies
(``os._exit``, as an out-of-memory kill or a crashing kernel would: no exception, no settle)
on any batch that holds a request of the poison tenant. Each batch's tenants are appended to
a file first. ``python -m tests.crashing_inferencer POISON_TENANT BATCHES_FILE [--hold-load
TENANT MARKER_FILE | --die-on-load] [inferencer flags]``; runs until SIGTERM.
``--hold-load``: the checkpoint reads of ``TENANT``'s policies create ``MARKER_FILE``, then
wait for SIGUSR1 (a slow object store, held by the test). ``--die-on-load``: the process dies
reading a checkpoint of the poison's instead (a policy too large for memory); each such read
is written to the batches file as ``load POISON``."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from nats.js.object_store import ObjectStore

from bus import checkpoints as ckpt
from bus.config import main_config
from bus.service import main
from services.inferencer.batching import BatchRunner, BatchStats, Outcome, Work
from services.inferencer.config import InferencerConfig
from services.inferencer.service import run

CRASHED = 3  # the exit status when a batch holds the poison
HOLD_LIMIT_S = 120.0  # a held read waits this long at most for its release


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


def hold_loads(tenant: str, marker: Path) -> None:
    """Make the checkpoint reads of ``tenant``'s policies create ``marker``, then wait for
    SIGUSR1 (bounded)."""
    real_read = ckpt.get_checkpoint
    released = asyncio.Event()

    async def held_read(store: ObjectStore, name: str, sha256: str, *args: Any) -> bytes:
        if name.split("/")[0] == tenant:
            asyncio.get_running_loop().add_signal_handler(signal.SIGUSR1, released.set)
            await asyncio.to_thread(marker.touch)
            try:
                await asyncio.wait_for(released.wait(), HOLD_LIMIT_S)
            except TimeoutError:
                pass
        return await real_read(store, name, sha256, *args)

    ckpt.get_checkpoint = held_read  # type: ignore[assignment]


def die_on_load(poison: str, batches: Path) -> None:
    """Make this process die reading a checkpoint of ``poison``'s policies."""
    real_read = ckpt.get_checkpoint

    async def read_or_die(store: ObjectStore, name: str, sha256: str, *args: Any) -> bytes:
        if name.split("/")[0] == poison:
            with batches.open("a") as f:
                f.write(f"load {poison}\n")
            os._exit(CRASHED)
        return await real_read(store, name, sha256, *args)

    ckpt.get_checkpoint = read_or_die  # type: ignore[assignment]


if __name__ == "__main__":
    crash_on(sys.argv[1], Path(sys.argv[2]))
    if sys.argv[3:4] == ["--die-on-load"]:
        die_on_load(sys.argv[1], Path(sys.argv[2]))
        del sys.argv[3]
    del sys.argv[1:3]
    if sys.argv[1:2] == ["--hold-load"]:
        hold_loads(sys.argv[2], Path(sys.argv[3]))
        del sys.argv[1:4]
    main(run, main_config(InferencerConfig, "python -m tests.crashing_inferencer"))
