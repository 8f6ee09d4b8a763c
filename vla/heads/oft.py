"""OpenVLA-OFT style chunked continuous regression head (``HeadConfig.kind == "oft"``)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from schemas.model import HeadConfig
from vla.feature import VLAFeature
from vla.heads import stacked
from vla.heads.base import ActionHead, ActOutput
from vla.heads.blocks import _Block, _GaussianPolicy


class OFTHead(ActionHead):
    """Chunked continuous regression head (OpenVLA-OFT style parallel decoding).

    ``chunk_len`` learned action queries pass through ``num_layers`` blocks (self-attention
    among the queries, cross-attention to the prefix with its padding mask and the proprio
    state token, MLP) and are read out as the action chunk. Trained with L1 loss. As a policy
    it is a diagonal Gaussian centred on the regressed chunk with a learned per-dimension
    log-std, which gives exact log-probs and reparameterised samples for PPO/GRPO.
    """

    def __init__(self, config: HeadConfig, hidden_size: int) -> None:
        super().__init__(config, hidden_size)
        H = config.hidden_dim
        self.queries_C_H = nn.Parameter(torch.randn(config.chunk_len, H) * 0.02)
        self.blocks = nn.ModuleList(_Block(H, hidden_size) for _ in range(config.num_layers))
        self.out_norm = nn.LayerNorm(H)
        self.out_proj = nn.Linear(H, config.action_dim)
        self.policy = _GaussianPolicy(config.action_dim, init_log_std=-1.0)

    def mean(self, feature: VLAFeature) -> torch.Tensor:
        """The regressed action chunk ``mean_B_C_A``."""
        self.check_feature(feature)
        return self._mean(feature)

    def _mean(self, feature: VLAFeature) -> torch.Tensor:
        memory = self._memory(feature)
        x_B_C_H = self.queries_C_H.expand(feature.batch_size, -1, -1)
        for block in self.blocks:
            x_B_C_H = block(x_B_C_H, memory)
        return self.out_proj(self.out_norm(x_B_C_H))

    def loss_from(
        self,
        feature: VLAFeature,
        actions_B_C_A: torch.Tensor,
        draws: tuple[torch.Tensor, ...],
    ) -> torch.Tensor:
        """L1 between the regressed chunk and the target (no noise: ``draws`` is empty)."""
        return F.l1_loss(self._mean(feature), self._as_param(actions_B_C_A))

    def stacked_loss(self, p: stacked.Params, inputs: stacked.StackedInputs) -> torch.Tensor:
        """Per-tenant L1 of the regressed chunks (see :meth:`ActionHead.stacked_loss`)."""
        memory = stacked.memory(p, inputs, self.proprio_proj is not None)
        N, B = inputs.prefix_N_B_T_D.shape[:2]
        queries = p["queries_C_H"]
        x = queries.unsqueeze(1).expand(N, B, *queries.shape[1:])
        for i, blk in enumerate(self.blocks):
            assert isinstance(blk, _Block)
            heads = (blk.self_attn.num_heads, blk.cross_attn.num_heads)
            x = stacked.block(p, f"blocks.{i}", x, memory, heads)
        mean = stacked.linear(p, "out_proj", stacked.layer_norm(p, "out_norm", x))
        return stacked.mean_per_tenant((mean - inputs.actions_N_B_C_A).abs())

    def act_normalised(
        self,
        feature: VLAFeature,
        generator: torch.Generator | None,
        deterministic: bool,
    ) -> ActOutput:
        """Gaussian sample around the regressed chunk (the chunk itself if deterministic)."""
        mean_B_C_A = self.mean(feature)
        actions_B_C_A = self.policy.sample(mean_B_C_A, generator, deterministic)
        return ActOutput(
            actions_B_C_A,
            self.policy.log_prob(mean_B_C_A, actions_B_C_A),
            self._maybe_value(feature),
        )

    def log_prob_normalised(self, feature: VLAFeature, actions_B_C_A: torch.Tensor) -> torch.Tensor:
        """Exact diagonal-Gaussian log-density, summed over chunk and action dims."""
        return self.policy.log_prob(self.mean(feature), actions_B_C_A)
