"""The compute of one scheduled batch: normalise, ONE backbone forward per compatibility key,
partition, per-policy head act. Pure torch, run in a worker thread by the service.

Requests are grouped by their :class:`~vla.feature.CompatKey` (same backbone, views, token
budget): each group is one :func:`vla.grouping.encode_group` call, or, with a cost table
(:mod:`vla.costmodel`), as many calls over consecutive requests as make the group fastest (a
forward past the backbone's measured knee is slower per sample than smaller ones). The heads
then act per policy: requests of one policy version that draw from the slot's own generator
(``seed`` -1) and agree on ``deterministic`` share one head call; a request with ``seed >= 0``
gets a head call with a generator seeded by it, so its actions depend on nothing but its seed,
policy and observations (up to float rounding where the CPU's kernels are not batch-invariant:
its backbone forward is grouped with whatever shares its batch). One request's failure (bad
input) is that request's result; it never fails the batch.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from bus.errors import PoisonError
from schemas.infer import ActRequest
from schemas.tensor import TensorError
from services.inferencer.policies import ServedPolicy
from vla.backbone import Backbone
from vla.costmodel import CostTable
from vla.feature import CompatKey, ModelInputs, VLAFeature
from vla.grouping import FeatureEncoder, encode_each
from vla.heads import ActOutput
from vla.normalize import Normaliser, Normalisers

#: Errors of normalising a request's observations: the request itself is bad (shapes,
#: dtypes), reported to its sender and never retried. Errors of the forward or the head are
#: not the request's (a backbone role's bad feature record, a head that does not fit): the
#: runtime retries them and says so.
REQUEST_ERRORS: tuple[type[Exception], ...] = (ValueError, TensorError)


@dataclass
class Work:
    """One admitted request and the policy version serving it."""

    request: ActRequest
    policy: ServedPolicy


@dataclass
class Outcome:
    """A request's result: arrays (float32; ``values`` None without a value head) or the
    exception that stopped it. ``group_size``: requests in its backbone forward."""

    actions_B_C_A: np.ndarray | None = None
    log_prob_B: np.ndarray | None = None
    value_B: np.ndarray | None = None
    error: Exception | None = None
    group_size: int = 1


@dataclass
class BatchStats:
    """What one :meth:`BatchRunner.run` did."""

    forwards: int = 0
    observations: int = 0
    seconds: float = 0.0


def act_with(
    policy: ServedPolicy, feature: VLAFeature, deterministic: bool, seed: int
) -> ActOutput:
    """The policy's actions for ``feature``: with the slot's own generator for ``seed`` < 0,
    else with a fresh generator seeded by ``seed`` (reproducible)."""
    if seed < 0:
        return policy.slot.act(feature, deterministic=deterministic)
    generator = torch.Generator(device=policy.slot.device)
    generator.manual_seed(seed)
    module = policy.slot.module
    module.eval()
    with torch.no_grad():
        return module.act(feature, generator=generator, deterministic=deterministic)


def _cat_features(features: Sequence[VLAFeature]) -> VLAFeature:
    return VLAFeature(
        torch.cat([f.prefix_B_T_D for f in features]),
        torch.cat([f.mask_B_T for f in features]),
        torch.cat([f.proprio_B_P for f in features]),
    )


def _split_output(out: ActOutput, sizes: Sequence[int]) -> list[ActOutput]:
    actions = torch.split(out.actions_B_C_A, list(sizes))
    log_probs = torch.split(out.log_prob_B, list(sizes))
    values: Sequence[torch.Tensor | None] = (
        torch.split(out.value_B, list(sizes)) if out.value_B is not None else [None] * len(sizes)
    )
    return [ActOutput(a, lp, v) for a, lp, v in zip(actions, log_probs, values, strict=True)]


def _numpy(t: torch.Tensor) -> np.ndarray:
    return np.ascontiguousarray(t.detach().to("cpu", torch.float32).numpy())


class BatchRunner:
    """Runs batches on one backbone. Not thread-safe: the service calls :meth:`run` from
    one worker thread at a time (normalisers cache tokenisations without locks).

    ``costs``: the backbone's cost table; a compatible group is split where it says so
    (None: one forward per compatibility key). ``encoder``: what runs the forwards (default
    the backbone; the backbone role's :class:`vla.wire.WireEncoder` with
    ``--backbone-service``, the backbone then only normalising)."""

    def __init__(
        self,
        backbone: Backbone,
        costs: CostTable | None = None,
        encoder: FeatureEncoder | None = None,
    ) -> None:
        self.backbone = backbone
        self.costs = costs
        self.encoder: FeatureEncoder = encoder or backbone
        self._normalisers = Normalisers(backbone)

    def normaliser(self, num_views: int, token_budget: int) -> Normaliser:
        return self._normalisers.get(num_views, token_budget)

    def run(self, batch: Sequence[Work]) -> tuple[list[Outcome], BatchStats]:
        """Outcomes in ``batch`` order and what it cost."""
        t0 = time.perf_counter()
        stats = BatchStats()
        outcomes = [Outcome() for _ in batch]
        inputs: dict[int, ModelInputs] = {}
        for i, work in enumerate(batch):
            r = work.request
            try:
                norm = self.normaliser(r.num_views, r.token_budget)
                inputs[i] = norm.normalise(r.observations)
            except REQUEST_ERRORS as exc:
                outcomes[i].error = PoisonError(f"bad observation for {work.policy.label}: {exc}")

        groups: dict[CompatKey, list[int]] = {}
        for i, inp in inputs.items():
            groups.setdefault(inp.key, []).append(i)
        features: dict[int, VLAFeature] = {}
        for members in (part for g in groups.values() for part in self._split(g, inputs)):
            stats.forwards += 1
            stats.observations += sum(inputs[i].batch_size for i in members)
            for i, feature in zip(members, self._encode(members, inputs), strict=True):
                outcomes[i].group_size = len(members)
                if isinstance(feature, Exception):
                    outcomes[i].error = feature
                else:
                    features[i] = feature

        for members, merged in self._act_sets(batch, features):
            for i, out in zip(members, merged, strict=True):
                if isinstance(out, Exception):
                    outcomes[i].error = out
                    continue
                outcomes[i].actions_B_C_A = _numpy(out.actions_B_C_A)
                outcomes[i].log_prob_B = _numpy(out.log_prob_B)
                outcomes[i].value_B = None if out.value_B is None else _numpy(out.value_B)
        stats.seconds = time.perf_counter() - t0
        return outcomes, stats

    def _split(self, members: list[int], inputs: dict[int, ModelInputs]) -> list[list[int]]:
        """The forwards one compatible group runs in: consecutive requests, by the table."""
        if self.costs is None or len(members) == 1:
            return [members]
        tokens = int(inputs[members[0]].tensors["input_ids"].shape[1])
        sizes = [inputs[i].batch_size for i in members]
        return [[members[j] for j in part] for part in self.costs.split(sizes, tokens)]

    def _encode(
        self, members: list[int], inputs: dict[int, ModelInputs]
    ) -> list[VLAFeature | Exception]:
        """One grouped forward; if it fails, one forward per request so the failure lands
        only on the request at fault."""
        return encode_each(self.encoder, [inputs[i] for i in members])

    def _act_sets(
        self, batch: Sequence[Work], features: dict[int, VLAFeature]
    ) -> list[tuple[list[int], list[ActOutput | Exception]]]:
        """Head calls: unseeded requests of one policy version (and determinism) share one."""
        sets: dict[tuple[int, bool, int], list[int]] = {}
        for i in features:
            r = batch[i].request
            # Seeded requests stay alone: their generator is theirs (index i keeps keys apart).
            merge = -1 if r.seed < 0 else i
            sets.setdefault((id(batch[i].policy.slot), r.deterministic, merge), []).append(i)
        results: list[tuple[list[int], list[ActOutput | Exception]]] = []
        for members in sets.values():
            results.append((members, self._act(batch, features, members)))
        return results

    def _act(
        self, batch: Sequence[Work], features: dict[int, VLAFeature], members: list[int]
    ) -> list[ActOutput | Exception]:
        first = batch[members[0]]
        if len(members) > 1:
            try:
                out = act_with(
                    first.policy,
                    _cat_features([features[i] for i in members]),
                    first.request.deterministic,
                    -1,
                )
                return list(_split_output(out, [features[i].batch_size for i in members]))
            except Exception:  # noqa: BLE001 - retried per request below, reported there
                pass
        results: list[ActOutput | Exception] = []
        for i in members:
            r = batch[i].request
            try:
                results.append(act_with(batch[i].policy, features[i], r.deterministic, r.seed))
            except Exception as exc:  # noqa: BLE001 - this request's result
                results.append(exc)
        return results
