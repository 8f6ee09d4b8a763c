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

from schemas.model import HeadConfig
from vla.heads.base import ActionHead, ActOutput
from vla.heads.blocks import ValueHead
from vla.heads.discrete import DiscreteHead
from vla.heads.flow import FlowHead
from vla.heads.oft import OFTHead

__all__ = [
    "ActOutput",
    "ActionHead",
    "DiscreteHead",
    "FlowHead",
    "OFTHead",
    "ValueHead",
    "build_head",
]

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
