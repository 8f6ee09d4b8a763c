"""Batched heads: one head forward and backward for several tenants whose heads share an
architecture, and one shared clip + AdamW step for all of a round's tenants.

Heads are small, so run one tenant at a time their cost is per-operation overhead, not
arithmetic. Tenants whose heads have the same architecture (:func:`arch_key`: kind, dims,
chunk length, hidden sizes, dtype, device) and the same batch and prefix shape are stacked:
each parameter name becomes one ``(N, ...)`` tensor, the inputs ``(N, B, ...)``, and the
head's :meth:`~vla.heads.ActionHead.stacked_loss` runs every layer as one batched kernel
(:mod:`vla.heads.stacked`: ``baddbmm`` per linear, fused attention with the tenant dim
folded into the batch). One backward gives the stacked gradients, laid out as one row per
tenant in its flat parameter order; each tenant's ``p.grad`` is a view of its row, which
its clip and AdamW step read as one tensor (:func:`vla.flatparams.assign_grads`). Randomness
is drawn per tenant from its own generator before the call
(:meth:`~vla.heads.ActionHead.draw`), in the order its own step draws it.

A tenant alone runs as a stack of one: the same kernels, and slices of a batched kernel do
not depend on the other slices, so a tenant's losses, gradients and parameters are the same
bits whoever it is stacked with (``tests/test_batched_heads.py``). The head modules' own
``loss`` computes the same function with per-tenant kernels (equal up to rounding).
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch

from vla.feature import VLAFeature
from vla.flatparams import assign_grads
from vla.heads import ActionHead
from vla.heads.stacked import StackedInputs
from vla.multiopt import adamw_step, clip_grad_norms
from vla.slot import NonFiniteLossError, StepResult, TenantSlot, lr_at

__all__ = [
    "PolicyGradient",
    "TrainMode",
    "arch_key",
    "batched_backward",
    "train_steps",
]

#: What a training call does with a tenant's batch: ``step`` (zero grads, loss, backward, clip,
#: AdamW: one SFT step), ``accumulate`` (loss and backward, the gradients added to those the
#: slot already holds: a low-level ``forward_backward``) or ``forward`` (the loss only; the
#: slot, its gradients and its generator are left exactly as they were).
TrainMode = Literal["step", "accumulate", "forward"]


@dataclass(frozen=True)
class PolicyGradient:
    """A policy-gradient objective instead of the head's supervised loss: PPO's clipped
    surrogate ``-mean(min(r * A, clip(r, 1 - clip, 1 + clip) * A))`` with
    ``r = exp(log_prob - old_log_prob)``; without ``old_log_probs_B`` the ratio is taken
    against the current policy (r = 1, the plain REINFORCE gradient ``-mean(A * log_prob)``)."""

    advantages_B: torch.Tensor
    old_log_probs_B: torch.Tensor | None = None
    clip: float = 0.2


@dataclass(frozen=True)
class _Layout:
    """A built head's parameters in module order, their names, and its :func:`arch_key`
    without the batch size: worked out once per module (walking a small head's modules
    every step was a visible part of its step)."""

    params: list[torch.nn.Parameter]
    names: tuple[str, ...]
    key: tuple[object, ...]
    #: Where the head was when the layout was worked out (a move means working it out again).
    device: torch.device
    dtype: torch.dtype


_LAYOUTS: weakref.WeakKeyDictionary[ActionHead, _Layout] = weakref.WeakKeyDictionary()


def _layout(module: ActionHead) -> _Layout:
    """``module``'s :class:`_Layout`; a module moved to another device or dtype is worked
    out again (parameters are never added to or replaced in a built head)."""
    anchor = module.state_token_D
    layout = _LAYOUTS.get(module)
    if layout is None or layout.device != anchor.device or layout.dtype != anchor.dtype:
        named = list(module.named_parameters())
        key = (
            type(module),
            module.config,
            module.hidden_size,
            anchor.device,
            anchor.dtype,
            tuple((n, tuple(p.shape), p.dtype) for n, p in named),
        )
        names = tuple(n for n, _ in named)
        layout = _Layout([p for _, p in named], names, key, anchor.device, anchor.dtype)
        _LAYOUTS[module] = layout
    return layout


def arch_key(module: ActionHead, batch_size: int) -> Hashable:
    """What two tenants' heads and batches must share to run as one batched call: the
    head class and config (kind, dims, chunk length, hidden sizes, ...), the backbone
    width, each parameter's name, shape and dtype, the device, and the local batch size."""
    return (*_layout(module).key, batch_size)


def _ready(t: torch.Tensor, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    # Backbone outputs are inference tensors; stacking copies them into normal ones.
    return t.to(device=device, dtype=dtype)


def batched_backward(
    modules: Sequence[ActionHead],
    features: Sequence[VLAFeature],
    actions: Sequence[torch.Tensor],
    draws: Sequence[tuple[torch.Tensor, ...]],
    wants_grad: Sequence[bool] | None = None,
) -> list[float]:
    """Every tenant's loss from one batched forward, and its gradients from one batched
    backward, written into each module's own ``p.grad`` (views of the stacked gradient).
    A tenant whose ``wants_grad`` is False (a forward-only call) gets its loss only.

    Inputs must already be checked (``check_actions``) and share one :func:`arch_key`;
    ``draws[i]`` is what ``modules[i].draw`` gave for tenant ``i``. A tenant whose loss is
    not finite gets no gradient at all (its ``p.grad`` stay ``None``), and the backward
    does not run through it, so nothing of it reaches the others. Returns the losses.
    """
    n = len(modules)
    if not n or not (len(features) == len(actions) == len(draws) == n):
        raise ValueError(
            f"batched_backward needs one feature, target and draw per module: {n} modules, "
            f"{len(features)} features, {len(actions)} targets, {len(draws)} draws"
        )
    template = modules[0]
    dtype, device = template.state_token_D.dtype, template.state_token_D.device
    layouts = [_layout(m) for m in modules]
    # Leaves of their own (not autograd views of the tenants' parameters): the backward
    # then ends in one gradient per name instead of one accumulation per tenant and name.
    with torch.no_grad():
        params = {
            name: torch.stack([lay.params[j] for lay in layouts]).requires_grad_()
            for j, name in enumerate(layouts[0].names)
        }
    inputs = StackedInputs(
        prefix_N_B_T_D=torch.stack(
            [
                m.see(_ready(f.prefix_B_T_D, dtype, device))
                for m, f in zip(modules, features, strict=True)
            ]
        ),
        mask_N_B_T=torch.stack([f.mask_B_T.to(device).bool() for f in features]),
        proprio_N_B_P=torch.stack(
            [
                m.normalise_proprio(_ready(f.proprio_B_P, dtype, device))
                for m, f in zip(modules, features, strict=True)
            ]
        ),
        actions_N_B_C_A=torch.stack(
            [
                m.normalise_actions(_ready(a, dtype, device))
                for m, a in zip(modules, actions, strict=True)
            ]
        ),
        draws=tuple(torch.stack(list(d)) for d in zip(*draws, strict=True)),
    )
    losses_N = template.stacked_loss(params, inputs)
    values = losses_N.detach().tolist()
    finite = [math.isfinite(v) for v in values]
    if wants_grad is not None:
        finite = [f and w for f, w in zip(finite, wants_grad, strict=True)]
    if any(finite):
        # A non-finite tenant gets a zero upstream gradient; its slice of the gradients is
        # discarded below in any case.
        weights_N = torch.tensor(finite, dtype=losses_N.dtype, device=losses_N.device)
        grads = torch.autograd.grad(
            (losses_N * weights_N).sum(), list(params.values()), allow_unused=True
        )
        # One (N, numel) gradient laid out as each tenant's flat parameters: every tenant's
        # gradients are views of its row, which its clip and AdamW step then read as one
        # tensor (vla.flatparams.assign_grads). A parameter the loss does not use (e.g. the
        # value head) has a zero span and keeps ``grad`` None.
        row_N_F = torch.cat(
            [
                g.reshape(n, -1) if g is not None else p.new_zeros(n, p[0].numel())
                for p, g in zip(params.values(), grads, strict=True)
            ],
            dim=1,
        )
        present = [g is not None for g in grads]
        for i, row_F in enumerate(row_N_F.unbind(0)):
            if finite[i]:
                assign_grads(layouts[i].params, row_F, present)
    return values


@dataclass
class _Live:
    """A tenant's step in progress: its slot, inputs and the RNG state to rewind to."""

    index: int
    slot: TenantSlot
    feature: VLAFeature
    actions_B_C_A: torch.Tensor
    rng_before: torch.Tensor
    mode: TrainMode = "step"
    objective: PolicyGradient | None = None
    #: The gradients the slot held before the call (``accumulate`` / ``forward`` keep them).
    grads_before: list[torch.Tensor | None] = field(default_factory=list)
    loss: float = math.nan
    grad_norm: float = math.nan


def _max_norm(slot: TenantSlot) -> float:
    clip = slot.optim_config.grad_clip
    return clip if clip > 0 else math.inf


def _abandon(live: _Live) -> None:
    """Leave the slot as it was before the step: grads as they were, RNG rewound."""
    live.slot.drop_grads()
    if live.grads_before:
        for p, g in zip(live.slot.module.parameters(), live.grads_before, strict=True):
            p.grad = g
    live.slot.generator.set_state(live.rng_before)


def _merge_grads(live: _Live) -> None:
    """``accumulate``: the call's gradients added to those the slot held before it. They
    stay in the slot between calls, so none may stay a view of the stacked gradient (it
    would keep every stacked tenant's gradient alive)."""
    for p, before in zip(live.slot.module.parameters(), live.grads_before, strict=True):
        if before is None:
            p.grad = None if p.grad is None else p.grad.clone()
        else:
            p.grad = before if p.grad is None else before + p.grad


def _policy_gradient(live: _Live, results: list[StepResult | Exception | None]) -> None:
    """The :class:`PolicyGradient` loss of one tenant and (unless ``forward``) its gradients,
    with the head's own per-tenant kernels (the stacked kernels compute supervised losses)."""
    objective = live.objective
    assert objective is not None
    module = live.slot.module
    device = module.state_token_D.device
    log_prob_B = module.log_prob(live.feature, live.actions_B_C_A)
    advantages_B = objective.advantages_B.to(device=device, dtype=log_prob_B.dtype)
    old_B = objective.old_log_probs_B
    old_B = log_prob_B.detach() if old_B is None else old_B.to(device, log_prob_B.dtype)
    ratio_B = torch.exp(log_prob_B - old_B)
    clipped_B = ratio_B.clamp(1.0 - objective.clip, 1.0 + objective.clip)
    loss = -torch.minimum(ratio_B * advantages_B, clipped_B * advantages_B).mean()
    live.loss = float(loss.detach())
    if not math.isfinite(live.loss):
        _abandon(live)
        results[live.index] = NonFiniteLossError(
            live.slot.tenant, live.slot.step, "loss", live.loss
        )
        return
    if live.mode == "forward":
        return
    params = list(module.parameters())
    for p, g in zip(params, torch.autograd.grad(loss, params, allow_unused=True), strict=True):
        p.grad = g


def _backward(members: list[_Live], results: list[StepResult | Exception | None]) -> None:
    """Draws, then one stacked loss + backward for ``members`` (same :func:`arch_key`),
    booking each loss; a non-finite one fails its own tenant only."""
    draws = [m.slot.module.draw(m.feature.batch_size, m.slot.generator) for m in members]
    losses = batched_backward(
        [m.slot.module for m in members],
        [m.feature for m in members],
        [m.actions_B_C_A for m in members],
        draws,
        [m.mode != "forward" for m in members],
    )
    for m, value in zip(members, losses, strict=True):
        m.loss = value
        if not math.isfinite(value):
            _abandon(m)
            results[m.index] = NonFiniteLossError(m.slot.tenant, m.slot.step, "loss", value)


def _backward_isolated(members: list[_Live], results: list[StepResult | Exception | None]) -> None:
    """:func:`_backward` for the whole stack; if the stacked call itself fails, every member
    runs again as a stack of one (same numbers: see the module docstring), so only a tenant
    at fault fails."""
    try:
        _backward(members, results)
        return
    except Exception as exc:  # noqa: BLE001 - retried per tenant below when there are several
        for m in members:
            _abandon(m)
        if len(members) == 1:
            results[members[0].index] = exc
            return
    for m in members:
        try:
            _backward([m], results)
        except Exception as exc:  # noqa: BLE001 - one tenant's failure is its result
            _abandon(m)
            results[m.index] = exc


def train_steps(
    slots: Sequence[TenantSlot],
    features: Sequence[VLAFeature],
    actions: Sequence[torch.Tensor],
    batch_heads: bool = True,
    modes: Sequence[TrainMode] | None = None,
    objectives: Sequence[PolicyGradient | None] | None = None,
) -> list[StepResult | Exception]:
    """One supervised update per tenant, as :meth:`TenantSlot.train_step` would make it, with
    the heads batched across tenants and one shared clip + AdamW step.

    Tenants whose heads and batches share an :func:`arch_key` (and prefix shape) run one
    stacked forward and backward (:func:`batched_backward`; ``batch_heads=False`` runs each
    tenant as a stack of one, which gives the same bits). Then every tenant's gradients are
    clipped and its AdamW step applied by shared multi-tensor calls (:mod:`vla.multiopt`,
    bit for bit as its own optimizer would).

    ``modes[i]`` (default ``step``; see :data:`TrainMode`) lets a low-level call stop after
    the backward (``accumulate``) or the loss (``forward``); those tenants are stacked with
    the others all the same, and their result's ``grad_norm`` is NaN and ``lr`` 0.
    ``objectives[i]``: a :class:`PolicyGradient` loss instead of the supervised one (run with
    the head's per-tenant kernels).

    A tenant's failure is its result: ``ValueError`` for mis-shaped input,
    :class:`NonFiniteLossError` for a NaN/inf loss or grad norm, or whatever its head raised;
    that slot is left exactly as before (parameters, gradients, optimizer state, RNG, step),
    and the other tenants' steps do not see it.
    """
    n = len(slots)
    modes = list(modes) if modes is not None else ["step"] * n
    objectives = list(objectives) if objectives is not None else [None] * n
    if not (len(features) == len(actions) == len(modes) == len(objectives) == n):
        raise ValueError(
            f"train_steps needs one feature, target, mode and objective per slot: {n} slots, "
            f"{len(features)} features, {len(actions)} targets, {len(modes)} modes, "
            f"{len(objectives)} objectives"
        )
    if len({id(s) for s in slots}) != len(slots):
        raise ValueError("a slot appears twice in one train_steps call")
    results: list[StepResult | Exception | None] = [None] * n
    live: list[_Live] = []
    for i, (slot, feature, target) in enumerate(zip(slots, features, actions, strict=True)):
        try:
            slot.module.check_actions(feature, target)
            objective = objectives[i]
            if objective is not None and objective.advantages_B.shape != (feature.batch_size,):
                raise ValueError(
                    f"advantages: expected shape ({feature.batch_size},), got "
                    f"{tuple(objective.advantages_B.shape)}"
                )
        except Exception as exc:  # noqa: BLE001 - bad input fails its own tenant only
            results[i] = exc
            continue
        if not slot.module.training:  # modes are only ever set on the whole head
            slot.module.train()
        rng_before = slot.generator.get_state()
        grads_before: list[torch.Tensor | None] = []
        if modes[i] != "step":
            grads_before = [p.grad for p in slot.module.parameters()]
        slot.drop_grads()
        live.append(
            _Live(i, slot, feature, target, rng_before, modes[i], objectives[i], grads_before)
        )
    # Which tenants share one batched head call: same architecture, batch and prefix shape.
    batches: dict[Hashable, list[_Live]] = {}
    for m in live:
        if m.objective is not None:
            try:
                _policy_gradient(m, results)
            except Exception as exc:  # noqa: BLE001 - one tenant's failure is its result
                _abandon(m)
                results[m.index] = exc
            continue
        key = (arch_key(m.slot.module, m.feature.batch_size), tuple(m.feature.prefix_B_T_D.shape))
        batches.setdefault(key if batch_heads else id(m), []).append(m)
    for members in batches.values():
        _backward_isolated(members, results)
    for m in live:
        if results[m.index] is not None or m.mode == "step":
            continue
        if m.mode == "forward":
            _abandon(m)  # nothing of the call stays in the slot
        else:
            _merge_grads(m)
        results[m.index] = StepResult(loss=m.loss, grad_norm=math.nan, lr=0.0, step=m.slot.step)
    stepping = [m for m in live if results[m.index] is None]
    try:
        norms = clip_grad_norms(
            [m.slot.params() for m in stepping],
            [_max_norm(m.slot) for m in stepping],
        )
    except Exception as exc:  # noqa: BLE001 - nothing was applied: every tenant gets it
        for m in stepping:
            _abandon(m)
            results[m.index] = exc
        stepping = []
        norms = []
    applied: list[_Live] = []
    for m, norm in zip(stepping, norms, strict=True):
        m.grad_norm = norm
        if not math.isfinite(norm):
            _abandon(m)
            results[m.index] = NonFiniteLossError(m.slot.tenant, m.slot.step, "grad norm", norm)
            continue
        applied.append(m)
    lrs = []
    for m in applied:
        lr = lr_at(m.slot.optim_config, m.slot.step)
        for group in m.slot.optimizer.param_groups:
            group["lr"] = lr
        lrs.append(lr)
    adamw_step([m.slot.optimizer for m in applied])
    for m, lr in zip(applied, lrs, strict=True):
        # Free grads now: memory accounting (nbytes) assumes they exist only during a step.
        m.slot.drop_grads()
        m.slot.step += 1
        results[m.index] = StepResult(loss=m.loss, grad_norm=m.grad_norm, lr=lr, step=m.slot.step)
    out: list[StepResult | Exception] = []
    for r in results:
        assert r is not None
        out.append(r)
    return out
