"""Sampling from a tenant's committed policy versions (the low-level API's
``SamplingClient``; :mod:`clients.lowlevel` creates them). Requests go to the master, which
relays them to the inferencers (a tenant's identity has no JetStream), where they share
grouped forwards with rollouts."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from clients.errors import RequestError
from schemas.model import Observation
from schemas.tenantctl import Sampled, SamplePolicy

if TYPE_CHECKING:
    from clients.lowlevel import ServiceClient


@dataclass(frozen=True)
class SampleOutput:
    """Actions for B observations: ``actions`` (B, C, A), ``log_probs`` (B,), ``values`` (B,)
    or None without a value head, from policy ``version``; ``group_size``: act requests
    that shared the inferencer's backbone forward."""

    actions: np.ndarray
    log_probs: np.ndarray
    values: np.ndarray | None
    version: int
    group_size: int


@dataclass
class SamplingClient:
    """Actions from a committed policy version of the tenant (a session's or a job's),
    served by the inferencers with the same grouped forwards as rollouts."""

    service: ServiceClient
    policy: str
    version: int = 0
    timeout_s: float = 10.0

    async def act(
        self,
        observations: Sequence[Observation],
        *,
        deterministic: bool = False,
        seed: int = -1,
    ) -> SampleOutput:
        """One action chunk per observation. ``seed`` >= 0: the head's noise is drawn from
        a generator seeded by it, so a request gives the same actions again, bit for bit
        when it is batched alike; its backbone forward may be grouped with other requests,
        and on CPUs whose kernels are not batch-invariant that moves the actions by float
        rounding (~1e-7)."""
        client = self.service.client
        tenant = self.service.tenant
        request = SamplePolicy(
            tenant,
            self.policy,
            list(observations),
            self.version,
            deterministic,
            seed,
            self.timeout_s,
        )
        reply = await client.request(tenant, request, timeout=self.timeout_s + 5.0)
        assert isinstance(reply, Sampled)
        act = reply.reply
        if act.actions is None or act.log_probs is None:
            raise RequestError(f"act: empty reply ({act.error})", code="invalid", retryable=False)
        return SampleOutput(
            act.actions.to_numpy(),
            act.log_probs.to_numpy(),
            None if act.values is None else act.values.to_numpy(),
            act.policy_version,
            act.group_size,
        )

    async def sample(self, observation: Observation, n: int, *, seed: int = -1) -> SampleOutput:
        """``n`` samples for one observation, with their log-probs (and values)."""
        if n < 1:
            raise ValueError(f"n: {n} must be >= 1")
        return await self.act([observation] * n, seed=seed)
