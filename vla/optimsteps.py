"""A low-level ``optim_step`` for many tenants at once: each slot's accumulated gradients
(from ``accumulate`` calls of :func:`vla.batched.train_steps`) clipped and stepped with the
AdamW hyper-parameters its caller sends, through the same shared clip and AdamW calls as a
grouped SFT step (:mod:`vla.multiopt`)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from vla.multiopt import adamw_step, clip_grad_norms
from vla.slot import NonFiniteLossError, StepResult, TenantSlot

__all__ = ["AdamParams", "optim_steps"]


@dataclass(frozen=True)
class AdamParams:
    """One low-level ``optim_step``'s AdamW hyper-parameters (Tinker's names)."""

    learning_rate: float
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.0
    #: Max global grad norm of the accumulated gradients; 0 disables clipping.
    grad_clip: float = 0.0


def optim_steps(
    slots: Sequence[TenantSlot], params: Sequence[AdamParams]
) -> list[StepResult | Exception]:
    """A low-level ``optim_step`` per slot: clip its accumulated gradients to
    ``params[i].grad_clip``, one AdamW update with ``params[i]``'s hyper-parameters, then
    the gradients are cleared and the slot's step counted. Shared multi-tensor calls as in
    :func:`vla.batched.train_steps`. A slot without gradients gets a ``ValueError``, one
    whose grad norm is not finite a :class:`NonFiniteLossError` (its gradients are
    dropped); neither slot's weights nor optimizer state change."""
    if len(slots) != len(params):
        raise ValueError(
            f"optim_steps needs one AdamParams per slot: {len(slots)} vs {len(params)}"
        )
    results: list[StepResult | Exception | None] = [None] * len(slots)
    ready = []
    for i, slot in enumerate(slots):
        if not slot.has_grads():
            results[i] = ValueError(
                "optim_step: no gradients accumulated since the last step (call forward_backward)"
            )
        else:
            ready.append(i)
    clips = [params[i].grad_clip if params[i].grad_clip > 0 else math.inf for i in ready]
    norms = clip_grad_norms([slots[i].params() for i in ready], clips)
    stepping = []
    for i, norm in zip(ready, norms, strict=True):
        if not math.isfinite(norm):
            # Non-finite gradients are no use to any later step: dropped, like a bad SFT step.
            slots[i].drop_grads()
            results[i] = NonFiniteLossError(slots[i].tenant, slots[i].step, "grad norm", norm)
        else:
            stepping.append((i, norm))
    for i, _ in stepping:
        p = params[i]
        for group in slots[i].optimizer.param_groups:
            group["lr"] = p.learning_rate
            group["betas"] = (p.beta1, p.beta2)
            group["eps"] = p.eps
            group["weight_decay"] = p.weight_decay
    adamw_step([slots[i].optimizer for i, _ in stepping])
    for i, norm in stepping:
        slot = slots[i]
        slot.drop_grads()
        slot.step += 1
        results[i] = StepResult(
            loss=math.nan, grad_norm=norm, lr=params[i].learning_rate, step=slot.step
        )
    out: list[StepResult | Exception] = []
    for r in results:
        assert r is not None
        out.append(r)
    return out
