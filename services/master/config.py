"""The master's settings: flags and ``JOYNEXUS_*`` variables (:mod:`bus.config`)."""

from __future__ import annotations

from pydantic import Field

from bus.config import BusConfig
from schemas.limits import InputLimits
from services.master.envfit import DESCRIBE_TIMEOUT_S


class MasterConfig(BusConfig):
    """Master settings."""

    max_deliver: int = Field(5, ge=1, description="Deliveries before a job command is dead.")
    backbones: str = Field("tiny", description="Backbone ids this stack serves (a,b).")
    backbone_deadline_s: float = Field(
        60.0, gt=0, description="Fail a job whose backbone's trainer is down this long."
    )
    env_describe_timeout_s: float = Field(
        DESCRIBE_TIMEOUT_S,
        gt=0,
        description="Wait for an env worker's description of a job's env (its first build).",
    )
    dataset_cache: str = Field(
        "", description="Where pushed datasets are materialised (default: a temp dir)."
    )
    limit: InputLimits = Field(
        default_factory=InputLimits, description="Input bounds (--limit-*, JOYNEXUS_LIMIT_*)."
    )
