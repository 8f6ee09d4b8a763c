"""A tenant's parameters, AdamW moments and gradients as flat tensors.

:func:`flatten_parameters` moves a head's parameters into one flat tensor (each parameter a
view of it) and :func:`register_flat` records the optimizer built over them; the shared
AdamW step (:mod:`vla.multiopt`) then keeps the moments flat too and updates a tenant as a
few runs of parameters. :func:`assign_grads` gives the parameters their gradients as views
of one flat row (what a batched backward computes), which the shared clip and AdamW step
read as one tensor while the gradients are still those views.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

__all__ = ["FlatParams", "assign_grads", "flat_of", "flatten_parameters", "register_flat"]


@dataclass
class FlatParams:
    """An optimizer whose parameters are views of one flat tensor, in its param order."""

    params: list[Tensor]
    #: Where each parameter starts in the flat tensors, and (last) their total length.
    offsets: list[int]
    param_flat: Tensor
    #: The flat moments once a flat step made them; each parameter's state holds views.
    exp_avg: Tensor | None = None
    exp_avg_sq: Tensor | None = None
    #: Each parameter's views of the flat moments, as put in its state (None: not yet).
    moment_views: list[tuple[Tensor, Tensor] | None] = field(default_factory=list)
    #: The gradient views :func:`assign_grads` gave the parameters, held weakly (None for
    #: a parameter it left without one), so a dropped gradient frees its row.
    grad_views: list[weakref.ref[Tensor] | None] = field(default_factory=list)

    def flat_grad(self) -> Tensor | None:
        """The flat gradient row :func:`assign_grads` wrote, if every parameter's ``grad``
        is still the view it gave (or None where it gave none); else None."""
        views = self.grad_views
        if len(views) != len(self.params):
            return None
        first: Tensor | None = None
        at = 0
        for i, (p, ref) in enumerate(zip(self.params, views, strict=True)):
            grad = p.grad
            if ref is None:
                if grad is not None:
                    return None
                continue
            if grad is None or grad is not ref():
                return None
            if first is None:
                first, at = grad, self.offsets[i]
        if first is None:
            return None
        # The row itself was not kept (it would outlive the gradients): the same memory,
        # seen from its first gradient's storage.
        return first.as_strided((self.offsets[-1],), (1,), first.storage_offset() - at)


#: Optimizers over flat parameters (:func:`register_flat` registers them).
_FLAT: weakref.WeakKeyDictionary[torch.optim.Optimizer, FlatParams] = weakref.WeakKeyDictionary()
#: The same records by the ``id`` of their first parameter, for callers that hold the
#: parameters only (tensors compare elementwise, so they cannot be weak-dict keys; a record
#: lives as long as its optimizer, and :func:`flat_of` checks identity against reused ids).
_FLAT_BY_PARAM: weakref.WeakValueDictionary[int, FlatParams] = weakref.WeakValueDictionary()


@torch.no_grad()
def flatten_parameters(module: nn.Module) -> Tensor | None:
    """Move ``module``'s parameters into one flat tensor, each parameter a view of it (same
    values, same ``Parameter`` objects), and return it. Build the optimizer afterwards and
    :func:`register_flat` it. Parameters of several dtypes or devices are left as they are
    (None)."""
    params = list(module.parameters())
    if not params or len({(p.dtype, p.device) for p in params}) != 1:
        return None
    flat = torch.cat([p.detach().reshape(-1) for p in params])
    at = 0
    for p in params:
        n = p.numel()
        p.data = flat[at : at + n].view_as(p)
        at += n
    return flat


def register_flat(optimizer: torch.optim.Optimizer, flat: Tensor) -> bool:
    """Let :func:`vla.multiopt.adamw_step` update ``optimizer`` through flat tensors: its
    parameters must be, in order, the views of ``flat`` :func:`flatten_parameters` made.
    Returns whether it is registered."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    if len(optimizer.param_groups) != 1 or not views_in_order(params, flat):
        return False
    offsets = [0]
    for p in params:
        offsets.append(offsets[-1] + p.numel())
    record = FlatParams(params, offsets, flat)
    _FLAT[optimizer] = record
    _FLAT_BY_PARAM[id(params[0])] = record
    return True


def flat_of(params: Sequence[Tensor]) -> FlatParams | None:
    """The flat record whose parameters are exactly ``params`` (in order), if any."""
    if not params:
        return None
    fl = _FLAT_BY_PARAM.get(id(params[0]))
    if fl is None or len(fl.params) != len(params):
        return None
    for a, b in zip(fl.params, params, strict=True):
        if a is not b:
            return None
    return fl


@torch.no_grad()
def assign_grads(params: Sequence[Tensor], row: Tensor, present: Sequence[bool]) -> None:
    """Give each parameter ``p`` with ``present`` its gradient as a view of ``row``, one
    contiguous tensor laid out as :func:`flatten_parameters` lays out the parameters (a
    parameter without ``present`` keeps ``grad`` None; its span of ``row`` must be zero).

    For parameters a flat optimizer holds (:func:`register_flat`), the row is remembered:
    while their ``grad`` are these views, :func:`vla.multiopt.clip_grad_norms` takes the
    tenant's norm as one norm of the row and :func:`vla.multiopt.adamw_step` reads the row
    instead of gathering the gradients.
    """
    need = sum(p.numel() for p in params)
    if row.dim() != 1 or row.numel() != need or not row.is_contiguous():
        raise ValueError(
            f"gradient row of shape {tuple(row.shape)} for {need} parameter elements "
            "(expected one contiguous dimension of that length)"
        )
    views: list[weakref.ref[Tensor] | None] = []
    at = 0
    for p, has in zip(params, present, strict=True):
        n = p.numel()
        if has:
            view = row[at : at + n].view_as(p)
            p.grad = view
            views.append(weakref.ref(view))
        else:
            p.grad = None
            views.append(None)
        at += n
    fl = flat_of(params)
    if fl is not None:
        fl.grad_views = views


def flat_of_optimizer(optimizer: torch.optim.Optimizer) -> FlatParams | None:
    """The flat record :func:`register_flat` made for ``optimizer``, if any."""
    return _FLAT.get(optimizer)


def views_in_order(params: Sequence[Tensor], flat: Tensor) -> bool:
    """Whether ``params`` are, in order, contiguous views covering ``flat`` exactly."""
    base, size = flat.data_ptr(), flat.element_size()
    at = 0
    for p in params:
        if p.data_ptr() != base + at * size or not p.is_contiguous():
            return False
        at += p.numel()
    return at == flat.numel()
