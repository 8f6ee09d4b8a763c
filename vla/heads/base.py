"""The action-head base class and its output type (see :mod:`vla.heads` for the API)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from schemas.model import HeadConfig
from vla.feature import VLAFeature
from vla.heads import stacked
from vla.heads.blocks import ValueHead, _Memory


def _check_fits(what: str, dtype: torch.dtype, *values: torch.Tensor) -> None:
    """Statistics past the head buffers' range would be inf there, and every value normalised
    with them 0 or NaN, silently."""
    limit = torch.finfo(dtype).max
    if any(bool((v.abs() > limit).any()) for v in values):
        raise ValueError(f"{what} statistics must be within {dtype}'s range (±{limit:.3g})")


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

    #: Proprio statistics (buffers; present when ``proprio_dim`` > 0).
    proprio_mean_P: torch.Tensor
    proprio_std_P: torch.Tensor
    #: Action range the head works in [-1, 1] of (buffers): centre and half-width per dim.
    action_centre_A: torch.Tensor
    action_half_range_A: torch.Tensor

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
        # Proprio normalisation, part of the policy (saved with it, so serving standardises
        # as training did): ``(proprio - mean) / std`` per dimension. Identity until
        # :meth:`set_proprio_stats` (an SFT job sets its dataset's statistics).
        if config.proprio_dim:
            self.register_buffer("proprio_mean_P", torch.zeros(config.proprio_dim))
            self.register_buffer("proprio_std_P", torch.ones(config.proprio_dim))
        # Action normalisation, likewise part of the policy: the head learns and samples
        # ``(action - centre) / half_range``, the dataset's [min, max] mapped onto [-1, 1]
        # (the discrete head's bins span [-1, 1]); what it returns is in the env's units.
        # Identity until :meth:`set_action_stats`.
        self.register_buffer("action_centre_A", torch.zeros(config.action_dim))
        self.register_buffer("action_half_range_A", torch.ones(config.action_dim))

    def set_proprio_stats(self, mean_P: Sequence[float], std_P: Sequence[float]) -> None:
        """Standardise proprio with these per-dimension statistics from now on. A spread
        below ``1e-3`` (a constant dimension) counts as 1: it carries nothing to scale."""
        if not self.proprio_dim:
            raise ValueError("this head reads no proprio (proprio_dim 0): no statistics to set")
        if len(mean_P) != self.proprio_dim or len(std_P) != self.proprio_dim:
            raise ValueError(
                f"proprio statistics have {len(mean_P)} means and {len(std_P)} stds for "
                f"proprio_dim {self.proprio_dim}"
            )
        mean = torch.tensor(list(mean_P), dtype=torch.float64)
        std = torch.tensor(list(std_P), dtype=torch.float64)
        if not (torch.isfinite(mean).all() and torch.isfinite(std).all() and (std >= 0).all()):
            raise ValueError("proprio statistics must be finite, with stds >= 0")
        _check_fits("proprio", self.proprio_mean_P.dtype, mean, std)
        std = torch.where(std < 1e-3, torch.ones_like(std), std)
        with torch.no_grad():
            self.proprio_mean_P.copy_(mean)
            self.proprio_std_P.copy_(std)

    def set_action_stats(self, min_A: Sequence[float], max_A: Sequence[float]) -> None:
        """Map actions' ``[min, max]`` per dimension onto [-1, 1] from now on. A dimension
        whose range is below ``1e-6`` (constant) is only centred."""
        if len(min_A) != self.action_dim or len(max_A) != self.action_dim:
            raise ValueError(
                f"action statistics have {len(min_A)} minima and {len(max_A)} maxima for "
                f"action_dim {self.action_dim}"
            )
        low = torch.tensor(list(min_A), dtype=torch.float64)
        high = torch.tensor(list(max_A), dtype=torch.float64)
        if not (torch.isfinite(low).all() and torch.isfinite(high).all() and (high >= low).all()):
            raise ValueError("action statistics must be finite, with max >= min")
        _check_fits("action", self.action_centre_A.dtype, low, high)
        half = (high - low) / 2
        with torch.no_grad():
            self.action_centre_A.copy_((high + low) / 2)
            self.action_half_range_A.copy_(torch.where(half < 1e-6, torch.ones_like(half), half))

    def normalise_actions(self, actions_B_C_A: torch.Tensor) -> torch.Tensor:
        """Env-unit actions as the head learns them (identity by default)."""
        return (actions_B_C_A - self.action_centre_A) / self.action_half_range_A

    def denormalise_actions(self, actions_B_C_A: torch.Tensor) -> torch.Tensor:
        """The head's actions in the env's units (identity by default)."""
        return actions_B_C_A * self.action_half_range_A + self.action_centre_A

    def see(self, prefix_B_T_D: torch.Tensor) -> torch.Tensor:
        """The prefix as this head reads it: zeros for a blind head (``vision=False``), so
        nothing of the image or instruction reaches it while shapes stay those of a seeing
        head (same kernels, same batching)."""
        return prefix_B_T_D if self.config.vision else torch.zeros_like(prefix_B_T_D)

    def normalise_proprio(self, proprio_B_P: torch.Tensor) -> torch.Tensor:
        """``proprio_B_P`` standardised with the policy's statistics (identity by default)."""
        if not self.proprio_dim:
            return proprio_B_P
        return (proprio_B_P - self.proprio_mean_P) / self.proprio_std_P

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
        prefix_B_T_D = self.see(_autograd_ready(feature.prefix_B_T_D, self._dtype))
        proprio_B_P = self.normalise_proprio(_autograd_ready(feature.proprio_B_P, self._dtype))
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
        """Supervised loss (scalar mean over the batch): :meth:`check_actions`, then
        :meth:`loss_from` on what :meth:`draw` takes from ``generator``."""
        self.check_actions(feature, actions_B_C_A)
        normalised_B_C_A = self.normalise_actions(self._as_param(actions_B_C_A))
        return self.loss_from(feature, normalised_B_C_A, self.draw(feature.batch_size, generator))

    def draw(self, batch_size: int, generator: torch.Generator | None) -> tuple[torch.Tensor, ...]:
        """The random tensors one loss over ``batch_size`` samples needs, drawn from
        ``generator`` in a fixed order (none for a head without noise). Kept apart from
        :meth:`loss_from` so a batched step across tenants (:mod:`vla.batched`) draws each
        tenant's from its own generator exactly as its own step would."""
        return ()

    def loss_from(
        self,
        feature: VLAFeature,
        actions_B_C_A: torch.Tensor,
        draws: tuple[torch.Tensor, ...],
    ) -> torch.Tensor:
        """The loss on already-checked inputs and already-drawn randomness (the module's
        own per-tenant computation; a training step runs :meth:`stacked_loss`)."""
        raise NotImplementedError

    def stacked_loss(self, p: stacked.Params, inputs: stacked.StackedInputs) -> torch.Tensor:
        """The training loss of ``N`` tenants with this head's architecture at once:
        ``losses_N`` from their stacked parameters ``p`` (by this module's parameter names)
        and stacked, already-checked inputs (:mod:`vla.heads.stacked`). ``self`` supplies
        only the architecture (config, head counts), never its own weights."""
        raise NotImplementedError

    def act(
        self,
        feature: VLAFeature,
        generator: torch.Generator | None = None,
        deterministic: bool = False,
    ) -> ActOutput:
        """Actions for ``feature`` in the env's units (sampled with ``generator``, or the
        policy's mode); their log-probability is the head's, in its normalised space."""
        out = self.act_normalised(feature, generator, deterministic)
        return ActOutput(self.denormalise_actions(out.actions_B_C_A), out.log_prob_B, out.value_B)

    def log_prob(self, feature: VLAFeature, actions_B_C_A: torch.Tensor) -> torch.Tensor:
        """Log-probability ``log_prob_B`` of env-unit ``actions_B_C_A`` under the policy (in
        the head's normalised space, as :meth:`act` reports it)."""
        self.check_actions(feature, actions_B_C_A)
        normalised_B_C_A = self.normalise_actions(self._as_param(actions_B_C_A))
        return self.log_prob_normalised(feature, normalised_B_C_A)

    def act_normalised(
        self,
        feature: VLAFeature,
        generator: torch.Generator | None,
        deterministic: bool,
    ) -> ActOutput:
        """:meth:`act` in the head's normalised action space (the per-kind part)."""
        raise NotImplementedError

    def log_prob_normalised(self, feature: VLAFeature, actions_B_C_A: torch.Tensor) -> torch.Tensor:
        """:meth:`log_prob` of already-checked, normalised actions (the per-kind part)."""
        raise NotImplementedError
