"""Trainer service (foundation stage): joins the bus, registers its backbone in the
``placement`` KV and heartbeats. Tenant slots and the Training Queue land with the trainer
issue."""

from __future__ import annotations

import contextlib

from pydantic import Field

from bus.config import BusConfig
from bus.service import Runtime, serve
from schemas import subjects


class TrainerConfig(BusConfig):
    """Trainer settings."""

    backbone: str = Field("tiny", description="Backbone id this trainer serves.")


async def run(config: TrainerConfig) -> None:
    """Entry point: serve the trainer until SIGTERM/SIGINT."""

    async def body(rt: Runtime) -> None:
        placement = await rt.js.key_value(subjects.KV_PLACEMENT)
        key = f"trainer.{config.backbone}.{rt.instance}"
        await placement.put(key, rt.instance.encode())
        try:
            await rt.stop.wait()
        finally:
            with contextlib.suppress(Exception):
                await placement.delete(key)

    await serve("trainer", config, body)
