"""How a checkpoint's own processor lays out one image, found by asking it (no per-model table).

:func:`probe_layout` calls the processor twice on random square images at the vision tower's
size (one image, then two) and reads off everything :class:`vla.backbone.Backbone` needs:

* the image size (the last dims of ``pixel_values``);
* the token ids one image adds (the stretch that repeats between the two calls), plus the
  wrapper special tokens around it (Idefics2's trailing ``<fake_token_around_image>``) but not
  the text template's tokens (PaliGemma's BOS and newline);
* whether ``pixel_values`` is per sample ``(B, V, ...)`` (Idefics2/3) or flat per image
  ``(B*V, ...)`` (Llava, PaliGemma, LlavaNext), and how many sub-images one image becomes
  (LlavaNext's any-res base image + tiles; accepted only when every sub-image equals the whole
  view, i.e. a grid of one tile at the tower's size, since features are computed from one view);
* the other forward inputs the processor makes that the model accepts: per-image ones
  (``image_sizes``, ``pixel_attention_mask``) are replicated per view; per-token ones
  (``token_type_ids``) are rebuilt from two values, one on image-block tokens and one elsewhere.

A layout this cannot express raises :class:`UnsupportedLayout` with the reason.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import numpy as np
import torch
from PIL import Image
from transformers import ProcessorMixin

_CORE_KEYS = ("input_ids", "attention_mask", "pixel_values")


class UnsupportedLayout(ValueError):
    """The processor lays images out in a way features of one view per slot cannot follow."""


@dataclass(frozen=True)
class ImageLayout:
    """One image's layout as the processor makes it (see the module docstring)."""

    image_size: int
    block_ids: tuple[int, ...]
    per_sample_pixels: bool
    sub_images: int
    per_image: dict[str, torch.Tensor]  # key -> one image's value (no leading image dim)
    per_sample_keys: frozenset[str]  # per_image keys laid out (B, V, ...) rather than (B*V, ...)
    per_token: dict[str, tuple[int, int]]  # key -> (value on block tokens, value elsewhere)


def _split_repeat(ids1: list[int], ids2: list[int]) -> tuple[list[int], list[int], list[int]]:
    """``ids1 = prefix + block + suffix`` and ``ids2 = prefix + block + block + suffix``."""
    n = len(ids2) - len(ids1)
    if n <= 0:
        raise UnsupportedLayout("a second image added no tokens to the processor's input_ids")
    for i in range(len(ids1) + 1):
        if ids2[:i] == ids1[:i] and ids2[i + n :] == ids1[i:] and ids2[i : i + n] == ids1[i:][:n]:
            return ids1[:i], ids1[i : i + n], ids1[i + n :]
    raise UnsupportedLayout("one image's tokens do not repeat when a second image is added")


def probe_layout(
    processor: ProcessorMixin, model_forward: object, guess_size: int, text_specials: set[int]
) -> ImageLayout:
    """Ask ``processor`` how it lays out images of side ``guess_size``.

    ``model_forward``: the base model's ``forward`` (its signature decides which extra inputs
    are passed); ``text_specials``: the tokenizer's BOS/EOS/PAD ids (template, not image, tokens).
    """
    image_token: str = getattr(processor, "image_token", "<image>")
    extra: dict[str, bool] = {}
    if getattr(getattr(processor, "image_processor", None), "do_image_splitting", False):
        # We feed one global image per view at the tower's size, so ask for exactly that.
        extra["do_image_splitting"] = False
    rng = np.random.default_rng(0)
    pixels = rng.integers(0, 256, (guess_size, guess_size, 3), dtype=np.uint8)
    image = Image.fromarray(pixels)

    def run(n: int) -> dict[str, torch.Tensor]:
        out = processor(
            text=[image_token * n],
            images=[[image] * n],
            add_special_tokens=False,
            return_tensors="pt",
            **extra,
        )
        return {k: torch.as_tensor(v) for k, v in out.items()}

    one, two = run(1), run(2)
    ids1, ids2 = one["input_ids"][0].tolist(), two["input_ids"][0].tolist()
    prefix, block, suffix = _split_repeat(ids1, ids2)
    added = processor.tokenizer.added_tokens_decoder  # id -> AddedToken
    keep = {i for i, t in added.items() if t.special} - text_specials
    block_ids = [i for i in prefix if i in keep] + block + [i for i in suffix if i in keep]

    pv1, pv2 = one["pixel_values"], two["pixel_values"]
    per_sample = pv2.shape[0] == 1 and pv2.ndim >= 2 and pv2.shape[1] == 2
    if not per_sample and pv2.shape[0] != 2:
        raise UnsupportedLayout(f"pixel_values of shape {tuple(pv2.shape)} for two images")
    image_px = pv1[0, 0] if per_sample else pv1[0]
    size = int(image_px.shape[-1])
    if image_px.ndim < 3 or tuple(image_px.shape[-3:]) != (3, size, size):
        raise UnsupportedLayout(f"one image's pixel_values {tuple(image_px.shape)} are not square")
    subs_N_3_S_S = image_px.reshape(-1, 3, size, size)
    if not all(torch.equal(s, subs_N_3_S_S[0]) for s in subs_N_3_S_S[1:]):
        raise UnsupportedLayout(
            f"the processor tiles one {size}x{size} view into {len(subs_N_3_S_S)} different "
            "sub-images (any-res tiling); configure a single tile at the tower's size "
            f"(e.g. image_grid_pinpoints=[[{size}, {size}]])"
        )

    accepted = set(inspect.signature(model_forward).parameters)  # type: ignore[arg-type]
    per_image: dict[str, torch.Tensor] = {}
    per_sample_keys: set[str] = set()
    per_token: dict[str, tuple[int, int]] = {}
    block_set = torch.tensor(sorted(set(block)))
    for key in sorted(set(one) - set(_CORE_KEYS)):
        if key not in accepted or key not in two:
            continue
        v1, v2 = one[key], two[key]
        if v1.shape == one["input_ids"].shape:
            on_block = torch.isin(one["input_ids"][0], block_set)
            on, off = v1[0][on_block].unique(), v1[0][~on_block].unique()
            if len(on) != 1 or len(off) > 1:
                raise UnsupportedLayout(f"per-token input {key!r} is not one value per token kind")
            per_token[key] = (int(on), int(off[0]) if len(off) else 0)
        elif v2.ndim >= 2 and v2.shape[0] == 1 and v2.shape[1] == 2:
            per_image[key] = v1[0, 0]
            per_sample_keys.add(key)
        elif v2.shape[0] == 2 and v1.shape[0] == 1:
            per_image[key] = v1[0]
        else:
            raise UnsupportedLayout(f"processor input {key!r} has no per-image or per-token layout")
    return ImageLayout(
        image_size=size,
        block_ids=tuple(block_ids),
        per_sample_pixels=per_sample,
        sub_images=len(subs_N_3_S_S),
        per_image=per_image,
        per_sample_keys=frozenset(per_sample_keys),
        per_token=per_token,
    )
