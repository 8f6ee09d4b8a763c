"""The inferencer: serves tenants' policies from ``INFER`` with group-batched forwards."""

from services.inferencer.service import InferencerConfig, run

__all__ = ["InferencerConfig", "run"]
