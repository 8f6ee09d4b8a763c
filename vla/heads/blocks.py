"""Building blocks shared by the action heads: attention, the conditioning memory, the
transformer block, the value head and the diagonal Gaussian policy (see :mod:`vla.heads`)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

#: Width of one attention head inside the action modules.
_HEAD_DIM = 16
#: Log-std bounds for the Gaussian policies: keeps log-probs finite and exploration sane.
_LOG_STD_MIN, _LOG_STD_MAX = -5.0, 2.0


class _Attention(nn.Module):
    """Multi-head attention from width-``dim`` queries to a width-``mem_dim`` memory, with a
    boolean key mask (True = attend)."""

    def __init__(self, dim: int, mem_dim: int) -> None:
        super().__init__()
        # About _HEAD_DIM wide heads; the largest head count that divides dim (1 at worst).
        self.num_heads = next(n for n in range(max(1, dim // _HEAD_DIM), 0, -1) if dim % n == 0)
        self.q_proj = nn.Linear(dim, dim)
        self.kv_proj = nn.Linear(mem_dim, 2 * dim)
        self.out_proj = nn.Linear(dim, dim)

    def forward(
        self,
        x_B_Q_H: torch.Tensor,
        mem_parts: Sequence[torch.Tensor],
        attend_B_M: torch.Tensor | None,
    ) -> torch.Tensor:
        """Attend from ``x_B_Q_H`` to the memory ``cat(mem_parts, dim=1)`` (width ``mem_dim``).

        The memory comes in parts so that keys/values are projected per part: a part that
        needs no gradient (the frozen prefix) then costs no input-gradient matmul.
        """
        B, Q, H = x_B_Q_H.shape
        nh = self.num_heads
        q_B_h_Q_d = self.q_proj(x_B_Q_H).view(B, Q, nh, H // nh).transpose(1, 2)
        kv_B_M_2H = torch.cat([self.kv_proj(part) for part in mem_parts], dim=1)
        M = kv_B_M_2H.shape[1]
        kv = kv_B_M_2H.view(B, M, 2, nh, H // nh).permute(2, 0, 3, 1, 4)
        mask = None if attend_B_M is None else attend_B_M[:, None, None, :]
        o_B_h_Q_d = F.scaled_dot_product_attention(q_B_h_Q_d, kv[0], kv[1], attn_mask=mask)
        return self.out_proj(o_B_h_Q_d.transpose(1, 2).reshape(B, Q, H))


@dataclass
class _Memory:
    """The conditioning memory: layer-normalised prefix tokens (no grad: the backbone is
    frozen), the state token (learned + proprio, has grad), and which of the ``T + 1``
    positions may be attended (the state token always may)."""

    tokens_B_T_D: torch.Tensor
    state_B_1_D: torch.Tensor
    attend_B_M: torch.Tensor


class _Block(nn.Module):
    """Pre-norm transformer block over the action tokens: self-attention among them,
    cross-attention to the conditioning memory (normalised prefix + state token, width ``D``),
    MLP (2x: the action tokens are few; see the :mod:`vla.heads` docstring on proportions).

    Keys and values are projected straight from the width-``D`` memory: one ``D -> 2H``
    matmul per memory token, the head's only per-prefix-token cost besides its gradient.
    """

    def __init__(self, dim: int, mem_dim: int) -> None:
        super().__init__()
        self.norm_self = nn.LayerNorm(dim)
        self.self_attn = _Attention(dim, dim)
        self.norm_cross = nn.LayerNorm(dim)
        self.cross_attn = _Attention(dim, mem_dim)
        self.norm_mlp = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))

    def forward(self, x_B_Q_H: torch.Tensor, memory: _Memory) -> torch.Tensor:
        h = self.norm_self(x_B_Q_H)
        x_B_Q_H = x_B_Q_H + self.self_attn(h, (h,), None)
        x_B_Q_H = x_B_Q_H + self.cross_attn(
            self.norm_cross(x_B_Q_H), (memory.tokens_B_T_D, memory.state_B_1_D), memory.attend_B_M
        )
        return x_B_Q_H + self.mlp(self.norm_mlp(x_B_Q_H))


class ValueHead(nn.Module):
    """State value for PPO: masked mean-pool of the prefix, concatenated with proprio, MLP."""

    def __init__(self, hidden_size: int, proprio_dim: int, hidden_dim: int) -> None:
        super().__init__()
        # No affine: the MLP's first layer absorbs it, and without LN weights no gradient has
        # to flow back through the prefix-sized input.
        self.norm = nn.LayerNorm(hidden_size, elementwise_affine=False)
        self.mlp = nn.Sequential(
            nn.Linear(hidden_size + proprio_dim, hidden_dim), nn.GELU(), nn.Linear(hidden_dim, 1)
        )

    def forward(
        self, prefix_B_T_D: torch.Tensor, mask_B_T: torch.Tensor, proprio_B_P: torch.Tensor
    ) -> torch.Tensor:
        pooled_B_D = _masked_mean(self.norm(prefix_B_T_D), mask_B_T)
        return self.mlp(torch.cat([pooled_B_D, proprio_B_P], dim=-1)).squeeze(-1)


def _masked_mean(x_B_T_H: torch.Tensor, mask_B_T: torch.Tensor) -> torch.Tensor:
    w_B_T_1 = mask_B_T.to(x_B_T_H.dtype).unsqueeze(-1)
    # clamp: an all-padding row pools to zeros instead of 0/0 = NaN.
    return (x_B_T_H * w_B_T_1).sum(1) / w_B_T_1.sum(1).clamp(min=1.0)


class _GaussianPolicy(nn.Module):
    """Diagonal Gaussian around a mean chunk with a learned, state-independent log-std."""

    def __init__(self, action_dim: int, init_log_std: float) -> None:
        super().__init__()
        self.log_std_A = nn.Parameter(torch.full((action_dim,), init_log_std))

    def std_A(self) -> torch.Tensor:
        return self.log_std_A.clamp(_LOG_STD_MIN, _LOG_STD_MAX).exp()

    def log_prob(self, mean_B_C_A: torch.Tensor, actions_B_C_A: torch.Tensor) -> torch.Tensor:
        log_std_A = self.log_std_A.clamp(_LOG_STD_MIN, _LOG_STD_MAX)
        z = (actions_B_C_A - mean_B_C_A) / log_std_A.exp()
        lp_B_C_A = -0.5 * z.square() - log_std_A - 0.5 * math.log(2 * math.pi)
        return lp_B_C_A.sum(dim=(1, 2))

    def sample(
        self, mean_B_C_A: torch.Tensor, generator: torch.Generator | None, deterministic: bool
    ) -> torch.Tensor:
        if deterministic:
            return mean_B_C_A
        eps = torch.randn(
            mean_B_C_A.shape, generator=generator, device=mean_B_C_A.device, dtype=mean_B_C_A.dtype
        )
        return mean_B_C_A + eps * self.std_A()
