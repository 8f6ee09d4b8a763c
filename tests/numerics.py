"""Comparing a tenant's numbers grouped and alone, bitwise where this machine allows it.

DESIGN §3: a tenant's trajectory is the same grouped or alone "within floating-point
tolerance, bitwise where deterministic". Whether a sample's forward gives the same bits alone
as beside other samples depends on the machine (:mod:`vla.numerics`); the equivalence tests
ask for the same bits where :func:`~vla.numerics.batch_invariant` holds, and for float32
rounding (:data:`RTOL`, :data:`STATE_RTOL`) elsewhere. Comparisons of runs whose
batches have the same shapes (a tenant's NaN beside the same batch-mates) stay bitwise
everywhere.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from vla.numerics import batch_invariant
from vla.slot import StepResult

#: Float32 rounding between a grouped and a lone run where the bits may differ, relative to
#: the compared tensor's largest value (a sum's rounding error scales with its terms, so an
#: element near zero is held to its tensor's scale, not to its own size). Observed: ~1e-7.
#: Losses and grad norms are held to it too: they are what the parameters compute.
RTOL = 1e-5
#: Parameters and optimizer moments after several AdamW steps, as one vector per group
#: (``module``, ``optimizer``): the relative 2-norm of their difference. Looser, because
#: AdamW turns rounding noise in a gradient that is zero in exact arithmetic (an attention
#: key's bias: the softmax ignores it) into steps of the learning rate's size, so the runs
#: drift apart along directions the loss does not see. Observed: up to 2.4e-4 after 5 steps.
STATE_RTOL = 1e-3


def assert_same(actual: torch.Tensor, expected: torch.Tensor, what: str = "") -> None:
    """``actual`` is ``expected``: the same bits where :func:`batch_invariant`, else equal up
    to float32 rounding (:data:`RTOL` of ``expected``'s largest finite value; same shape,
    dtype and non-finite values)."""
    if batch_invariant():
        assert torch.equal(actual, expected), f"{what}: not the same bits"
        return
    assert_rounding_apart(actual, expected, what)


def assert_rounding_apart(actual: torch.Tensor, expected: torch.Tensor, what: str = "") -> None:
    """``actual`` and ``expected`` are equal up to float32 rounding: :data:`RTOL` of
    ``expected``'s largest finite value (same shape, dtype and non-finite values), whatever
    the machine (for computations that are not bitwise anywhere, such as a forward on
    several threads)."""
    actual, expected = actual.detach(), expected.detach()
    finite = expected[torch.isfinite(expected)]
    scale = float(finite.abs().max()) if finite.numel() else 0.0
    torch.testing.assert_close(
        actual,
        expected,
        rtol=RTOL,
        atol=RTOL * scale,
        equal_nan=True,
        msg=lambda m: f"{what}: {m}",
    )


def assert_same_results(
    actual: Sequence[StepResult | Exception],
    expected: Sequence[StepResult | Exception],
    what: str = "",
) -> None:
    """Step results alike: lr and step exactly, loss and grad norm as :func:`assert_same`;
    failures of the same type where the reference failed."""
    assert len(actual) == len(expected), (what, actual, expected)
    if batch_invariant():
        assert list(actual) == list(expected), what
        return
    for i, (a, e) in enumerate(zip(actual, expected, strict=True)):
        if not isinstance(e, StepResult):
            assert type(a) is type(e), (what, i, a, e)
            continue
        assert isinstance(a, StepResult), (what, i, a)
        assert (a.lr, a.step) == (e.lr, e.step), (what, i, a, e)
        for name in ("loss", "grad_norm"):
            got, want = getattr(a, name), getattr(e, name)
            assert math.isclose(got, want, rel_tol=RTOL), (what, i, name, a, e)


def assert_same_state(
    actual: Mapping[str, Any], expected: Mapping[str, Any], what: str = ""
) -> None:
    """Two slots' snapshots (nested dicts of tensors and counters) alike: the same bits where
    :func:`batch_invariant`, else each top-level group's floating-point tensors (``module``:
    the parameters; ``optimizer``: the moments) within :data:`STATE_RTOL` as one vector, with
    non-finite values in the same places. Everything else (the RNG state, counters, shapes)
    is always compared exactly."""
    assert actual.keys() == expected.keys(), what
    for key in actual:
        pairs: list[tuple[str, torch.Tensor, torch.Tensor]] = []
        _compare_exactly(actual[key], expected[key], str(key), pairs)
        if not pairs:
            continue
        where = f"{what}: {key}"
        if batch_invariant():
            for name, a, e in pairs:
                assert torch.equal(a, e), f"{what}: {name}: not the same bits"
            continue
        for name, a, e in pairs:
            assert torch.equal(a.isfinite(), e.isfinite()), f"{what}: {name}: non-finite values"
        a_all = torch.cat([a[a.isfinite()].double() for _, a, _ in pairs])
        e_all = torch.cat([e[e.isfinite()].double() for _, _, e in pairs])
        apart, size = float((a_all - e_all).norm()), float(e_all.norm())
        assert apart <= STATE_RTOL * size, (
            f"{where}: relative difference {apart / size if size else math.inf:.3g} "
            f"over {STATE_RTOL}"
        )


def _compare_exactly(
    a: Any, e: Any, where: str, floats: list[tuple[str, torch.Tensor, torch.Tensor]]
) -> None:
    """Compare everything but floating-point tensors exactly; collect those (same shapes) in
    ``floats``, flattened, for the caller to compare."""
    if isinstance(a, Mapping):
        assert isinstance(e, Mapping) and a.keys() == e.keys(), where
        for key in a:
            _compare_exactly(a[key], e[key], f"{where}.{key}", floats)
    elif isinstance(a, torch.Tensor) and a.is_floating_point():
        assert isinstance(e, torch.Tensor) and a.shape == e.shape, where
        floats.append((where, a.detach().flatten(), e.detach().flatten()))
    elif isinstance(a, torch.Tensor):
        assert torch.equal(a, e), where
    else:
        assert a == e, where


__all__ = [
    "RTOL",
    "STATE_RTOL",
    "assert_rounding_apart",
    "assert_same",
    "assert_same_results",
    "assert_same_state",
    "batch_invariant",
]
