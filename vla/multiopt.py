"""One optimizer step for many tenants: gradient clipping and AdamW as multi-tensor calls.

A tenant's update is a dozen ``torch._foreach_*`` calls over its few dozen small tensors;
run one tenant at a time, per-call overhead (not arithmetic) is most of the cost. Here the
tensors of every tenant in a round go through each call together, each tenant's own
hyper-parameters travelling as per-tensor scalar lists (``lr``, ``betas``, ``weight_decay``,
``eps``, the clip coefficient). The sequence of operations is exactly that of
``torch.optim.AdamW(foreach=True)`` and ``torch.nn.utils.clip_grad_norm_`` (torch 2.13), so
each tenant's parameters and optimizer state come out bit-for-bit as its own optimizer's step
would leave them (tested against both in ``tests/test_multiopt.py``). State is kept in each
tenant's own ``AdamW.state``, so checkpoints, restores and later per-tenant steps see
nothing different.

Flat buffers: a tenant's parameters can live in one flat tensor (:mod:`vla.flatparams`:
each parameter a view of it; :class:`vla.slot.TenantSlot` does this and registers its
optimizer), and then its AdamW moments are flat tensors too, each parameter's
``exp_avg`` / ``exp_avg_sq`` in ``AdamW.state`` a view of them. Such a tenant enters the
shared calls as a few runs of consecutive parameters (those with a gradient, at one step
count; usually one or two runs), not one tensor per parameter: the same elementwise
arithmetic, so the same bits. A state loaded from a checkpoint is copied into the flat
moments at its first step. Gradients can be flat too (:func:`vla.flatparams.assign_grads`:
each ``p.grad`` a view of one row, as :func:`vla.batched.batched_backward` leaves them);
then a run's gradient is its span of the row (no gathering) and the clip's norm is one norm
of the row.

Supported: the AdamW configuration :class:`vla.slot.TenantSlot` builds (``foreach``, no
``amsgrad`` / ``maximize`` / ``capturable`` / ``fused`` / ``differentiable``, real tensors);
an optimizer outside that is stepped by itself (:func:`adamw_step` says which).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from vla.flatparams import FlatParams, flat_of, flat_of_optimizer, views_in_order

__all__ = ["adamw_step", "clip_grad_norms", "supported"]


#: One param group's AdamW hyper-parameters: (lr, beta1, beta2, weight decay, eps).
Hyper = tuple[float, float, float, float, float]


def _grads(params: Sequence[Tensor]) -> list[Tensor]:
    return [p.grad for p in params if p.grad is not None]


@torch.no_grad()
def clip_grad_norms(
    params_per_tenant: Sequence[Sequence[Tensor]], max_norms: Sequence[float]
) -> list[float]:
    """Clip each tenant's gradients to its own global 2-norm ``max_norms[i]`` (``inf``: no
    clipping) and return each tenant's norm before clipping, as
    ``torch.nn.utils.clip_grad_norm_(params_per_tenant[i], max_norms[i])`` would.

    Gradients given as separate tensors: one ``_foreach_norm`` over every such tenant's
    gradients and one ``_foreach_mul_`` with each tenant's coefficient, the same arithmetic
    as ``clip_grad_norm_`` (the same bits). A tenant whose gradients are still the views of
    one flat row (:func:`vla.flatparams.assign_grads`) gets the row's norm, one kernel
    instead of a norm per tensor and a norm of those: the same value up to float rounding
    (~1e-7 relative: the sum runs in another order, accumulated in float64), and the same
    bits on every call with that layout. A tenant without gradients has norm 0.
    """
    if len(params_per_tenant) != len(max_norms):
        raise ValueError(f"{len(params_per_tenant)} tenants but {len(max_norms)} max norms")
    rows: list[Tensor | None] = []
    grads: list[list[Tensor]] = []
    for ps in params_per_tenant:
        fl = flat_of(ps)
        row = fl.flat_grad() if fl is not None else None
        rows.append(row)
        grads.append([] if row is not None else _grads(ps))
    separate = [g for gs in grads for g in gs]
    norms = list(torch._foreach_norm(separate, 2.0)) if separate else []
    totals: list[Tensor] = []
    at = 0
    for row, gs in zip(rows, grads, strict=True):
        if row is not None:
            # Accumulated in float64: one float32 sum over tens of thousands of squares is
            # off by ~1e-6 relative, the per-tensor norms' by ~1e-8.
            totals.append(torch.linalg.vector_norm(row, 2.0, dtype=torch.float64).to(row.dtype))
            continue
        mine = norms[at : at + len(gs)]
        at += len(gs)
        if not mine:
            totals.append(torch.zeros((), dtype=torch.float32))
            continue
        first = gs[0].device
        totals.append(torch.linalg.vector_norm(torch.stack([n.to(first) for n in mine]), 2.0))
    if not totals:
        return []
    # clip_grad_norm_'s own arithmetic, in the same order: max_norm / (total + 1e-6) is
    # reciprocal(total + 1e-6) * max_norm for a tensor, then clamped to 1.
    coefs = [
        torch.clamp((t + 1e-6).reciprocal() * float(m), max=1.0)
        for t, m in zip(totals, max_norms, strict=True)
    ]
    # One host read for both (a coefficient lives where its total does).
    both = torch.stack([t.to(totals[0].device) for t in (*totals, *coefs)]).tolist()
    values, coef_values = both[: len(totals)], both[len(totals) :]
    by_device: dict[tuple[torch.device, torch.dtype], tuple[list[Tensor], list[float]]] = (
        defaultdict(lambda: ([], []))
    )
    for row, gs, c in zip(rows, grads, coef_values, strict=True):
        for g in [row] if row is not None else gs:
            ts, cs = by_device[(g.device, g.dtype)]
            ts.append(g)
            cs.append(c)
    for ts, cs in by_device.values():
        torch._foreach_mul_(ts, cs)
    return [float(v) for v in values]


def supported(optimizer: torch.optim.Optimizer) -> bool:
    """Whether :func:`adamw_step` can fold ``optimizer``'s step into the shared calls."""
    if type(optimizer) is not torch.optim.AdamW:
        return False
    for group in optimizer.param_groups:
        if (
            group.get("amsgrad")
            or group.get("maximize")
            or group.get("capturable")
            or group.get("fused")
            or group.get("differentiable")
            or torch.is_tensor(group["lr"])
            or not group.get("decoupled_weight_decay", True)
        ):
            return False
        if any(
            torch.is_complex(p) or (p.grad is not None and p.grad.is_sparse)
            for p in group["params"]
        ):
            return False
    return True


def _scalar_dtype() -> torch.dtype:
    return torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32


@torch.no_grad()
def adamw_step(optimizers: Sequence[torch.optim.AdamW]) -> None:
    """``opt.step()`` for every optimizer in ``optimizers``, as shared multi-tensor calls.

    Each optimizer's param groups keep their own ``lr`` (set it before, as a schedule does),
    ``betas``, ``weight_decay`` and ``eps``; parameters without a gradient are skipped, state
    is created on first use exactly as ``AdamW`` creates it. An optimizer :func:`supported`
    rejects is stepped on its own.
    """
    params: list[Tensor] = []
    grads: list[Tensor] = []
    exp_avgs: list[Tensor] = []
    exp_avg_sqs: list[Tensor] = []
    steps: list[Tensor] = []
    hyper: list[Hyper] = []
    runs: list[_Run] = []
    for opt in optimizers:
        if not supported(opt):
            opt.step()
            continue
        fl = flat_of_optimizer(opt)
        found = _flat_runs(opt, fl) if fl is not None else None
        if found is not None:
            runs.extend(found)
            continue
        for group in opt.param_groups:
            h = _hyper(group)
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = opt.state[p]
                if len(state) == 0:
                    state["step"] = torch.tensor(0.0, dtype=_scalar_dtype(), device="cpu")
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                params.append(p)
                grads.append(p.grad)
                exp_avgs.append(state["exp_avg"])
                exp_avg_sqs.append(state["exp_avg_sq"])
                steps.append(state["step"])
                hyper.append(h)
    if runs:
        _step_runs(runs)
    if not params:
        return
    groups: dict[tuple[torch.device, torch.dtype], list[int]] = defaultdict(list)
    for i, p in enumerate(params):
        groups[(p.device, p.dtype)].append(i)
    for idx in groups.values():
        _adamw_group(
            [params[i] for i in idx],
            [grads[i] for i in idx],
            [exp_avgs[i] for i in idx],
            [exp_avg_sqs[i] for i in idx],
            [steps[i] for i in idx],
            [hyper[i] for i in idx],
        )


@dataclass
class _Run:
    """Consecutive parameters of one flat optimizer, all with a gradient and at one step
    count: one tensor (a view of the flat parameters and of each flat moment) in the shared
    AdamW calls."""

    optimizer: torch.optim.Optimizer
    flat: FlatParams
    first: int
    end: int
    step: float

    def span(self, t: Tensor) -> Tensor:
        """This run's elements of a flat tensor ``t``."""
        return t[self.flat.offsets[self.first] : self.flat.offsets[self.end]]


def _flat_runs(opt: torch.optim.Optimizer, fl: FlatParams) -> list[_Run] | None:
    """``opt``'s parameters with a gradient as runs of :class:`_Run`, their state made views
    of the flat moments (created fresh as AdamW creates it; a loaded state is copied in); or
    None when the flat buffers no longer hold the parameters (the step then goes per
    tensor)."""
    if not views_in_order(fl.params, fl.param_flat):
        return None
    if fl.exp_avg is None or fl.exp_avg_sq is None:
        fl.exp_avg = torch.zeros_like(fl.param_flat)
        fl.exp_avg_sq = torch.zeros_like(fl.param_flat)
        fl.moment_views = [None] * len(fl.params)
    stepping: list[int] = []
    steps: list[Tensor] = []
    for i, p in enumerate(fl.params):
        if p.grad is None:
            continue  # skipped, as AdamW skips it
        st = opt.state[p]
        views = fl.moment_views[i]
        if (
            views is None
            or len(st) != 3
            or st.get("exp_avg") is not views[0]
            or st.get("exp_avg_sq") is not views[1]
        ):
            if st and set(st) != {"step", "exp_avg", "exp_avg_sq"}:
                return None
            at, n = fl.offsets[i], p.numel()
            avg = fl.exp_avg[at : at + n].view_as(p)
            avg_sq = fl.exp_avg_sq[at : at + n].view_as(p)
            if not st:
                st["step"] = torch.tensor(0.0, dtype=_scalar_dtype(), device="cpu")
                avg.zero_()
                avg_sq.zero_()
            else:
                # A state from elsewhere (a loaded checkpoint): copied into place once.
                avg.copy_(st["exp_avg"])
                avg_sq.copy_(st["exp_avg_sq"])
            st["exp_avg"], st["exp_avg_sq"] = avg, avg_sq
            fl.moment_views[i] = (avg, avg_sq)
        stepping.append(i)
        steps.append(st["step"])
    runs: list[_Run] = []
    run: _Run | None = None
    # One host read for every step count (each parameter keeps its own, as AdamW does).
    values = torch.stack(steps).tolist() if steps else []
    for i, step in zip(stepping, values, strict=True):
        if run is not None and run.end == i and run.step == step:
            run.end = i + 1
        else:
            run = _Run(opt, fl, i, i + 1, step)
            runs.append(run)
    return runs


def _step_runs(runs: list[_Run]) -> None:
    """AdamW over flat runs: every run's per-parameter step counts (kept, as AdamW keeps
    them) advanced by one call, then :func:`_adamw_math` with one tensor per run (its
    span of the flat gradient row when there is one, else its gradients concatenated)."""
    _advance([r.optimizer.state[p]["step"] for r in runs for p in r.flat.params[r.first : r.end]])
    groups: dict[tuple[torch.device, torch.dtype], list[_Run]] = defaultdict(list)
    for r in runs:
        groups[(r.flat.param_flat.device, r.flat.param_flat.dtype)].append(r)
    rows = {id(r.flat): r.flat.flat_grad() for r in runs}
    for members in groups.values():
        hyper = [_hyper(r.optimizer.param_groups[0]) for r in members]
        grads = []
        for r in members:
            row = rows[id(r.flat)]
            if row is not None:
                grads.append(r.span(row))
            else:
                grads.append(
                    torch.cat([_grad(p).reshape(-1) for p in r.flat.params[r.first : r.end]])
                )
        _adamw_math(
            [r.span(r.flat.param_flat) for r in members],
            grads,
            [r.span(r.flat.exp_avg) for r in members],  # type: ignore[arg-type]
            [r.span(r.flat.exp_avg_sq) for r in members],  # type: ignore[arg-type]
            [r.step + 1 for r in members],
            hyper,
        )


def _grad(p: Tensor) -> Tensor:
    assert p.grad is not None  # a run holds parameters with gradients only
    return p.grad


def _hyper(group: dict[str, Any]) -> Hyper:
    """A param group's (lr, beta1, beta2, weight decay, eps)."""
    beta1, beta2 = group["betas"]
    return (float(group["lr"]), float(beta1), float(beta2), group["weight_decay"], group["eps"])


def _advance(steps: list[Tensor]) -> None:
    """AdamW's step counts, one more each (as ``_multi_tensor_adam`` adds it)."""
    if steps[0].is_cpu:
        torch._foreach_add_(steps, torch.tensor(1.0, device="cpu"), alpha=1.0)
    else:
        torch._foreach_add_(steps, 1)


def _adamw_group(
    params: list[Tensor],
    grads: list[Tensor],
    exp_avgs: list[Tensor],
    exp_avg_sqs: list[Tensor],
    steps: list[Tensor],
    hyper: list[Hyper],
) -> None:
    """torch's ``_multi_tensor_adam`` (decoupled weight decay, not capturable) with every
    scalar a per-tensor list: the same kernels in the same order, hence the same bits."""
    _advance(steps)
    _adamw_math(params, grads, exp_avgs, exp_avg_sqs, torch.stack(steps).tolist(), hyper)


def _adamw_math(
    params: list[Tensor],
    grads: list[Tensor],
    exp_avgs: list[Tensor],
    exp_avg_sqs: list[Tensor],
    step_values: list[float],
    hyper: list[Hyper],
) -> None:
    """The update after the step counts advanced (``step_values``: each tensor's count)."""
    lrs = [h[0] for h in hyper]
    beta1s = [h[1] for h in hyper]
    beta2s = [h[2] for h in hyper]
    # A factor of exactly 1.0 (no weight decay) leaves a parameter's bits as they are.
    decay = [1 - lr * wd if wd != 0 else 1.0 for lr, _, _, wd, _ in hyper]
    if any(d != 1.0 for d in decay):
        torch._foreach_mul_(params, decay)
    torch._foreach_lerp_(exp_avgs, grads, [1 - b1 for b1 in beta1s])
    torch._foreach_mul_(exp_avg_sqs, beta2s)
    torch._foreach_addcmul_(exp_avg_sqs, grads, grads, [1 - b2 for b2 in beta2s])
    bias1 = [1 - b1**s for b1, s in zip(beta1s, step_values, strict=True)]
    bias2 = [1 - b2**s for b2, s in zip(beta2s, step_values, strict=True)]
    step_size = [(lr / bc) * -1 for lr, bc in zip(lrs, bias1, strict=True)]
    bias2_sqrt = [bc**0.5 for bc in bias2]
    denom = torch._foreach_sqrt(exp_avg_sqs)
    torch._foreach_div_(denom, bias2_sqrt)
    torch._foreach_add_(denom, [h[4] for h in hyper])
    torch._foreach_addcdiv_(params, exp_avgs, denom, step_size)
