"""The health manager: tracks the liveness of every role instance from heartbeats."""

from services.health.service import HealthConfig, LivenessTable, run

__all__ = ["HealthConfig", "LivenessTable", "run"]
