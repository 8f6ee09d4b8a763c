"""The heads' training forward over a stack of tenants: every parameter ``(N, ...)`` (one row
per tenant), every input ``(N, B, ...)``, and each layer one batched kernel for all ``N``.

Heads are small, so a head step's cost is per-operation overhead rather than arithmetic; run
over a stack, ``N`` tenants pay it once. Linear layers are ``baddbmm`` over the tenant dim,
layer norms ``layer_norm`` + one ``addcmul`` for the per-tenant affine, attention folds the
tenant dim into the batch dim of one fused ``scaled_dot_product_attention``. Nothing mixes
rows: tenant ``i``'s outputs and gradients are computed from tenant ``i``'s slice only.

This is the *one* formulation of a training step (:mod:`vla.batched` runs a tenant alone as
a stack of one), so a tenant's numbers do not depend on whom it is stacked with; the
modules' own ``loss`` (used by tests and tools) computes the same function with per-tenant
kernels, equal up to float rounding (``tests/test_batched_heads.py``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

#: Stacked parameters by the module's own parameter name.
Params = Mapping[str, torch.Tensor]


@dataclass
class StackedInputs:
    """``N`` tenants' checked inputs, stacked on a leading tenant dim (same ``B`` and ``T``)."""

    prefix_N_B_T_D: torch.Tensor
    mask_N_B_T: torch.Tensor
    proprio_N_B_P: torch.Tensor
    actions_N_B_C_A: torch.Tensor
    #: What each tenant's ``draw`` gave, stacked per draw (empty for heads without noise).
    draws: tuple[torch.Tensor, ...]


@dataclass
class StackedMemory:
    """The conditioning memory over a stack (see :class:`vla.heads.blocks._Memory`)."""

    tokens_N_B_T_D: torch.Tensor
    state_N_B_1_D: torch.Tensor
    attend_N_B_M: torch.Tensor


def linear(p: Params, name: str, x: torch.Tensor) -> torch.Tensor:
    """``nn.Linear`` ``name`` per tenant: ``x (N, ..., in) -> (N, ..., out)``."""
    w_N_O_I = p[f"{name}.weight"]
    n, shape = x.shape[0], x.shape
    x_N_S_I = x.reshape(n, -1, shape[-1])
    bias = p.get(f"{name}.bias")
    if bias is None:
        out = torch.bmm(x_N_S_I, w_N_O_I.transpose(1, 2))
    else:
        out = torch.baddbmm(bias.unsqueeze(1), x_N_S_I, w_N_O_I.transpose(1, 2))
    return out.reshape(*shape[:-1], w_N_O_I.shape[1])


def _per_tenant(v_N_H: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``(N, H)`` viewed to broadcast against ``like (N, ..., H)``."""
    return v_N_H.view(v_N_H.shape[0], *([1] * (like.dim() - 2)), v_N_H.shape[1])


def layer_norm(p: Params, name: str, x: torch.Tensor) -> torch.Tensor:
    """``nn.LayerNorm`` ``name`` (affine) per tenant over the last dim."""
    h = F.layer_norm(x, (x.shape[-1],))
    w = _per_tenant(p[f"{name}.weight"], x)
    b = _per_tenant(p[f"{name}.bias"], x)
    return torch.addcmul(b, h, w)


def attention(
    p: Params,
    name: str,
    x_N_B_Q_H: torch.Tensor,
    mem_parts: Sequence[torch.Tensor],
    attend_N_B_M: torch.Tensor | None,
    num_heads: int,
) -> torch.Tensor:
    """:class:`vla.heads.blocks._Attention` ``name`` per tenant, the tenant dim folded into
    the batch dim of one fused attention call."""
    N, B, Q, H = x_N_B_Q_H.shape
    nh, d = num_heads, H // num_heads
    q = linear(p, f"{name}.q_proj", x_N_B_Q_H).reshape(N * B, Q, nh, d).transpose(1, 2)
    kv_N_B_M_2H = torch.cat([linear(p, f"{name}.kv_proj", part) for part in mem_parts], dim=2)
    M = kv_N_B_M_2H.shape[2]
    kv = kv_N_B_M_2H.reshape(N * B, M, 2, nh, d).permute(2, 0, 3, 1, 4)
    mask = None if attend_N_B_M is None else attend_N_B_M.reshape(N * B, 1, 1, M)
    o = F.scaled_dot_product_attention(q, kv[0], kv[1], attn_mask=mask)
    return linear(p, f"{name}.out_proj", o.transpose(1, 2).reshape(N, B, Q, H))


def block(
    p: Params,
    name: str,
    x_N_B_Q_H: torch.Tensor,
    memory: StackedMemory,
    heads: tuple[int, int],
) -> torch.Tensor:
    """:class:`vla.heads.blocks._Block` ``name`` per tenant; ``heads``: the self- and
    cross-attention head counts."""
    h = layer_norm(p, f"{name}.norm_self", x_N_B_Q_H)
    x = x_N_B_Q_H + attention(p, f"{name}.self_attn", h, (h,), None, heads[0])
    x = x + attention(
        p,
        f"{name}.cross_attn",
        layer_norm(p, f"{name}.norm_cross", x),
        (memory.tokens_N_B_T_D, memory.state_N_B_1_D),
        memory.attend_N_B_M,
        heads[1],
    )
    h = F.gelu(linear(p, f"{name}.mlp.0", layer_norm(p, f"{name}.norm_mlp", x)))
    return x + linear(p, f"{name}.mlp.2", h)


def memory(p: Params, inputs: StackedInputs, has_proprio: bool) -> StackedMemory:
    """The conditioning memory (normalised prefix + state token) per tenant."""
    prefix = inputs.prefix_N_B_T_D
    N, B, _, D = prefix.shape
    state_N_B_D = p["state_token_D"].unsqueeze(1).expand(N, B, D)
    if has_proprio:
        state_N_B_D = state_N_B_D + linear(p, "proprio_proj", inputs.proprio_N_B_P)
    mask = inputs.mask_N_B_T
    return StackedMemory(
        tokens_N_B_T_D=F.layer_norm(prefix, (D,)),
        state_N_B_1_D=F.layer_norm(state_N_B_D, (D,)).unsqueeze(2),
        attend_N_B_M=torch.cat([mask, mask.new_ones(N, B, 1)], dim=2),
    )


def masked_mean(x_N_B_T_H: torch.Tensor, mask_N_B_T: torch.Tensor) -> torch.Tensor:
    """Mean over the attendable tokens (an all-padding row pools to zeros)."""
    w = mask_N_B_T.to(x_N_B_T_H.dtype).unsqueeze(-1)
    return (x_N_B_T_H * w).sum(2) / w.sum(2).clamp(min=1.0)


def mean_per_tenant(x_N_etc: torch.Tensor) -> torch.Tensor:
    """Each tenant's mean over all its elements: ``losses_N``."""
    return x_N_etc.reshape(x_N_etc.shape[0], -1).mean(dim=1)
