"""The contract between the backbone and the action modules.

* :class:`CompatKey` says which samples can share one backbone forward: same backbone, image
  size, number of views and token budget. Samples normalised under one key have identical
  tensor shapes (text padded to the token budget, images resized), so a group is just a
  concatenation along the batch dimension.
* :class:`ModelInputs` is a normalised batch under one key.
* :class:`VLAFeature` is what heads consume: the prefix hidden states of a configured layer,
  its mask, and the proprio state.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

#: The name under which :class:`ModelInputs` may carry its views as resized uint8 ``(B, V, S, S,
#: 3)`` instead of float32 ``pixel_values`` ``(B, V, 3, S, S)``; the backbone normalises them
#: itself (:meth:`vla.backbone.Backbone.model_kwargs`).
PIXELS_U8 = "pixels_u8"


@dataclass(frozen=True)
class CompatKey:
    """Samples with equal keys normalise to identical model-facing shapes and can be grouped."""

    backbone_id: str
    image_size: int
    num_views: int
    token_budget: int


@dataclass
class ModelInputs:
    """A normalised batch: backbone input tensors (batch-first, shapes fixed by ``key``).

    ``tensors`` holds what the backbone's forward takes (``input_ids``, ``attention_mask``,
    ``pixel_values`` or :data:`PIXELS_U8`, ...). ``proprio_B_P`` is the tenant's proprio state
    (not a backbone input).
    """

    key: CompatKey
    tensors: dict[str, torch.Tensor]
    proprio_B_P: torch.Tensor

    @property
    def batch_size(self) -> int:
        return int(self.tensors["input_ids"].shape[0])

    @staticmethod
    def concat(parts: Sequence[ModelInputs]) -> ModelInputs:
        """Concatenate batches of the same key along dim 0 (proprio dims must match)."""
        if not parts:
            raise ValueError("cannot concatenate zero ModelInputs")
        key = parts[0].key
        for p in parts[1:]:
            if p.key != key:
                raise ValueError(f"incompatible keys in one group: {key} vs {p.key}")
        tensors = ModelInputs.concat_tensors(parts)
        return ModelInputs(key, tensors, torch.cat([p.proprio_B_P for p in parts], dim=0))

    @staticmethod
    def concat_tensors(parts: Sequence[ModelInputs]) -> dict[str, torch.Tensor]:
        """Concatenate only the backbone ``tensors`` of same-key batches along dim 0.

        For a grouped backbone forward over tenants whose proprio dims differ: proprio is not a
        backbone input, so each tenant keeps its own and passes it to :meth:`VLAFeature.split`.
        """
        if not parts:
            raise ValueError("cannot concatenate zero ModelInputs")
        key = parts[0].key
        names = parts[0].tensors.keys()
        for p in parts[1:]:
            if p.key != key:
                raise ValueError(f"incompatible keys in one group: {key} vs {p.key}")
            if p.tensors.keys() != names:
                raise ValueError(
                    f"backbone input names differ in one group: {sorted(names)} vs "
                    f"{sorted(p.tensors.keys())}"
                )
        return {n: torch.cat([p.tensors[n] for p in parts], dim=0) for n in names}


@dataclass
class VLAFeature:
    """Backbone output for a batch: prefix hidden states and mask, plus proprio.

    ``prefix_B_T_D``: hidden states of the configured layer over the prefix tokens (detached;
    the backbone is frozen). ``mask_B_T``: 1 for real tokens, 0 for padding. ``proprio_B_P``:
    the tenant's proprio vector (P may differ between tenants; grouped features carry
    per-tenant proprio after :meth:`split`).
    """

    prefix_B_T_D: torch.Tensor
    mask_B_T: torch.Tensor
    proprio_B_P: torch.Tensor

    @property
    def batch_size(self) -> int:
        return int(self.prefix_B_T_D.shape[0])

    def split(self, sizes: Sequence[int], proprios: Sequence[torch.Tensor]) -> list[VLAFeature]:
        """Partition a grouped feature back into per-tenant views (no copies of the prefix)."""
        if sum(sizes) != self.batch_size:
            raise ValueError(f"split sizes {list(sizes)} do not sum to batch {self.batch_size}")
        prefixes = torch.split(self.prefix_B_T_D, list(sizes), dim=0)
        masks = torch.split(self.mask_B_T, list(sizes), dim=0)
        return [VLAFeature(f, m, p) for f, m, p in zip(prefixes, masks, proprios, strict=True)]
