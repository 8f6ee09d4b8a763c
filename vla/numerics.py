"""Whether this machine's kernels give a sample the same bits alone as in a batch.

DESIGN §3: a tenant's trajectory is the same grouped or alone "within floating-point
tolerance, bitwise where deterministic". On some AVX-512 CPUs, even under the ``MKL_CBWR=AVX2``
that :mod:`vla` sets, MKL picks float32 GEMM kernels by the number of rows, and a kernel
blocked another way sums in another order: a sample's features then depend on its batch-mates
by float32 rounding. Whoever compares runs bit for bit (the equivalence tests, ``joynexus
chaos``) asks :func:`batch_invariant` first.
"""

from __future__ import annotations

import functools

import numpy as np
import torch

from vla.backbone import Backbone
from vla.feature import ModelInputs
from vla.normalize import Normaliser

__all__ = ["batch_invariant"]


@functools.cache
def batch_invariant() -> bool:
    """Whether this machine gives a sample the same bits alone as in a batch: the tiny
    backbone's forward of two samples alone and beside four others, a linear layer over 8
    of 24 rows, and a batched matmul over one of three stacks (one thread; asked once per
    process, in about a second)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        backbone = Backbone.load("tiny")
        norm = Normaliser(backbone, num_views=1, token_budget=16)
        rng = np.random.default_rng(0)
        size = norm.key.image_size
        parts = [
            norm.normalise_arrays(
                rng.integers(0, 256, (2, 1, size, size, 3), dtype=np.uint8),
                ["pick up the red block", "open the drawer"],
                np.zeros((2, 0), np.float32),
            )
            for _ in range(3)
        ]
        whole = backbone.encode(ModelInputs.concat(parts))
        first = whole.split([2, 2, 2], [p.proprio_B_P for p in parts])[0]
        if not torch.equal(first.prefix_B_T_D, backbone.encode(parts[0]).prefix_B_T_D):
            return False
        gen = torch.Generator().manual_seed(0)
        x_24_64, w_64_64 = torch.randn(24, 64, generator=gen), torch.randn(64, 64, generator=gen)
        if not torch.equal((x_24_64 @ w_64_64)[:8], x_24_64[:8] @ w_64_64):
            return False
        x_3_8_64, w_3_64_64 = torch.randn(3, 8, 64, generator=gen), torch.randn(3, 64, 64)
        return torch.equal(
            torch.bmm(x_3_8_64, w_3_64_64)[:1], torch.bmm(x_3_8_64[:1], w_3_64_64[:1])
        )
    finally:
        torch.set_num_threads(threads)
