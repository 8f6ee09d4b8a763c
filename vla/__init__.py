"""The model core: backbone, features, heads, tenant slots, group batching."""

import os

# On AVX-512 CPUs MKL picks its batched-GEMM kernels by batch size, so one tenant's slice of a
# stacked head step would change with the tenants stacked beside it (DESIGN §3 asks for the
# same bits alone or grouped). MKL's conditional bitwise reproducibility pinned to its AVX2
# branch keeps them batch-independent on many such CPUs, not all (tests/numerics.py asks the
# machine; elsewhere grouped and alone agree to float32 rounding, as DESIGN §3 allows); an
# operator who sets MKL_CBWR keeps theirs. It must be set before MKL's first call, hence here.
os.environ.setdefault("MKL_CBWR", "AVX2")
