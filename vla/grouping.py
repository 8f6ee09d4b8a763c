"""Group batching: one backbone forward for several tenants' compatible samples.

Requests whose inputs share a :class:`~vla.feature.CompatKey` have identical per-sample tensor
shapes, so a group is a concatenation along the batch dimension. Per group:

1. concatenate the tenants' backbone ``tensors`` (proprio is *not* concatenated: tenants'
   proprio dims may differ and the backbone does not read it);
2. run ONE frozen ``backbone.encode`` (inference mode inside the backbone);
3. partition the :class:`~vla.feature.VLAFeature` back by tenant (views, no copies), each with
   its own proprio;
4. training: one head forward and backward per head *architecture* for all the tenants that
   share it (:mod:`vla.batched`: parameters stacked, each layer one batched kernel), each
   tenant's randomness from its own :class:`~vla.slot.TenantSlot` generator; one multi-tensor
   clip + AdamW step for all of them with each tenant's own hyper-parameters and schedule
   (:mod:`vla.multiopt`). Inference: ``act`` per tenant.

Failures are values, not crashes: a tenant whose step raises (bad shapes, NaN loss, a bug in
its head) gets the exception as its result and every other tenant proceeds. If a group's
concatenated forward itself fails, the group falls back to one forward per tenant, so a
malformed input only fails its own tenant.

:func:`serial_train_step` / :func:`serial_act` run one backbone forward per tenant: the
reference a grouped trajectory must match (DESIGN §3).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol, TypeVar

import torch

from vla.batched import PolicyGradient, TrainMode, train_steps
from vla.feature import CompatKey, ModelInputs, VLAFeature
from vla.heads import ActOutput
from vla.slot import StepResult, TenantSlot


class FeatureEncoder(Protocol):
    """What grouping needs of a backbone (:class:`vla.backbone.Backbone` is one)."""

    def encode(self, inputs: ModelInputs) -> VLAFeature:
        """One frozen forward over the whole batch."""
        ...


@dataclass
class TrainRequest:
    """One tenant's micro-batch: normalised inputs and target action chunks; ``mode`` and
    ``objective`` as in :func:`vla.batched.train_steps` (a low-level call's)."""

    tenant: str
    slot: TenantSlot
    inputs: ModelInputs
    actions_B_C_A: torch.Tensor
    mode: TrainMode = "step"
    objective: PolicyGradient | None = None


@dataclass
class ActRequest:
    """One tenant's inference batch; actions are sampled with the slot's own generator."""

    tenant: str
    slot: TenantSlot
    inputs: ModelInputs
    deterministic: bool = False


@dataclass(frozen=True)
class Phase:
    """A timed part of a grouped step (for its trace): a backbone forward over ``tenants``'
    ``samples``, or the heads and optimizer step. Times are epoch nanoseconds."""

    name: str
    start_ns: int
    end_ns: int
    tenants: tuple[str, ...]
    samples: int


class _Request(Protocol):
    @property
    def tenant(self) -> str: ...
    @property
    def inputs(self) -> ModelInputs: ...


R = TypeVar("R", bound=_Request)
T = TypeVar("T")


def group_by_key(requests: Sequence[R]) -> list[list[R]]:
    """Requests grouped by compatibility key, groups and members in first-seen order.

    Raises ``ValueError`` if a tenant appears twice (results are keyed by tenant).
    """
    seen: set[str] = set()
    groups: dict[CompatKey, list[R]] = {}
    for r in requests:
        if r.tenant in seen:
            raise ValueError(f"tenant {r.tenant!r} appears twice in one grouped call")
        seen.add(r.tenant)
        groups.setdefault(r.inputs.key, []).append(r)
    return list(groups.values())


def encode_group(backbone: FeatureEncoder, parts: Sequence[ModelInputs]) -> list[VLAFeature]:
    """One backbone forward over same-key ``parts``, partitioned back into one feature each.

    The returned features are views of the grouped prefix; each carries its own part's proprio.
    """
    tensors = ModelInputs.concat_tensors(parts)
    sizes = [p.batch_size for p in parts]
    # The backbone only passes proprio through; give it an empty one of the right batch size.
    empty_proprio_N_0 = torch.zeros(sum(sizes), 0)
    grouped = backbone.encode(ModelInputs(parts[0].key, tensors, empty_proprio_N_0))
    device = grouped.prefix_B_T_D.device
    return grouped.split(sizes, [p.proprio_B_P.to(device) for p in parts])


def encode_each(
    backbone: FeatureEncoder, parts: Sequence[ModelInputs]
) -> list[VLAFeature | Exception]:
    """Grouped features for same-key ``parts``; if the grouped forward fails, one forward per
    part so that only the part whose input is at fault gets the error.

    A failure that says it is ``retryable`` (a backbone role that did not answer, a busy
    device) is no part's fault: every part gets it at once, since a forward per part would
    only wait it out again, once for each."""
    try:
        return list(encode_group(backbone, parts))
    except Exception as exc:  # noqa: BLE001 - retried per part below; each failure is reported there
        if getattr(exc, "retryable", False) is True:
            return [exc] * len(parts)
    out: list[VLAFeature | Exception] = []
    for part in parts:
        try:
            out.append(backbone.encode(part))
        except Exception as e:  # noqa: BLE001 - a per-part failure is that part's result
            out.append(e)
    return out


def _encode_isolated(
    backbone: FeatureEncoder, group: Sequence[_Request]
) -> list[VLAFeature | Exception]:
    return encode_each(backbone, [r.inputs for r in group])


def _run_grouped(
    backbone: FeatureEncoder,
    requests: Sequence[R],
    per_tenant: Callable[[R, VLAFeature], T],
) -> dict[str, T | Exception]:
    results: dict[str, T | Exception] = {}
    for group in group_by_key(requests):
        features = _encode_isolated(backbone, group)
        for r, feature in zip(group, features, strict=True):
            results[r.tenant] = _capture(per_tenant, r, feature)
    return results


def _run_serial(
    backbone: FeatureEncoder,
    requests: Sequence[R],
    per_tenant: Callable[[R, VLAFeature], T],
) -> dict[str, T | Exception]:
    group_by_key(requests)  # same duplicate-tenant check as the grouped path
    results: dict[str, T | Exception] = {}
    for r in requests:
        try:
            feature: VLAFeature | Exception = backbone.encode(r.inputs)
        except Exception as e:  # noqa: BLE001 - a per-tenant failure is that tenant's result
            feature = e
        results[r.tenant] = _capture(per_tenant, r, feature)
    return results


def _capture(
    fn: Callable[[R, VLAFeature], T], request: R, feature: VLAFeature | Exception
) -> T | Exception:
    if isinstance(feature, Exception):
        return feature
    try:
        return fn(request, feature)
    except Exception as e:  # noqa: BLE001 - one tenant's failure must not stop the others
        return e


def _train(r: TrainRequest, feature: VLAFeature) -> StepResult:
    return r.slot.train_step(feature, r.actions_B_C_A)


def _act(r: ActRequest, feature: VLAFeature) -> ActOutput:
    return r.slot.act(feature, deterministic=r.deterministic)


def group_train_step(
    backbone: FeatureEncoder,
    requests: Sequence[TrainRequest],
    batch_heads: bool = True,
    timeline: list[Phase] | None = None,
) -> dict[str, StepResult | Exception]:
    """One optimizer step per tenant, sharing one backbone forward per compatibility key,
    one head forward/backward per head architecture (:func:`vla.batched.train_steps`; with
    ``batch_heads=False`` one per tenant) and one multi-tensor clip + AdamW step.

    Returns each tenant's :class:`StepResult`, or the exception its step raised (the slot is
    then unchanged; see :meth:`TenantSlot.train_step`). ``timeline``, if given, gets a
    :class:`Phase` per backbone forward and one for the heads and optimizer.
    """
    results: dict[str, StepResult | Exception] = {}
    ready: list[tuple[TrainRequest, VLAFeature]] = []
    for group in group_by_key(requests):
        forward_start_ns = time.time_ns()
        features = _encode_isolated(backbone, group)
        if timeline is not None:
            timeline.append(
                Phase(
                    "backbone forward",
                    forward_start_ns,
                    time.time_ns(),
                    tuple(r.tenant for r in group),
                    sum(r.inputs.batch_size for r in group),
                )
            )
        for r, feature in zip(group, features, strict=True):
            if isinstance(feature, Exception):
                results[r.tenant] = feature
            else:
                ready.append((r, feature))
    heads_start_ns = time.time_ns()
    steps = train_steps(
        [r.slot for r, _ in ready],
        [f for _, f in ready],
        [r.actions_B_C_A for r, _ in ready],
        batch_heads=batch_heads,
        modes=[r.mode for r, _ in ready],
        objectives=[r.objective for r, _ in ready],
    )
    if timeline is not None:
        timeline.append(
            Phase(
                "heads and optimizer",
                heads_start_ns,
                time.time_ns(),
                tuple(r.tenant for r, _ in ready),
                sum(r.inputs.batch_size for r, _ in ready),
            )
        )
    for (r, _), step in zip(ready, steps, strict=True):
        results[r.tenant] = step
    return {r.tenant: results[r.tenant] for r in requests}


def serial_train_step(
    backbone: FeatureEncoder, requests: Sequence[TrainRequest]
) -> dict[str, StepResult | Exception]:
    """Reference for :func:`group_train_step`: one backbone forward per tenant."""
    return _run_serial(backbone, requests, _train)


def group_act(
    backbone: FeatureEncoder, requests: Sequence[ActRequest]
) -> dict[str, ActOutput | Exception]:
    """Each tenant's actions (no grad), sharing one backbone forward per compatibility key."""
    return _run_grouped(backbone, requests, _act)


def serial_act(
    backbone: FeatureEncoder, requests: Sequence[ActRequest]
) -> dict[str, ActOutput | Exception]:
    """Reference for :func:`group_act`: one backbone forward per tenant."""
    return _run_serial(backbone, requests, _act)
