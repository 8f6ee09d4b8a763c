"""The master's settings: flags and ``JOYNEXUS_*`` variables (:mod:`bus.config`)."""

from __future__ import annotations

from pydantic import Field

from bus.config import DatasetsConfig
from schemas.limits import InputLimits
from services.master.envfit import DESCRIBE_TIMEOUT_S
from services.master.pacing import DEFAULT_BURST, DEFAULT_RATE


class MasterConfig(DatasetsConfig):
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
    tenant_requests_per_s: float = Field(
        DEFAULT_RATE,
        ge=0,
        description="Requests a second each tenant is answered at, sustained; more wait for "
        "their turn (0: unpaced).",
    )
    tenant_request_burst: float = Field(
        DEFAULT_BURST, ge=1, description="Requests a tenant may make at once without waiting."
    )
    limit: InputLimits = Field(
        default_factory=InputLimits, description="Input bounds (--limit-*, JOYNEXUS_LIMIT_*)."
    )
