"""The frozen, resident VLM backbone: load once, encode normalised batches into VLAFeatures.

A backbone comes from a local checkpoint directory (``save_pretrained`` layout) of any
``AutoModelForImageTextToText`` architecture whose ``AutoProcessor`` loads offline (Idefics3 /
SmolVLM, Llava, PaliGemma, Idefics2, LlavaNext are tested), or, for tests and the demo, from a
tiny model built in-process (:data:`vla.tiny.TINY_NAMES`). Nothing is downloaded. The image-token
layout is asked of the checkpoint's processor (:mod:`vla.layout`), not looked up per model.

:meth:`Backbone.encode` runs one forward of the multimodal base model (no LM head, no KV cache)
under ``torch.inference_mode()`` and returns the hidden states of ``feature_layer``. Decoder
layers above ``feature_layer`` are dropped at load time and a hook stops the forward there, so
they (and the final norm) cost neither memory nor compute, for any architecture.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle
from transformers import (
    AutoModelForImageTextToText,
    AutoProcessor,
    PreTrainedModel,
    ProcessorMixin,
)

from schemas.ids import validate_id
from vla.feature import PIXELS_U8, ModelInputs, VLAFeature
from vla.layout import ImageLayout, probe_layout
from vla.tiny import TINY_NAMES, build_tiny

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

    def normalise(self, pixels_B_V_S_S_3: torch.Tensor) -> torch.Tensor:
        """Resized uint8 views ``(B, V, S, S, 3)`` as float32 ``pixel_values`` ``(B, V, 3, S,
        S)``: the processors' ``(x * rescale_factor - mean) / std``. Every place that turns
        pixels into values calls this (:class:`vla.normalize.Normaliser` for float batches,
        :meth:`Backbone.model_kwargs` for uint8 ones), so both become the same bits."""
        mean_3_1_1 = torch.tensor(self.mean, dtype=torch.float32).view(3, 1, 1)
        std_3_1_1 = torch.tensor(self.std, dtype=torch.float32).view(3, 1, 1)
        values = pixels_B_V_S_S_3.permute(0, 1, 4, 2, 3).to(torch.float32)
        values.mul_(self.rescale_factor).sub_(mean_3_1_1).div_(std_3_1_1)
        return values.contiguous()


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
    * ``model_type``: ``config.model_type`` (``"idefics3"``, ``"llava"``, ``"paligemma"``, ...).
    * ``layout``: the processor's image layout (:class:`vla.layout.ImageLayout`).
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
        self.backbone_id = validate_id(backbone_id, "backbone_id")
        self.model = model
        self.processor = processor
        self.model_type = model_type
        # The multimodal base model (vision tower + connector + decoder), without the LM head:
        # we never need logits, and for real vocabularies (49k for SmolVLM) they dominate.
        base = getattr(model, "model", None)
        if not isinstance(base, nn.Module):
            raise ValueError(f"{model_type}: {type(model).__name__} has no base model (.model)")
        self._base: nn.Module = base
        text_config = model.config.get_text_config()
        layers = _decoder_layers(base, int(text_config.num_hidden_layers), model_type)
        self.feature_layer, self._hook = _stop_at_feature_layer(layers, feature_layer)
        model.requires_grad_(False)
        model.eval()
        self._released = False

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

        vision_config = getattr(model.config, "vision_config", None)
        guess = int(getattr(vision_config, "image_size", 224))
        specials = {tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id}
        try:
            layout = probe_layout(processor, base.forward, guess, specials - {None})
        except ValueError as e:
            raise ValueError(f"backbone {self.backbone_id!r} ({model_type}): {e}") from e
        self.layout: ImageLayout = layout
        self.image_size = layout.image_size
        ip = processor.image_processor
        self.pixel_spec = PixelSpec(
            image_size=self.image_size,
            resample=int(ip.resample) if ip.resample is not None else 2,  # PIL BILINEAR
            rescale_factor=float(ip.rescale_factor) if ip.do_rescale else 1.0,
            mean=_channel_triple(ip.image_mean if ip.do_normalize else None, 0.0),
            std=_channel_triple(ip.image_std if ip.do_normalize else None, 1.0),
        )
        self.image_block_ids = layout.block_ids
        self.image_token_count = len(self.image_block_ids)
        self._block_ids_N = torch.tensor(sorted(set(layout.block_ids)), device=self.device)

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
            model, processor = _load_checkpoint(path, torch_dtype)
            default_id = _id_from_path(path.resolve())
        # transformers' decorated ``to`` is mistyped for mypy (it sees an unbound wrapper).
        model = model.to(device=device, dtype=torch_dtype)  # type: ignore[call-arg]
        return cls(
            model, processor, backbone_id=backbone_id or default_id, feature_layer=feature_layer
        )

    @property
    def holds_weights(self) -> bool:
        """False after :meth:`release_weights`: the backbone only normalises, never encodes."""
        return not self._released

    def weights_digest(self) -> str:
        """A digest of the weights features are computed with (each tensor's name, dtype,
        shape and bytes): what tells the features of a checkpoint rewritten in place, under
        the same backbone id, from the old weights'. Reads every weight once (seconds for a
        large model: computed only where a store keeps features across processes)."""
        if self._released:
            raise RuntimeError("the weights were released: take their digest before")
        digest = hashlib.sha256()
        for name, tensor in sorted(self.model.state_dict().items()):
            flat = tensor.detach().to("cpu").contiguous().reshape(-1)
            digest.update(f"{name}|{flat.dtype}|{tuple(tensor.shape)}|".encode())
            digest.update(flat.view(torch.uint8).numpy())
        return digest.hexdigest()[:32]

    def release_weights(self) -> None:
        """Free the model's weights and keep what normalising samples needs (processor,
        layout, pixel spec, ids, hidden size): for a process whose features come from the
        backbone role (``--backbone-service``), which must not hold a second copy. The model's
        tensors move to the meta device (no storage); :meth:`encode` refuses from then on."""
        self.model.to("meta")  # type: ignore[arg-type]
        self._released = True

    def model_kwargs(self, inputs: ModelInputs) -> dict[str, torch.Tensor]:
        """The base model's forward kwargs for ``inputs``, on this backbone's device and dtype."""
        key = inputs.key
        if key.backbone_id != self.backbone_id or key.image_size != self.image_size:
            raise ValueError(
                f"ModelInputs for {key} do not belong to backbone {self.backbone_id!r} "
                f"(image size {self.image_size})"
            )
        t = inputs.tensors
        layout = self.layout
        input_ids_B_T = t["input_ids"].to(self.device, non_blocking=True)
        values_B_V_3_S_S = t["pixel_values"] if PIXELS_U8 not in t else self._values_of(inputs)
        pixels_B_V_3_S_S = values_B_V_3_S_S.to(self.device, self.dtype, non_blocking=True)
        b, v = pixels_B_V_3_S_S.shape[:2]
        if layout.sub_images > 1:  # every sub-image is the whole view (checked at load)
            pixels = pixels_B_V_3_S_S.unsqueeze(2).expand(-1, -1, layout.sub_images, -1, -1, -1)
        else:
            pixels = pixels_B_V_3_S_S
        if not layout.per_sample_pixels:
            pixels = pixels.flatten(0, 1)  # (B, V, ...) -> (B*V, ...), sample-major
        kwargs = {
            "input_ids": input_ids_B_T,
            "attention_mask": t["attention_mask"].to(self.device, non_blocking=True),
            "pixel_values": pixels,
        }
        for name, one in layout.per_image.items():
            one = one.to(self.device)
            lead = (b, v) if name in layout.per_sample_keys else (b * v,)
            kwargs[name] = one.expand(*lead, *one.shape).clone()
        if layout.per_token:
            on_block_B_T = torch.isin(input_ids_B_T, self._block_ids_N)
            for name, (on, off) in layout.per_token.items():
                kwargs[name] = torch.where(on_block_B_T, on, off)
        return kwargs

    def _values_of(self, inputs: ModelInputs) -> torch.Tensor:
        """``pixel_values`` of inputs that carry uint8 views (:data:`vla.feature.PIXELS_U8`),
        normalised here as a float-making normaliser would have; a view tensor of another
        shape or dtype than the key implies is refused, naming it."""
        key = inputs.key
        pixels = inputs.tensors[PIXELS_U8]
        size = self.image_size
        b = int(inputs.tensors["input_ids"].shape[0])
        expect = (b, key.num_views, size, size, 3)
        if pixels.dtype != torch.uint8 or tuple(pixels.shape) != expect:
            raise ValueError(
                f"{PIXELS_U8}: expected uint8 {expect} for {key}, got {pixels.dtype} "
                f"{tuple(pixels.shape)}"
            )
        if "pixel_values" in inputs.tensors:
            raise ValueError(f"inputs carry both pixel_values and {PIXELS_U8}; send one")
        # uint8 crosses to the device (a quarter of the float bytes) and is normalised there.
        return self.pixel_spec.normalise(pixels.to(self.device, non_blocking=True))

    def encode(self, inputs: ModelInputs) -> VLAFeature:
        """One backbone forward over the whole batch -> :class:`VLAFeature`.

        ``prefix_B_T_D`` is float32 whatever the model dtype, on the backbone's device, and is an
        ordinary tensor (not an inference tensor), so trainable heads can use it in autograd.
        ``mask_B_T`` is the attention mask; ``proprio_B_P`` is passed through (moved to device).
        """
        if self._released:
            raise RuntimeError(
                f"backbone {self.backbone_id!r} released its weights: its features come from "
                "the backbone role"
            )
        kwargs = self.model_kwargs(inputs)
        with torch.inference_mode():
            hidden_B_T_D = self.hidden_states(kwargs)
        # Outside inference mode: the copy is a normal tensor that autograd may save. It is also
        # the float32 cast for bf16 models, so it costs nothing extra there.
        prefix_B_T_D = hidden_B_T_D.to(torch.float32, copy=True)
        return VLAFeature(
            prefix_B_T_D=prefix_B_T_D,
            mask_B_T=kwargs["attention_mask"],
            proprio_B_P=inputs.proprio_B_P.to(self.device),
        )

    def hidden_states(self, kwargs: dict[str, torch.Tensor]) -> torch.Tensor:
        """The feature layer's hidden states ``[B, T, D]`` for :meth:`model_kwargs` output, in
        the model's dtype, under whatever grad mode the caller set (:meth:`encode` runs it in
        inference mode; pretraining, :mod:`vla.pretrain`, with gradients)."""
        if self._hook is None:
            out = self._base(**kwargs, use_cache=False, return_dict=True)
            return out.last_hidden_state
        try:
            self._base(**kwargs, use_cache=False, return_dict=True)
        except _FeatureReached as reached:
            return reached.hidden_B_T_D
        raise RuntimeError("the feature-layer hook did not fire")

    def image_token_mask(self, input_ids_B_T: torch.Tensor) -> torch.Tensor:
        """``[B, T]`` bool: which prefix tokens belong to image blocks."""
        return torch.isin(input_ids_B_T, self._block_ids_N)


class _FeatureReached(Exception):
    """Raised by the feature-layer hook to stop the forward once the features exist."""

    def __init__(self, hidden_B_T_D: torch.Tensor) -> None:
        super().__init__("feature layer reached")
        self.hidden_B_T_D = hidden_B_T_D


def _load_checkpoint(path: Path, dtype: torch.dtype) -> tuple[PreTrainedModel, ProcessorMixin]:
    """Model and processor from a local directory; a processor that cannot load is refused."""
    try:
        processor = AutoProcessor.from_pretrained(path, local_files_only=True)
    except Exception as e:  # any import/config failure: refuse with transformers' own reason
        raise ValueError(
            f"backbone {str(path)!r}: its processor cannot be loaded here ({type(e).__name__}: "
            f"{e}); processors that need torchvision (Qwen2-VL, InternVL, Pixtral, video "
            "processors) do not load beside this torch"
        ) from e
    if not isinstance(processor, ProcessorMixin) or getattr(processor, "tokenizer", None) is None:
        raise ValueError(
            f"backbone {str(path)!r}: {type(processor).__name__} is not a multimodal processor "
            "with a tokenizer"
        )
    model = AutoModelForImageTextToText.from_pretrained(path, dtype=dtype, local_files_only=True)
    return model, processor


def _decoder_layers(base: nn.Module, num_layers: int, model_type: str) -> nn.ModuleList:
    """The language model's decoder layer list: ``get_decoder().layers``, else the one
    ``ModuleList`` under the decoder with ``num_hidden_layers`` entries."""
    get_decoder = getattr(base, "get_decoder", None)
    decoder = get_decoder() if callable(get_decoder) else base
    layers = getattr(decoder, "layers", None)
    if isinstance(layers, nn.ModuleList) and len(layers) == num_layers:
        return layers
    found = [m for m in decoder.modules() if isinstance(m, nn.ModuleList) and len(m) == num_layers]
    if len(found) != 1:
        raise ValueError(
            f"{model_type}: cannot find the decoder's {num_layers}-layer list "
            f"({len(found)} candidates)"
        )
    return found[0]


def _stop_at_feature_layer(
    layers: nn.ModuleList, feature_layer: int
) -> tuple[int, RemovableHandle | None]:
    """Resolve ``feature_layer`` and make the forward stop there; layers above it are dropped.

    ``hidden_states[L]`` (L layers) is the decoder's normed output: nothing to change. For
    ``k < L`` a hook on layer ``k - 1``'s output (or layer 0's input for ``k = 0``) raises
    :class:`_FeatureReached` with the hidden states, so neither the layers above, the final
    norm nor anything after the decoder runs, whatever the architecture calls them. The layers
    above are deleted so they cost no memory either (layer 0 stays for ``k = 0``, unrun)."""
    num_layers = len(layers)
    k = feature_layer if feature_layer >= 0 else num_layers + 1 + feature_layer
    if not 0 <= k <= num_layers:
        raise ValueError(
            f"feature_layer {feature_layer} out of range for a {num_layers}-layer decoder "
            f"(valid: {-num_layers - 1}..{num_layers})"
        )
    if k == num_layers:
        return k, None
    del layers[max(k, 1) :]
    if k == 0:
        return k, layers[0].register_forward_pre_hook(_raise_with_input, with_kwargs=True)
    return k, layers[k - 1].register_forward_hook(_raise_with_output)


def _first_tensor(value: object) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, tuple | list) and value and isinstance(value[0], torch.Tensor):
        return value[0]
    raise TypeError(f"decoder layer passed {type(value).__name__}, expected hidden states")


def _raise_with_input(_module: nn.Module, args: tuple, kwargs: dict) -> None:
    hidden = args[0] if args else kwargs["hidden_states"]
    raise _FeatureReached(_first_tensor(hidden))


def _raise_with_output(_module: nn.Module, _args: tuple, output: object) -> None:
    raise _FeatureReached(_first_tensor(output))
