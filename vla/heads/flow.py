"""pi0 style flow-matching action expert (``HeadConfig.kind == "flow"``)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from schemas.model import HeadConfig
from vla.feature import VLAFeature
from vla.heads import stacked
from vla.heads.base import ActionHead, ActOutput
from vla.heads.blocks import _Block, _GaussianPolicy, _Memory


class FlowHead(ActionHead):
    """Flow-matching action expert (pi0 style), trained with rectified flow.

    A small transformer over the action chunk: each noisy action ``x_t`` is embedded, plus a
    learned position embedding and a sinusoidal embedding of the flow time ``t``; ``num_layers``
    blocks self-attend over the chunk and cross-attend to the prefix and the proprio state token;
    the output is the velocity. Training: ``x_t = (1 - t) * noise + t * actions`` with
    ``t ~ U(0, 1)`` and ``noise ~ N(0, I)`` drawn from the caller's generator, and MSE to the
    velocity ``actions - noise``. Sampling: ``flow_steps`` Euler steps from ``t = 0`` to 1.

    **Log-probability surrogate.** The exact density of a flow sample needs the divergence of
    the velocity field integrated along the path, which is expensive and noisy. As a tractable
    policy for PPO/GRPO this head instead defines the policy as a diagonal Gaussian centred on
    the *deterministic* Euler sample (integrated from ``x_0 = 0``, the noise mean) with a
    learned per-dimension log-std: :meth:`act` samples from exactly that Gaussian and
    :meth:`log_prob` evaluates it, so the two are consistent and gradients reach both the
    expert (through the mean) and the std.
    """

    def __init__(self, config: HeadConfig, hidden_size: int) -> None:
        super().__init__(config, hidden_size)
        H = config.hidden_dim
        self.flow_steps = config.flow_steps
        self.action_in = nn.Linear(config.action_dim, H)
        self.pos_C_H = nn.Parameter(torch.randn(config.chunk_len, H) * 0.02)
        self.time_mlp = nn.Sequential(nn.Linear(H, H), nn.GELU(), nn.Linear(H, H))
        self.blocks = nn.ModuleList(_Block(H, hidden_size) for _ in range(config.num_layers))
        self.out_norm = nn.LayerNorm(H)
        self.out_proj = nn.Linear(H, config.action_dim)
        self.policy = _GaussianPolicy(config.action_dim, init_log_std=-1.0)

    def _time_embedding(self, t_B: torch.Tensor) -> torch.Tensor:
        half = self.pos_C_H.shape[1] // 2
        freqs = torch.exp(
            -math.log(1000.0) * torch.arange(half, device=t_B.device, dtype=t_B.dtype) / half
        )
        angles_B_h = t_B[:, None] * freqs[None, :] * 1000.0
        emb = torch.cat([angles_B_h.sin(), angles_B_h.cos()], dim=-1)
        if emb.shape[1] < self.pos_C_H.shape[1]:  # odd hidden_dim: pad one zero column
            emb = F.pad(emb, (0, 1))
        return self.time_mlp(emb)

    def velocity(
        self,
        x_B_C_A: torch.Tensor,
        t_B: torch.Tensor,
        memory: _Memory,
    ) -> torch.Tensor:
        """Predicted velocity ``v_B_C_A`` at noisy chunk ``x_B_C_A`` and time ``t_B``."""
        h_B_C_H = self.action_in(x_B_C_A) + self.pos_C_H + self._time_embedding(t_B)[:, None]
        for block in self.blocks:
            h_B_C_H = block(h_B_C_H, memory)
        return self.out_proj(self.out_norm(h_B_C_H))

    def draw(self, batch_size: int, generator: torch.Generator | None) -> tuple[torch.Tensor, ...]:
        """Flow times ``t_B ~ U(0, 1)`` then noise ``noise_B_C_A ~ N(0, I)``, in that order."""
        ref = self.state_token_D
        t_B = torch.rand(batch_size, generator=generator, device=ref.device, dtype=ref.dtype)
        shape = (batch_size, self.chunk_len, self.action_dim)
        noise_B_C_A = torch.randn(shape, generator=generator, device=ref.device, dtype=ref.dtype)
        return t_B, noise_B_C_A

    def loss_from(
        self,
        feature: VLAFeature,
        actions_B_C_A: torch.Tensor,
        draws: tuple[torch.Tensor, ...],
    ) -> torch.Tensor:
        """Rectified-flow velocity MSE at the drawn times and noise."""
        t_B, noise_B_C_A = draws
        memory = self._memory(feature)
        target_B_C_A = self._as_param(actions_B_C_A)
        t_B_1_1 = t_B[:, None, None]
        x_t = (1.0 - t_B_1_1) * noise_B_C_A + t_B_1_1 * target_B_C_A
        v_B_C_A = self.velocity(x_t, t_B, memory)
        return F.mse_loss(v_B_C_A, target_B_C_A - noise_B_C_A)

    def stacked_loss(self, p: stacked.Params, inputs: stacked.StackedInputs) -> torch.Tensor:
        """Per-tenant rectified-flow velocity MSE (see :meth:`ActionHead.stacked_loss`)."""
        t_N_B, noise = inputs.draws
        memory = stacked.memory(p, inputs, self.proprio_proj is not None)
        target = inputs.actions_N_B_C_A
        t = t_N_B[..., None, None]
        x_t = (1.0 - t) * noise + t * target
        pos = p["pos_C_H"]
        H = pos.shape[-1]
        half = H // 2
        freqs = torch.exp(
            -math.log(1000.0) * torch.arange(half, device=t_N_B.device, dtype=t_N_B.dtype) / half
        )
        angles = t_N_B[..., None] * freqs * 1000.0
        emb = torch.cat([angles.sin(), angles.cos()], dim=-1)
        if emb.shape[-1] < H:  # odd hidden_dim: pad one zero column
            emb = F.pad(emb, (0, 1))
        time_N_B_H = stacked.linear(p, "time_mlp.2", F.gelu(stacked.linear(p, "time_mlp.0", emb)))
        h = stacked.linear(p, "action_in", x_t) + pos.unsqueeze(1) + time_N_B_H.unsqueeze(2)
        for i, blk in enumerate(self.blocks):
            assert isinstance(blk, _Block)
            heads = (blk.self_attn.num_heads, blk.cross_attn.num_heads)
            h = stacked.block(p, f"blocks.{i}", h, memory, heads)
        v = stacked.linear(p, "out_proj", stacked.layer_norm(p, "out_norm", h))
        return stacked.mean_per_tenant((v - (target - noise)).square())

    def sample(self, feature: VLAFeature, x0_B_C_A: torch.Tensor | None = None) -> torch.Tensor:
        """Euler-integrate the learned flow from ``x0_B_C_A`` (zeros by default) to ``t = 1``."""
        self.check_feature(feature)
        memory = self._memory(feature)
        B = feature.batch_size
        shape = (B, self.chunk_len, self.action_dim)
        x_B_C_A = (
            x0_B_C_A.to(self._dtype)
            if x0_B_C_A is not None
            else memory.state_B_1_D.new_zeros(shape)
        )
        dt = 1.0 / self.flow_steps
        for i in range(self.flow_steps):
            t_B = memory.state_B_1_D.new_full((B,), i * dt)
            x_B_C_A = x_B_C_A + dt * self.velocity(x_B_C_A, t_B, memory)
        return x_B_C_A

    def act_normalised(
        self,
        feature: VLAFeature,
        generator: torch.Generator | None,
        deterministic: bool,
    ) -> ActOutput:
        """Deterministic Euler sample, plus Gaussian exploration noise unless deterministic
        (see the class docstring for why the policy is this surrogate Gaussian)."""
        mean_B_C_A = self.sample(feature)
        actions_B_C_A = self.policy.sample(mean_B_C_A, generator, deterministic)
        return ActOutput(
            actions_B_C_A,
            self.policy.log_prob(mean_B_C_A, actions_B_C_A),
            self._maybe_value(feature),
        )

    def log_prob_normalised(self, feature: VLAFeature, actions_B_C_A: torch.Tensor) -> torch.Tensor:
        """Surrogate log-prob: Gaussian around the deterministic Euler sample (class docs)."""
        return self.policy.log_prob(self.sample(feature), actions_B_C_A)
