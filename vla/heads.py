"""Per-tenant action modules: small trainable heads on top of the frozen backbone's feature.

Every head is built from a :class:`schemas.model.HeadConfig` and the backbone's hidden size
(:func:`build_head`) and offers the same four calls:

* ``loss(feature, actions_B_C_A, generator=None)`` — the supervised (SFT) loss, a scalar mean;
* ``act(feature, generator=None, deterministic=False)`` — an :class:`ActOutput` with sampled
  (or deterministic) actions, their log-probabilities and, with a value head, the state value;
* ``log_prob(feature, actions_B_C_A)`` — per-sample log-probability of given actions (RL);
* ``value(feature)`` — per-sample state value (PPO), only when ``config.value_head``.

Three kinds (``HeadConfig.kind``):

* ``"oft"`` (:class:`OFTHead`) — OpenVLA-OFT style parallel decoding: ``chunk_len`` learned
  action queries attend to the prefix and a proprio token; L1 regression; for RL a diagonal
  Gaussian around the regressed chunk with a learned per-dimension log-std.
* ``"discrete"`` (:class:`DiscreteHead`) — RT-2/OpenVLA style: each action dimension is binned
  uniformly over [-1, 1]; cross-entropy loss; a categorical policy over bins.
* ``"flow"`` (:class:`FlowHead`) — a pi0-style action expert: a small transformer over the noisy
  action chunk conditioned on the prefix, trained by rectified-flow velocity regression and
  sampled by Euler integration.

Sizes follow DESIGN §3 "Proportions": defaults (hidden 64, one layer) keep a head's per-sample
training compute well under a tenth of the backbone's forward, so grouping the backbone forward
has something to amortise. All randomness (flow noise and times, policy sampling) comes from a
caller-supplied ``torch.Generator`` (a tenant slot's own), never from the global RNG, so a
tenant's numbers do not depend on what other tenants do.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from schemas.model import HeadConfig
from vla.feature import VLAFeature

#: Width of one attention head inside the action modules.
_HEAD_DIM = 16
#: Log-std bounds for the Gaussian policies: keeps log-probs finite and exploration sane.
_LOG_STD_MIN, _LOG_STD_MAX = -5.0, 2.0


@dataclass
class ActOutput:
    """What a head returns for an observation batch.

    ``actions_B_C_A``: the action chunks. ``log_prob_B``: their log-probability under the head's
    policy (summed over chunk and action dims). ``value_B``: state values, or ``None`` without a
    value head.
    """

    actions_B_C_A: torch.Tensor
    log_prob_B: torch.Tensor
    value_B: torch.Tensor | None


def _autograd_ready(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Cast a backbone output to the head's dtype and make it usable by autograd.

    The backbone runs under ``torch.inference_mode()``; inference tensors cannot be saved for
    backward, so they are copied into normal tensors (a memcpy, negligible next to the forward).
    """
    t = t.to(dtype)
    return t.clone() if t.is_inference() else t


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
    MLP (2x: the action tokens are few; see the module docstring on proportions).

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


class ActionHead(nn.Module):
    """What every action module shares: shape checks, conditioning memory and the value head.

    The conditioning memory is the prefix plus one *state token* (a learned vector plus the
    projected proprio), at the backbone's width ``D``, layer-normalised without affine weights.
    The state token is always attendable, so a sample whose prefix is all padding still has
    something to attend to (no NaN softmax).

    Proportions: the prefix has tens to hundreds of tokens, the action chunk a few, so the
    cost that matters is per prefix token. It is kept to one ``D -> 2H`` key/value matmul per
    block and its weight gradient: no affine LN and no separate ``D -> H`` projection in front
    of it, either of which would add a gradient matmul of the prefix's size for nothing a
    linear layer cannot absorb.
    """

    def __init__(self, config: HeadConfig, hidden_size: int) -> None:
        super().__init__()
        if hidden_size < 1:
            raise ValueError(f"backbone hidden_size must be >= 1, got {hidden_size}")
        self.config = config
        self.hidden_size = hidden_size
        self.action_dim = config.action_dim
        self.chunk_len = config.chunk_len
        self.proprio_dim = config.proprio_dim
        H = config.hidden_dim
        self.state_token_D = nn.Parameter(torch.zeros(hidden_size))
        self.proprio_proj = (
            nn.Linear(config.proprio_dim, hidden_size) if config.proprio_dim else None
        )
        self.value_head = (
            ValueHead(hidden_size, config.proprio_dim, H) if config.value_head else None
        )

    # -- validation -------------------------------------------------------------------------
    @property
    def _dtype(self) -> torch.dtype:
        return self.state_token_D.dtype

    def _as_param(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` on the head's device and dtype (targets may arrive on the CPU)."""
        return t.to(self.state_token_D.device, self._dtype)

    def check_feature(self, feature: VLAFeature) -> None:
        """Raise ``ValueError`` if ``feature`` does not fit this head (hidden size, proprio)."""
        B = feature.batch_size
        if feature.prefix_B_T_D.dim() != 3 or feature.prefix_B_T_D.shape[2] != self.hidden_size:
            raise ValueError(
                f"expected prefix of shape (B, T, {self.hidden_size}), "
                f"got {tuple(feature.prefix_B_T_D.shape)}"
            )
        if tuple(feature.mask_B_T.shape) != tuple(feature.prefix_B_T_D.shape[:2]):
            raise ValueError(
                f"expected mask of shape {tuple(feature.prefix_B_T_D.shape[:2])}, "
                f"got {tuple(feature.mask_B_T.shape)}"
            )
        if tuple(feature.proprio_B_P.shape) != (B, self.proprio_dim):
            raise ValueError(
                f"expected proprio of shape ({B}, {self.proprio_dim}), "
                f"got {tuple(feature.proprio_B_P.shape)}"
            )

    def check_actions(self, feature: VLAFeature, actions_B_C_A: torch.Tensor) -> None:
        """Raise ``ValueError`` naming the expected shape if ``actions_B_C_A`` does not fit."""
        self.check_feature(feature)
        expected = (feature.batch_size, self.chunk_len, self.action_dim)
        if tuple(actions_B_C_A.shape) != expected:
            raise ValueError(
                f"expected actions of shape (B, chunk_len, action_dim) = {expected}, "
                f"got {tuple(actions_B_C_A.shape)}"
            )
        if not actions_B_C_A.is_floating_point():
            raise ValueError(f"expected floating-point actions, got {actions_B_C_A.dtype}")
        # Bad targets are bad input, caught here: binning would silently map NaN to a bin.
        if not bool(torch.isfinite(actions_B_C_A).all()):
            raise ValueError("actions contain NaN or inf")

    # -- shared pieces ----------------------------------------------------------------------
    def _inputs(self, feature: VLAFeature) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The feature as head-dtype tensors: ``(prefix_B_T_D, mask_B_T bool, proprio_B_P)``."""
        prefix_B_T_D = _autograd_ready(feature.prefix_B_T_D, self._dtype)
        proprio_B_P = _autograd_ready(feature.proprio_B_P, self._dtype)
        return prefix_B_T_D, feature.mask_B_T.bool(), proprio_B_P

    def _memory(self, feature: VLAFeature) -> _Memory:
        """The conditioning memory: ``T`` prefix tokens plus the state token."""
        prefix_B_T_D, mask_B_T, proprio_B_P = self._inputs(feature)
        B, _, D = prefix_B_T_D.shape
        state_B_D = self.state_token_D.expand(B, -1)
        if self.proprio_proj is not None:
            state_B_D = state_B_D + self.proprio_proj(proprio_B_P)
        # LayerNorm is per token, so normalising the two parts apart equals normalising the
        # concatenation; keeping them apart keeps the prefix part out of autograd.
        return _Memory(
            tokens_B_T_D=F.layer_norm(prefix_B_T_D, (D,)),
            state_B_1_D=F.layer_norm(state_B_D, (D,)).unsqueeze(1),
            attend_B_M=torch.cat([mask_B_T, mask_B_T.new_ones(B, 1)], dim=1),
        )

    def value(self, feature: VLAFeature) -> torch.Tensor:
        """Per-sample state value ``value_B``; needs ``config.value_head``."""
        if self.value_head is None:
            raise ValueError("this head was built without a value head (HeadConfig.value_head)")
        self.check_feature(feature)
        prefix_B_T_D, mask_B_T, proprio_B_P = self._inputs(feature)
        return self.value_head(prefix_B_T_D, mask_B_T, proprio_B_P)

    def _maybe_value(self, feature: VLAFeature) -> torch.Tensor | None:
        return None if self.value_head is None else self.value(feature)

    # -- the per-kind API -------------------------------------------------------------------
    def loss(
        self,
        feature: VLAFeature,
        actions_B_C_A: torch.Tensor,
        generator: torch.Generator | None = None,
    ) -> torch.Tensor:
        """Supervised loss (scalar mean over the batch)."""
        raise NotImplementedError

    def act(
        self,
        feature: VLAFeature,
        generator: torch.Generator | None = None,
        deterministic: bool = False,
    ) -> ActOutput:
        """Actions for ``feature`` (sampled with ``generator``, or the policy's mode)."""
        raise NotImplementedError

    def log_prob(self, feature: VLAFeature, actions_B_C_A: torch.Tensor) -> torch.Tensor:
        """Log-probability ``log_prob_B`` of ``actions_B_C_A`` under the policy."""
        raise NotImplementedError


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
        memory = self._memory(feature)
        x_B_C_H = self.queries_C_H.expand(feature.batch_size, -1, -1)
        for block in self.blocks:
            x_B_C_H = block(x_B_C_H, memory)
        return self.out_proj(self.out_norm(x_B_C_H))

    def loss(
        self,
        feature: VLAFeature,
        actions_B_C_A: torch.Tensor,
        generator: torch.Generator | None = None,
    ) -> torch.Tensor:
        """L1 between the regressed chunk and the target (``generator`` unused: no noise)."""
        self.check_actions(feature, actions_B_C_A)
        return F.l1_loss(self.mean(feature), self._as_param(actions_B_C_A))

    def act(
        self,
        feature: VLAFeature,
        generator: torch.Generator | None = None,
        deterministic: bool = False,
    ) -> ActOutput:
        """Gaussian sample around the regressed chunk (the chunk itself if deterministic)."""
        mean_B_C_A = self.mean(feature)
        actions_B_C_A = self.policy.sample(mean_B_C_A, generator, deterministic)
        return ActOutput(
            actions_B_C_A,
            self.policy.log_prob(mean_B_C_A, actions_B_C_A),
            self._maybe_value(feature),
        )

    def log_prob(self, feature: VLAFeature, actions_B_C_A: torch.Tensor) -> torch.Tensor:
        """Exact diagonal-Gaussian log-density, summed over chunk and action dims."""
        self.check_actions(feature, actions_B_C_A)
        return self.policy.log_prob(self.mean(feature), self._as_param(actions_B_C_A))


class DiscreteHead(ActionHead):
    """Discretised-token head: ``num_bins`` uniform bins per action dimension over [-1, 1].

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

    def loss(
        self,
        feature: VLAFeature,
        actions_B_C_A: torch.Tensor,
        generator: torch.Generator | None = None,
    ) -> torch.Tensor:
        """Mean cross-entropy over every (sample, chunk step, action dim)."""
        self.check_actions(feature, actions_B_C_A)
        logits_B_C_A_K = self.logits(feature)
        return F.cross_entropy(
            logits_B_C_A_K.reshape(-1, self.num_bins),
            self.bin_index(self._as_param(actions_B_C_A)).reshape(-1),
        )

    def act(
        self,
        feature: VLAFeature,
        generator: torch.Generator | None = None,
        deterministic: bool = False,
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

    def log_prob(self, feature: VLAFeature, actions_B_C_A: torch.Tensor) -> torch.Tensor:
        """Categorical log-prob of the bins holding ``actions_B_C_A``, summed over dims."""
        self.check_actions(feature, actions_B_C_A)
        logp_B_C_A_K = F.log_softmax(self.logits(feature), dim=-1)
        idx_B_C_A = self.bin_index(self._as_param(actions_B_C_A))
        return logp_B_C_A_K.gather(-1, idx_B_C_A.unsqueeze(-1)).squeeze(-1).sum(dim=(1, 2))


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

    def loss(
        self,
        feature: VLAFeature,
        actions_B_C_A: torch.Tensor,
        generator: torch.Generator | None = None,
    ) -> torch.Tensor:
        """Rectified-flow velocity MSE; noise and ``t`` come from ``generator``."""
        self.check_actions(feature, actions_B_C_A)
        memory = self._memory(feature)
        target_B_C_A = self._as_param(actions_B_C_A)
        B, dev, dt = feature.batch_size, target_B_C_A.device, self._dtype
        t_B = torch.rand(B, generator=generator, device=dev, dtype=dt)
        noise_B_C_A = torch.randn(target_B_C_A.shape, generator=generator, device=dev, dtype=dt)
        t_B_1_1 = t_B[:, None, None]
        x_t = (1.0 - t_B_1_1) * noise_B_C_A + t_B_1_1 * target_B_C_A
        v_B_C_A = self.velocity(x_t, t_B, memory)
        return F.mse_loss(v_B_C_A, target_B_C_A - noise_B_C_A)

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

    def act(
        self,
        feature: VLAFeature,
        generator: torch.Generator | None = None,
        deterministic: bool = False,
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

    def log_prob(self, feature: VLAFeature, actions_B_C_A: torch.Tensor) -> torch.Tensor:
        """Surrogate log-prob: Gaussian around the deterministic Euler sample (class docs)."""
        self.check_actions(feature, actions_B_C_A)
        return self.policy.log_prob(self.sample(feature), self._as_param(actions_B_C_A))


_KINDS: dict[str, type[ActionHead]] = {
    "oft": OFTHead,
    "discrete": DiscreteHead,
    "flow": FlowHead,
}


def build_head(config: HeadConfig, hidden_size: int) -> ActionHead:
    """Build the action module ``config.kind`` for a backbone of width ``hidden_size``."""
    try:
        cls = _KINDS[config.kind]
    except KeyError:
        raise ValueError(
            f"unknown head kind {config.kind!r}; expected one of {sorted(_KINDS)}"
        ) from None
    return cls(config, hidden_size)
