"""The frozen, resident VLM backbone: load once, encode normalised batches into VLAFeatures.

A backbone comes from a local checkpoint directory (``save_pretrained`` layout, e.g. a SmolVLM
snapshot, which is Idefics3) or, for tests and the demo, from a tiny model built in-process
(:data:`vla.tiny.TINY_NAMES`). Nothing is downloaded.

:meth:`Backbone.encode` runs one forward of the multimodal base model (no LM head, no KV cache)
under ``torch.inference_mode()`` and returns the hidden states of ``feature_layer``. Decoder
layers above ``feature_layer`` are dropped at load time, so they cost neither memory nor compute.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn
from transformers import (
    AutoModelForImageTextToText,
    AutoProcessor,
    PreTrainedModel,
    ProcessorMixin,
)

from schemas.ids import validate_id
from vla.feature import ModelInputs, VLAFeature
from vla.tiny import TINY_NAMES, build_tiny

#: Architectures whose input layout :meth:`Backbone.encode` knows. Idefics3 covers SmolVLM(1)
#: checkpoints; it takes pixels as ``(B, V, 3, H, W)``. Llava takes one flat ``(B*V, 3, H, W)``.
_PIXELS_PER_SAMPLE = {"idefics3": True, "llava": False}

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class PixelSpec:
    """How uint8 RGB becomes ``pixel_values``: resize to ``image_size`` square with the PIL filter
    ``resample``, then ``(x * rescale_factor - mean) / std`` per channel (the processor's own
    constants, so a real checkpoint sees the statistics it was trained with)."""

    image_size: int
    resample: int
    rescale_factor: float
    mean: tuple[float, float, float]
    std: tuple[float, float, float]


def _channel_triple(value: float | list[float] | tuple[float, ...] | None, default: float) -> tuple:
    if value is None:
        return (default,) * 3
    if isinstance(value, int | float):
        return (float(value),) * 3
    return tuple(float(v) for v in value)


def _id_from_path(path: Path) -> str:
    """A subject-safe id from a checkpoint directory's name.

    A hub cache snapshot (``models--org--name/snapshots/<hash>``) is named after the repo, not
    the hash, so two snapshots of one model read naturally in logs and subjects."""
    name = path.name
    if path.parent.name == "snapshots" and path.parent.parent.name.startswith("models--"):
        name = path.parent.parent.name.removeprefix("models--")
    slug = re.sub(r"[^a-z0-9-]+", "-", name.lower()).strip("-")[:64].strip("-")
    return slug or "backbone"


class Backbone:
    """A frozen VLM, resident on one device, that turns :class:`ModelInputs` into features.

    Build it with :meth:`load`. Attributes:

    * ``backbone_id``: subject-safe id (``[a-z0-9][a-z0-9-]{0,63}``), part of every CompatKey.
    * ``model`` / ``processor``: the transformers objects (frozen, eval mode).
    * ``model_type``: ``config.model_type`` (``"idefics3"`` or ``"llava"``).
    * ``hidden_size``: width D of the features; ``num_params``: parameters kept resident.
    * ``feature_layer``: the resolved hidden-state index (0 = embeddings, ``L`` = final normed
      output, as in transformers' ``hidden_states``).
    * ``image_size``: side of the square images the vision tower takes.
    * ``image_token_count``: prefix tokens one image occupies, including wrapper tokens
      (Idefics3: ``<fake_token_around_image><global-img>`` + N ``<image>`` + fake token).
    * ``image_block_ids``: those token ids; ``bos_token_id`` / ``pad_token_id``: text specials.
    * ``pixel_spec``: the image normalisation constants (see :class:`PixelSpec`).
    """

    def __init__(
        self,
        model: PreTrainedModel,
        processor: ProcessorMixin,
        *,
        backbone_id: str,
        feature_layer: int = -1,
    ) -> None:
        """Wrap an already loaded model and processor; prefer :meth:`load`."""
        model_type = str(model.config.model_type)
        if model_type not in _PIXELS_PER_SAMPLE:
            raise ValueError(
                f"unsupported backbone model_type {model_type!r}; supported: "
                f"{sorted(_PIXELS_PER_SAMPLE)}"
            )
        self.backbone_id = validate_id(backbone_id, "backbone_id")
        self.model = model
        self.processor = processor
        self.model_type = model_type
        self._pixels_per_sample = _PIXELS_PER_SAMPLE[model_type]
        # The multimodal base model (vision tower + connector + decoder), without the LM head:
        # we never need logits, and for real vocabularies (49k for SmolVLM) they dominate.
        self._base: nn.Module = model.model
        decoder = self._base.get_decoder()
        self.feature_layer = self._truncate_decoder(decoder, feature_layer)
        model.requires_grad_(False)
        model.eval()

        text_config = model.config.get_text_config()
        self.hidden_size = int(text_config.hidden_size)
        self.num_params = sum(p.numel() for p in model.parameters())
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype

        tokenizer = processor.tokenizer
        self.tokenizer = tokenizer
        self.bos_token_id: int | None = tokenizer.bos_token_id
        pad = tokenizer.pad_token_id
        if pad is None:
            pad = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else 0
        self.pad_token_id = int(pad)

        self.image_size = int(model.config.vision_config.image_size)
        ip = processor.image_processor
        self.pixel_spec = PixelSpec(
            image_size=self.image_size,
            resample=int(ip.resample) if ip.resample is not None else 2,  # PIL BILINEAR
            rescale_factor=float(ip.rescale_factor) if ip.do_rescale else 1.0,
            mean=_channel_triple(ip.image_mean if ip.do_normalize else None, 0.0),
            std=_channel_triple(ip.image_std if ip.do_normalize else None, 1.0),
        )
        self.image_block_ids = self._image_block_ids()
        self.image_token_count = len(self.image_block_ids)

    @classmethod
    def load(
        cls,
        path_or_name: str | Path,
        *,
        dtype: str = "float32",
        device: str | torch.device = "cpu",
        feature_layer: int = -1,
        backbone_id: str | None = None,
    ) -> Backbone:
        """Load a frozen backbone.

        ``path_or_name`` is a local checkpoint directory (``from_pretrained`` layout; loaded with
        ``local_files_only``) or one of :data:`vla.tiny.TINY_NAMES` (built in-process, seeded).
        ``dtype``: ``"float32"`` (CPU default) or ``"bfloat16"``/``"float16"`` (for CUDA).
        ``feature_layer``: which hidden state heads consume, indexed like transformers'
        ``hidden_states`` (-1 = final normed output). ``backbone_id`` overrides the id derived
        from the directory or tiny name.
        """
        torch_dtype = _DTYPES.get(dtype)
        if torch_dtype is None:
            raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
        model: PreTrainedModel
        processor: ProcessorMixin
        if isinstance(path_or_name, str) and path_or_name in TINY_NAMES:
            model, processor = build_tiny(path_or_name)
            default_id = path_or_name
        else:
            path = Path(path_or_name)
            if not path.is_dir():
                raise ValueError(
                    f"backbone {str(path_or_name)!r} is neither a checkpoint directory nor a "
                    f"tiny model name {TINY_NAMES}"
                )
            model = AutoModelForImageTextToText.from_pretrained(
                path, dtype=torch_dtype, local_files_only=True
            )
            processor = AutoProcessor.from_pretrained(path, local_files_only=True)
            default_id = _id_from_path(path.resolve())
        # transformers' decorated ``to`` is mistyped for mypy (it sees an unbound wrapper).
        model = model.to(device=device, dtype=torch_dtype)  # type: ignore[call-arg]
        return cls(
            model, processor, backbone_id=backbone_id or default_id, feature_layer=feature_layer
        )

    @staticmethod
    def _truncate_decoder(decoder: nn.Module, feature_layer: int) -> int:
        """Drop decoder layers above ``feature_layer``; return it as a non-negative index.

        With ``k`` layers kept and the final norm replaced by identity, the decoder's
        ``last_hidden_state`` *is* ``hidden_states[k]`` (hidden_states[L] is the normed output,
        which needs no change), so no layer runs that we would throw away and we never ask
        transformers to record every layer's output."""
        layers = decoder.layers
        num_layers = len(layers)  # type: ignore[arg-type]
        k = feature_layer if feature_layer >= 0 else num_layers + 1 + feature_layer
        if not 0 <= k <= num_layers:
            raise ValueError(
                f"feature_layer {feature_layer} out of range for a {num_layers}-layer decoder "
                f"(valid: {-num_layers - 1}..{num_layers})"
            )
        if k < num_layers:
            decoder.layers = layers[:k]  # type: ignore[index]
            decoder.norm = nn.Identity()
        return k

    def _image_block_ids(self) -> tuple[int, ...]:
        """The token ids one image expands to, asked of the processor itself (so a real
        checkpoint's layout, e.g. SmolVLM's wrapper tokens, is reproduced exactly)."""
        blank = np.zeros((self.image_size, self.image_size, 3), dtype=np.uint8)
        image_token: str = getattr(self.processor, "image_token", "<image>")
        extra: dict[str, bool] = {}
        if self.model_type == "idefics3":
            # Real SmolVLM processors split large images into tiles; we always feed one global
            # image per view at the vision tower's size, so ask for exactly that layout.
            extra["do_image_splitting"] = False
        out = self.processor(
            text=[image_token], images=[[blank]], add_special_tokens=False, **extra
        )
        ids = out["input_ids"][0]
        return tuple(int(i) for i in ids)

    def model_kwargs(self, inputs: ModelInputs) -> dict[str, torch.Tensor]:
        """The base model's forward kwargs for ``inputs``, on this backbone's device and dtype."""
        key = inputs.key
        if key.backbone_id != self.backbone_id or key.image_size != self.image_size:
            raise ValueError(
                f"ModelInputs for {key} do not belong to backbone {self.backbone_id!r} "
                f"(image size {self.image_size})"
            )
        t = inputs.tensors
        pixels = t["pixel_values"].to(self.device, self.dtype, non_blocking=True)
        if not self._pixels_per_sample:
            pixels = pixels.flatten(0, 1)  # (B, V, 3, H, W) -> (B*V, 3, H, W), sample-major
        return {
            "input_ids": t["input_ids"].to(self.device, non_blocking=True),
            "attention_mask": t["attention_mask"].to(self.device, non_blocking=True),
            "pixel_values": pixels,
        }

    def encode(self, inputs: ModelInputs) -> VLAFeature:
        """One backbone forward over the whole batch -> :class:`VLAFeature`.

        ``prefix_B_T_D`` is float32 whatever the model dtype, on the backbone's device, and is an
        ordinary tensor (not an inference tensor), so trainable heads can use it in autograd.
        ``mask_B_T`` is the attention mask; ``proprio_B_P`` is passed through (moved to device).
        """
        kwargs = self.model_kwargs(inputs)
        with torch.inference_mode():
            out = self._base(**kwargs, use_cache=False, return_dict=True)
            hidden_B_T_D = out.last_hidden_state
        # Outside inference mode: the copy is a normal tensor that autograd may save. It is also
        # the float32 cast for bf16 models, so it costs nothing extra there.
        prefix_B_T_D = hidden_B_T_D.to(torch.float32, copy=True)
        return VLAFeature(
            prefix_B_T_D=prefix_B_T_D,
            mask_B_T=kwargs["attention_mask"],
            proprio_B_P=inputs.proprio_B_P.to(self.device),
        )
