"""Tenant samples -> fixed-shape model inputs under one compatibility key.

Tenants send 1-3 camera views of any size, free-form instructions and proprio vectors of their
own dimension. A :class:`Normaliser` maps them onto one model-facing layout so that every batch
it produces has identical shapes and batches of different tenants can be concatenated into one
backbone forward (:meth:`vla.feature.ModelInputs.concat`):

    [bos] [image block] x num_views [instruction tokens, right-padded to token_budget]

* Views are resized (stretched, aspect ratio not kept) to the backbone's square image size with
  the processor's PIL filter, then scaled and normalised with the processor's mean/std. Views
  already at that size are not resampled, and then match the HF processor's pixels exactly.
* A sample with fewer than ``num_views`` views **repeats its last view** to fill the slots. We do
  not pad with black: Idefics3 silently drops all-zero images (its "padding images"), which would
  desynchronise image tokens and features; a repeated real view also carries information.
* Instructions are tokenised without special tokens (a literal ``<image>`` in an instruction is
  plain text, it cannot inject image slots), truncated to ``token_budget`` tokens (the head is
  kept), and right-padded with the pad token. Right padding keeps real tokens at the same
  positions regardless of padding, and with causal attention no real token sees a pad.

Total prefix length: :attr:`Normaliser.seq_len` = ``[1 if bos] + num_views *
image_token_count + token_budget``.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch
from PIL import Image
from tokenizers import Tokenizer

from schemas.model import Observation
from vla.feature import PIXELS_U8, CompatKey, ModelInputs

if TYPE_CHECKING:
    from vla.backbone import Backbone


class Normaliser:
    """Normalises samples for one :class:`CompatKey`: (backbone, image size, views, budget).

    Cheap to build (one per key); keep it around, since it caches the tokenisation of repeated
    instructions (robot tasks repeat the same few instructions for many steps). Not thread-safe
    (the cache is a plain LRU): use one per thread or event loop.

    ``uint8_pixels``: keep the resized views as uint8 (:data:`vla.feature.PIXELS_U8`) instead of
    normalising them to float32 ``pixel_values`` (the trainer and the inferencer do): the
    backbone, resident or the backbone role, normalises them when it reads them, with the same
    arithmetic (:meth:`vla.backbone.PixelSpec.normalise`), so the features are the same bits;
    until then the batch is a quarter of the bytes (to digest, to send, to copy to a device).
    """

    def __init__(
        self,
        backbone: Backbone,
        num_views: int,
        token_budget: int,
        *,
        instruction_cache_size: int = 4096,
        uint8_pixels: bool = False,
    ) -> None:
        if not isinstance(num_views, int) or num_views < 1:
            raise ValueError(f"Normaliser.num_views must be an int >= 1, got {num_views!r}")
        if not isinstance(token_budget, int) or token_budget < 1:
            raise ValueError(f"Normaliser.token_budget must be an int >= 1, got {token_budget!r}")
        self.num_views = num_views
        self.token_budget = token_budget
        self.key = CompatKey(backbone.backbone_id, backbone.image_size, num_views, token_budget)
        self._spec = backbone.pixel_spec
        self._pad_id = backbone.pad_token_id

        head = [] if backbone.bos_token_id is None else [backbone.bos_token_id]
        head += list(backbone.image_block_ids) * num_views
        self._head_ids_T = torch.tensor(head, dtype=torch.long)
        self.seq_len = len(head) + token_budget

        # A private copy of the tokenizer with special-token matching off: instructions are
        # user text and must not be able to produce <image> (or any control) tokens.
        self._tok = Tokenizer.from_str(backbone.tokenizer.backend_tokenizer.to_str())
        self._tok.encode_special_tokens = True
        self._tok.no_truncation()
        self._tok.no_padding()
        self._cache: OrderedDict[str, tuple[list[int], int]] = OrderedDict()
        self._cache_size = instruction_cache_size
        self.uint8_pixels = uint8_pixels

    # ------------------------------------------------------------------ public

    def normalise(self, obs_list: Sequence[Observation]) -> ModelInputs:
        """Normalise a batch of observations (one tenant's, or any mix) into :class:`ModelInputs`.

        Raises ``ValueError`` naming the sample and field for: no samples; a view that is not
        ``uint8`` of shape ``(H, W, 3)``; zero or more than ``num_views`` views; a proprio that is
        not float32 ``(P,)``; proprio dims that differ within the batch; a non-str instruction.
        """
        if len(obs_list) == 0:
            raise ValueError("obs_list is empty: need at least one Observation")
        size = self._spec.image_size
        pixels_B_V_S_S_3 = np.empty((len(obs_list), self.num_views, size, size, 3), np.uint8)
        proprios: list[np.ndarray] = []
        instructions: list[str] = []
        for i, obs in enumerate(obs_list):
            n = len(obs.images)
            if not 1 <= n <= self.num_views:
                raise ValueError(
                    f"obs[{i}].images: expected 1 to {self.num_views} views for key {self.key}, "
                    f"got {n}"
                )
            for v in range(self.num_views):
                if v < n:
                    field = f"obs[{i}].images[{v}]"
                    image = _as_numpy(obs.images[v], field)
                    _check_image(image, field)
                    pixels_B_V_S_S_3[i, v] = self._resize(image)
                else:
                    pixels_B_V_S_S_3[i, v] = pixels_B_V_S_S_3[i, n - 1]
            proprio = _as_numpy(obs.proprio, f"obs[{i}].proprio")
            if proprio.dtype != np.float32 or proprio.ndim != 1:
                raise ValueError(
                    f"obs[{i}].proprio: expected float32 vector of shape (P,), got "
                    f"{proprio.dtype} {proprio.shape}"
                )
            if proprios and proprio.shape != proprios[0].shape:
                raise ValueError(
                    f"obs[{i}].proprio: dim {proprio.shape[0]} differs from obs[0].proprio's "
                    f"{proprios[0].shape[0]}; one batch carries one proprio dim"
                )
            proprios.append(proprio)
            if not isinstance(obs.instruction, str):
                raise ValueError(
                    f"obs[{i}].instruction: expected str, got {type(obs.instruction).__name__}"
                )
            instructions.append(obs.instruction)
        return self._assemble(pixels_B_V_S_S_3, instructions, np.stack(proprios))

    def normalise_arrays(
        self,
        images_B_V_H_W_3: np.ndarray,
        instructions: Sequence[str],
        proprio_B_P: np.ndarray,
    ) -> ModelInputs:
        """Fast path for a batch already stacked as arrays (all views of one size).

        ``images_B_V_H_W_3``: uint8, ``1 <= V <= num_views`` (missing views repeat the last one);
        ``instructions``: B strings; ``proprio_B_P``: float32. Same result as :meth:`normalise`.
        """
        images = np.asarray(images_B_V_H_W_3)
        if images.dtype != np.uint8 or images.ndim != 5 or images.shape[-1] != 3:
            raise ValueError(
                f"images_B_V_H_W_3: expected uint8 array of shape (B, V, H, W, 3), got "
                f"{images.dtype} {images.shape}"
            )
        b, v, h, w, _ = images.shape
        if b == 0 or h == 0 or w == 0:
            raise ValueError(f"images_B_V_H_W_3: empty batch or image, shape {images.shape}")
        if not 1 <= v <= self.num_views:
            raise ValueError(
                f"images_B_V_H_W_3: expected 1 to {self.num_views} views for key {self.key}, "
                f"got {v}"
            )
        if len(instructions) != b or not all(isinstance(s, str) for s in instructions):
            raise ValueError(f"instructions: expected {b} str, got {len(instructions)} items")
        proprio = np.asarray(proprio_B_P)
        if proprio.dtype != np.float32 or proprio.ndim != 2 or proprio.shape[0] != b:
            raise ValueError(
                f"proprio_B_P: expected float32 array of shape ({b}, P), got "
                f"{proprio.dtype} {proprio.shape}"
            )
        size = self._spec.image_size
        if (h, w) == (size, size):
            resized = images
        else:
            resized = np.empty((b, v, size, size, 3), np.uint8)
            for i in range(b):
                for j in range(v):
                    resized[i, j] = self._resize(images[i, j])
        if v < self.num_views:
            fill = np.repeat(resized[:, v - 1 : v], self.num_views - v, axis=1)
            resized = np.concatenate([resized, fill], axis=1)
        return self._assemble(resized, list(instructions), proprio, owned=resized is not images)

    # ----------------------------------------------------------------- helpers

    def _resize(self, image_H_W_3: np.ndarray) -> np.ndarray:
        size = self._spec.image_size
        if image_H_W_3.shape[0] == size and image_H_W_3.shape[1] == size:
            return image_H_W_3
        pil = Image.fromarray(np.ascontiguousarray(image_H_W_3))
        # reducing_gap: box-reduce by an integer factor first, then the processor's filter on a
        # <= 3x larger image. PIL documents the result as indistinguishable from full resampling
        # in most cases; measured here 480x640 -> 64x64 Lanczos goes from ~6 to ~2.5 ms.
        resized = pil.resize(
            (size, size), resample=Image.Resampling(self._spec.resample), reducing_gap=3.0
        )
        return np.asarray(resized)

    def _text_ids(self, instruction: str) -> tuple[list[int], int]:
        """Token ids padded/truncated to the budget, and the count of real tokens (cached)."""
        hit = self._cache.get(instruction)
        if hit is not None:
            self._cache.move_to_end(instruction)
            return hit
        ids = self._tok.encode(instruction, add_special_tokens=False).ids[: self.token_budget]
        entry = (ids + [self._pad_id] * (self.token_budget - len(ids)), len(ids))
        self._cache[instruction] = entry
        if len(self._cache) > self._cache_size:
            self._cache.popitem(last=False)
        return entry

    def _assemble(
        self,
        pixels_B_V_S_S_3: np.ndarray,
        instructions: list[str],
        proprio_B_P: np.ndarray,
        *,
        owned: bool = True,
    ) -> ModelInputs:
        """``owned``: the views are an array made here, not the caller's (which a uint8 batch
        must not share: the caller may reuse it before the backbone reads it)."""
        b = len(instructions)
        texts = [self._text_ids(s) for s in instructions]
        text_ids_B_N = torch.tensor([ids for ids, _ in texts], dtype=torch.long)
        lengths_B = torch.tensor([n for _, n in texts], dtype=torch.long)
        head_B_H = self._head_ids_T.expand(b, -1)
        input_ids_B_T = torch.cat([head_B_H, text_ids_B_N], dim=1)
        text_mask_B_N = torch.arange(self.token_budget).unsqueeze(0) < lengths_B.unsqueeze(1)
        attention_mask_B_T = torch.cat(
            [torch.ones_like(head_B_H), text_mask_B_N.to(torch.long)], dim=1
        )

        pixels = np.ascontiguousarray(pixels_B_V_S_S_3)
        # Decoded off the wire, memory is read-only (torch warns on it).
        if not pixels.flags.writeable or (self.uint8_pixels and not owned):
            pixels = pixels.copy()  # uint8: a quarter of a float copy
        u8_B_V_S_S_3 = torch.from_numpy(pixels)
        tensors = {"input_ids": input_ids_B_T, "attention_mask": attention_mask_B_T}
        if self.uint8_pixels:
            tensors[PIXELS_U8] = u8_B_V_S_S_3
        else:
            tensors["pixel_values"] = self._spec.normalise(u8_B_V_S_S_3)
        return ModelInputs(
            key=self.key,
            tensors=tensors,
            proprio_B_P=torch.from_numpy(np.array(proprio_B_P, dtype=np.float32)),
        )


def _as_numpy(value: object, field: str) -> np.ndarray:
    """A schemas Tensor (or ndarray) as numpy, with decode errors naming the field."""
    if isinstance(value, np.ndarray):
        return value
    to_numpy = getattr(value, "to_numpy", None)
    if to_numpy is None:
        raise ValueError(f"{field}: expected a schemas.tensor.Tensor, got {type(value).__name__}")
    try:
        array: np.ndarray = to_numpy()
    except ValueError as e:  # TensorError: payload size/dtype mismatch
        raise ValueError(f"{field}: {e}") from e
    return array


def _check_image(image: np.ndarray, field: str) -> None:
    if image.dtype != np.uint8 or image.ndim != 3 or image.shape[2] != 3:
        raise ValueError(
            f"{field}: expected uint8 image of shape (H, W, 3), got {image.dtype} {image.shape}"
        )
    if image.shape[0] == 0 or image.shape[1] == 0:
        raise ValueError(f"{field}: empty image of shape {image.shape}")


class Normalisers:
    """A role's normalisers: one per (views, token budget) of its backbone, made on first use
    and kept with their instruction caches. Not thread-safe, like a :class:`Normaliser`.

    Their views stay uint8 until the backbone (resident, or the backbone role) normalises
    them: a quarter of float32's bytes to digest for the feature cache and to send to the
    role or a device, and no normalising for a batch the cache answers."""

    def __init__(self, backbone: Backbone) -> None:
        self.backbone = backbone
        self._by_shape: dict[tuple[int, int], Normaliser] = {}

    def get(self, num_views: int, token_budget: int) -> Normaliser:
        key = (num_views, token_budget)
        if key not in self._by_shape:
            self._by_shape[key] = Normaliser(
                self.backbone, num_views, token_budget, uint8_pixels=True
            )
        return self._by_shape[key]
