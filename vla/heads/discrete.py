"""RT-2/OpenVLA style discretised-token head (``HeadConfig.kind == "discrete"``)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from schemas.model import HeadConfig
from vla.feature import VLAFeature
from vla.heads import stacked
from vla.heads.base import ActionHead, ActOutput
from vla.heads.blocks import _masked_mean


class DiscreteHead(ActionHead):
    """Discretised-token head: ``num_bins`` uniform bins per action dimension over [-1, 1]
    (of the normalised actions: the policy's action range maps onto it).

    The normalised prefix (masked mean-pooled) and the state token feed an MLP of
    ``num_layers`` hidden layers that outputs logits for every (chunk step, action dim, bin).
    Trained with cross-entropy against the bin containing each target; targets outside
    [-1, 1] fall into the edge bins. Sampled actions are bin centres, so ``log_prob`` of an
    action returned by :meth:`act` is exactly the categorical log-prob of its bins.
    """

    def __init__(self, config: HeadConfig, hidden_size: int) -> None:
        super().__init__(config, hidden_size)
        H = config.hidden_dim
        layers: list[nn.Module] = []
        for _ in range(config.num_layers):
            layers += [nn.Linear(2 * hidden_size if not layers else H, H), nn.GELU()]
        self.mlp = nn.Sequential(*layers)
        self.out_proj = nn.Linear(H, config.chunk_len * config.action_dim * config.num_bins)
        self.num_bins = config.num_bins

    def logits(self, feature: VLAFeature) -> torch.Tensor:
        """Bin logits ``logits_B_C_A_K``."""
        self.check_feature(feature)
        return self._logits(feature)

    def _logits(self, feature: VLAFeature) -> torch.Tensor:
        memory = self._memory(feature)
        # Pool the prefix tokens and keep the state token apart, so proprio is not diluted.
        pooled_B_D = _masked_mean(memory.tokens_B_T_D, memory.attend_B_M[:, :-1])
        h_B_H = self.mlp(torch.cat([pooled_B_D, memory.state_B_1_D[:, 0]], dim=-1))
        B = feature.batch_size
        return self.out_proj(h_B_H).view(B, self.chunk_len, self.action_dim, self.num_bins)

    def bin_index(self, actions_B_C_A: torch.Tensor) -> torch.Tensor:
        """Index of the bin holding each action value (values outside [-1, 1] are clamped)."""
        K = self.num_bins
        idx = torch.floor((actions_B_C_A.clamp(-1.0, 1.0) + 1.0) * (K / 2.0)).long()
        return idx.clamp(0, K - 1)

    def bin_centres(self, idx_B_C_A: torch.Tensor) -> torch.Tensor:
        """Action value at the centre of each bin."""
        return -1.0 + (idx_B_C_A.to(self._dtype) + 0.5) * (2.0 / self.num_bins)

    def loss_from(
        self,
        feature: VLAFeature,
        actions_B_C_A: torch.Tensor,
        draws: tuple[torch.Tensor, ...],
    ) -> torch.Tensor:
        """Mean cross-entropy over every (sample, chunk step, action dim)."""
        logits_B_C_A_K = self._logits(feature)
        return F.cross_entropy(
            logits_B_C_A_K.reshape(-1, self.num_bins),
            self.bin_index(self._as_param(actions_B_C_A)).reshape(-1),
        )

    def stacked_loss(self, p: stacked.Params, inputs: stacked.StackedInputs) -> torch.Tensor:
        """Per-tenant mean cross-entropy (see :meth:`ActionHead.stacked_loss`)."""
        memory = stacked.memory(p, inputs, self.proprio_proj is not None)
        pooled = stacked.masked_mean(memory.tokens_N_B_T_D, memory.attend_N_B_M[..., :-1])
        h = torch.cat([pooled, memory.state_N_B_1_D[:, :, 0]], dim=-1)
        for i in range(self.config.num_layers):  # Sequential(Linear, GELU, ...): 0, 2, ...
            h = F.gelu(stacked.linear(p, f"mlp.{2 * i}", h))
        K = self.num_bins
        logits = stacked.linear(p, "out_proj", h).reshape(-1, K)
        targets = self.bin_index(inputs.actions_N_B_C_A).reshape(-1)
        ce = F.cross_entropy(logits, targets, reduction="none")
        return stacked.mean_per_tenant(ce.view(inputs.actions_N_B_C_A.shape[0], -1))

    def act_normalised(
        self,
        feature: VLAFeature,
        generator: torch.Generator | None,
        deterministic: bool,
    ) -> ActOutput:
        """Sample a bin per dimension (argmax if deterministic) and return its centre."""
        logp_B_C_A_K = F.log_softmax(self.logits(feature), dim=-1)
        if deterministic:
            idx_B_C_A = logp_B_C_A_K.argmax(dim=-1)
        else:
            flat = torch.multinomial(
                logp_B_C_A_K.reshape(-1, self.num_bins).exp(), 1, generator=generator
            )
            idx_B_C_A = flat.view(logp_B_C_A_K.shape[:-1])
        lp_B_C_A = logp_B_C_A_K.gather(-1, idx_B_C_A.unsqueeze(-1)).squeeze(-1)
        return ActOutput(
            self.bin_centres(idx_B_C_A), lp_B_C_A.sum(dim=(1, 2)), self._maybe_value(feature)
        )

    def log_prob_normalised(self, feature: VLAFeature, actions_B_C_A: torch.Tensor) -> torch.Tensor:
        """Categorical log-prob of the bins holding ``actions_B_C_A``, summed over dims."""
        logp_B_C_A_K = F.log_softmax(self.logits(feature), dim=-1)
        idx_B_C_A = self.bin_index(actions_B_C_A)
        return logp_B_C_A_K.gather(-1, idx_B_C_A.unsqueeze(-1)).squeeze(-1).sum(dim=(1, 2))
