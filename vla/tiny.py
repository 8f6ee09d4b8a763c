"""Tiny real VLMs built in-process: random (seeded) weights, real configs, real processors.

Tests and the demo need a backbone without downloading anything. These are the real
transformers architectures at toy widths, with a byte-level BPE tokenizer trained in-process
on a built-in corpus of robot instructions, so every code path (processor, save_pretrained,
``from_pretrained``) is the one a real checkpoint directory takes.

* ``tiny``: Idefics3 (the SmolVLM architecture), 64x64 images, patch 8, vision width 64,
  Llama text width 128, 2 + 2 layers (~0.5 M params, 16 tokens per image).
* ``tiny-224``: the same architecture at 224x224, patch 16, vision width 128, text width 256
  (49 tokens per image).
* ``tiny-llava``: a second architecture behind the same interface: Llava with a CLIP vision
  tower and a Llama text model, 64x64 images, patch 8 (64 tokens per image).
* ``tiny-paligemma``: PaliGemma (SigLIP tower, Gemma text model), 64x64, patch 8 (64 tokens).
* ``tiny-idefics2``: Idefics2 (SigLIP-style tower, perceiver resampler to 16 latents, Mistral
  text model), 64x64, patch 8 (18 tokens with the wrappers).
* ``tiny-llava-next``: LlavaNext (CLIP tower, Llama text) with one any-res tile at 64x64, so
  each view is the base image plus one identical tile (2 x 64 tokens + row newlines).

Widths are chosen so the backbone dominates the compute of the small heads trained on it
(DESIGN.md section 3); do not shrink them.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    CLIPImageProcessorPil,
    Idefics2Config,
    Idefics2ForConditionalGeneration,
    Idefics2ImageProcessorPil,
    Idefics2Processor,
    Idefics3Config,
    Idefics3ForConditionalGeneration,
    Idefics3ImageProcessorPil,
    Idefics3Processor,
    LlavaConfig,
    LlavaForConditionalGeneration,
    LlavaNextConfig,
    LlavaNextForConditionalGeneration,
    LlavaNextImageProcessorPil,
    LlavaNextProcessor,
    LlavaProcessor,
    PaliGemmaConfig,
    PaliGemmaForConditionalGeneration,
    PaliGemmaProcessor,
    PreTrainedModel,
    PreTrainedTokenizerFast,
    ProcessorMixin,
    SiglipImageProcessorPil,
)

#: Names accepted by :func:`build_tiny`, :func:`init_checkpoint` and ``Backbone.load``.
TINY_NAMES: tuple[str, ...] = (
    "tiny",
    "tiny-224",
    "tiny-llava",
    "tiny-paligemma",
    "tiny-idefics2",
    "tiny-llava-next",
)

#: Weight seed: the same name always gives the same weights (and checkpoints compare equal).
DEFAULT_SEED = 0

VOCAB_SIZE = 512

PAD, BOS, EOS = "<pad>", "<|im_start|>", "<|im_end|>"
IMAGE, FAKE_AROUND_IMAGE, GLOBAL_IMG, END_OF_UTTERANCE = (
    "<image>",
    "<fake_token_around_image>",
    "<global-img>",
    "<end_of_utterance>",
)
# SmolVLM's tokenizer carries the image-splitting grid tags; keeping them makes the tiny tokenizer
# structurally the same (the Idefics3 processor looks them up even with splitting off).
_ROW_COL = [f"<row_{r}_col_{c}>" for r in range(1, 7) for c in range(1, 7)]
SPECIAL_TOKENS: tuple[str, ...] = (
    PAD,
    BOS,
    EOS,
    IMAGE,
    FAKE_AROUND_IMAGE,
    GLOBAL_IMG,
    END_OF_UTTERANCE,
    *_ROW_COL,
)


@dataclass(frozen=True)
class TinySpec:
    """Widths of one tiny model."""

    arch: str  # a key of _BUILDERS: "idefics3", "llava", "paligemma", "idefics2", "llava_next"
    image_size: int
    patch_size: int
    vision_hidden: int
    text_hidden: int
    vision_layers: int = 2
    text_layers: int = 2
    heads: int = 4


SPECS: dict[str, TinySpec] = {
    "tiny": TinySpec("idefics3", image_size=64, patch_size=8, vision_hidden=64, text_hidden=128),
    "tiny-224": TinySpec(
        "idefics3", image_size=224, patch_size=16, vision_hidden=128, text_hidden=256
    ),
    "tiny-llava": TinySpec("llava", image_size=64, patch_size=8, vision_hidden=64, text_hidden=128),
    "tiny-paligemma": TinySpec("paligemma", 64, patch_size=8, vision_hidden=64, text_hidden=128),
    "tiny-idefics2": TinySpec("idefics2", 64, patch_size=8, vision_hidden=64, text_hidden=128),
    "tiny-llava-next": TinySpec("llava_next", 64, patch_size=8, vision_hidden=64, text_hidden=128),
}


def _corpus() -> list[str]:
    """A deterministic corpus of robot instructions (the tokenizer's training text)."""
    verbs = ["pick up", "put", "push", "move", "place", "grasp", "lift", "open", "close", "stack"]
    colors = ["red", "green", "blue", "yellow", "black", "white", "orange", "purple"]
    objects = ["cube", "block", "bowl", "cup", "mug", "drawer", "sponge", "plate", "can", "peg"]
    places = [
        "on the table",
        "in the bowl",
        "into the drawer",
        "to the left",
        "to the right",
        "on top of the blue block",
        "next to the plate",
        "in the sink",
    ]
    lines = [
        f"{v} the {c} {o} {p}."
        for v, c, o, p in itertools.product(verbs, colors, objects, places)
        if (len(v) + len(c) + len(o) + len(p)) % 3 == 0  # a deterministic third of them
    ]
    lines += [
        "What action should the robot take to complete the task?",
        "In: What action should the robot take? Out:",
        "User: Assistant: the gripper is open, the arm is at home position.",
        "Slowly rotate the handle 90 degrees clockwise, then release 0 1 2 3 4 5 6 7 8 9.",
    ]
    return lines


@cache
def _trained_tokenizer_json() -> str:
    """Train the byte-level BPE once per process (deterministic: fixed corpus, fixed order)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer)
    return tok.to_str()


def build_tokenizer() -> PreTrainedTokenizerFast:
    """The tiny models' tokenizer: byte-level BPE (vocab 512) with the SmolVLM special tokens."""
    tok = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(_trained_tokenizer_json()),
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        extra_special_tokens=[IMAGE, FAKE_AROUND_IMAGE, GLOBAL_IMG, END_OF_UTTERANCE],
        model_max_length=4096,
    )
    if len(tok) > VOCAB_SIZE:  # the embedding table must cover every id
        raise RuntimeError(f"tiny tokenizer has {len(tok)} ids > vocab {VOCAB_SIZE}")
    return tok


def _token_id(tok: PreTrainedTokenizerFast, token: str) -> int:
    token_id = tok.convert_tokens_to_ids(token)
    if not isinstance(token_id, int):
        raise ValueError(f"tokenizer has no single id for {token!r}")
    return token_id


def _text_config(spec: TinySpec, tok: PreTrainedTokenizerFast) -> dict[str, Any]:
    return {
        "model_type": "llama",
        "vocab_size": VOCAB_SIZE,
        "hidden_size": spec.text_hidden,
        "intermediate_size": 2 * spec.text_hidden,
        "num_hidden_layers": spec.text_layers,
        "num_attention_heads": spec.heads,
        "num_key_value_heads": spec.heads,
        "max_position_embeddings": 2048,
        "pad_token_id": tok.pad_token_id,
        "bos_token_id": tok.bos_token_id,
        "eos_token_id": tok.eos_token_id,
        "tie_word_embeddings": True,
    }


def _vision_config(spec: TinySpec) -> dict[str, Any]:
    return {
        "hidden_size": spec.vision_hidden,
        "intermediate_size": 4 * spec.vision_hidden,
        "num_hidden_layers": spec.vision_layers,
        "num_attention_heads": spec.heads,
        "image_size": spec.image_size,
        "patch_size": spec.patch_size,
        "num_channels": 3,
    }


def _build_idefics3(
    spec: TinySpec, tok: PreTrainedTokenizerFast
) -> tuple[PreTrainedModel, ProcessorMixin]:
    scale_factor = 2
    image_seq_len = (spec.image_size // spec.patch_size) ** 2 // scale_factor**2
    config = Idefics3Config(
        vision_config=_vision_config(spec),
        text_config=_text_config(spec, tok),
        scale_factor=scale_factor,
        image_token_id=_token_id(tok, IMAGE),
        tie_word_embeddings=True,
    )
    model = Idefics3ForConditionalGeneration(config)
    image_processor = Idefics3ImageProcessorPil(
        # Splitting off: every view is exactly one global image of image_seq_len tokens.
        do_image_splitting=False,
        size={"longest_edge": spec.image_size},
        max_image_size={"longest_edge": spec.image_size},
    )
    processor = Idefics3Processor(
        image_processor=image_processor, tokenizer=tok, image_seq_len=image_seq_len
    )
    return model, processor


def _build_llava(
    spec: TinySpec, tok: PreTrainedTokenizerFast
) -> tuple[PreTrainedModel, ProcessorMixin]:
    vision = {"model_type": "clip_vision_model", **_vision_config(spec)}
    vision["projection_dim"] = spec.vision_hidden
    config = LlavaConfig(
        vision_config=vision,
        text_config=_text_config(spec, tok),
        image_token_index=_token_id(tok, IMAGE),
        vision_feature_select_strategy="default",
        vision_feature_layer=-1,
        projector_hidden_act="gelu",
        tie_word_embeddings=True,
    )
    model = LlavaForConditionalGeneration(config)
    image_processor = CLIPImageProcessorPil(
        size={"shortest_edge": spec.image_size},
        crop_size={"height": spec.image_size, "width": spec.image_size},
    )
    processor = LlavaProcessor(
        image_processor=image_processor,
        tokenizer=tok,
        patch_size=spec.patch_size,
        vision_feature_select_strategy="default",
        image_token=IMAGE,
        num_additional_image_tokens=1,  # CLIP's CLS token, dropped by the "default" strategy
    )
    return model, processor


def _build_paligemma(
    spec: TinySpec, tok: PreTrainedTokenizerFast
) -> tuple[PreTrainedModel, ProcessorMixin]:
    text = {**_text_config(spec, tok), "model_type": "gemma", "head_dim": spec.text_hidden // 4}
    vision = {"model_type": "siglip_vision_model", **_vision_config(spec)}
    config = PaliGemmaConfig(
        vision_config=vision,
        text_config=text,
        image_token_index=_token_id(tok, IMAGE),
        projection_dim=spec.text_hidden,
        tie_word_embeddings=True,
    )
    model = PaliGemmaForConditionalGeneration(config)
    image_processor = SiglipImageProcessorPil(
        size={"height": spec.image_size, "width": spec.image_size}
    )
    # PaliGemmaProcessor reads the token count per image from its image processor.
    image_processor.image_seq_length = (spec.image_size // spec.patch_size) ** 2  # type: ignore[attr-defined]
    processor = PaliGemmaProcessor(image_processor=image_processor, tokenizer=tok)
    return model, processor


def _build_idefics2(
    spec: TinySpec, tok: PreTrainedTokenizerFast
) -> tuple[PreTrainedModel, ProcessorMixin]:
    latents = 16
    perceiver = {
        "hidden_size": spec.text_hidden,
        "resampler_n_latents": latents,
        "resampler_depth": 1,
        "resampler_n_heads": spec.heads,
        "resampler_head_dim": spec.text_hidden // spec.heads,
        "num_key_value_heads": spec.heads,
    }
    config = Idefics2Config(
        vision_config=_vision_config(spec),
        text_config={**_text_config(spec, tok), "model_type": "mistral"},
        perceiver_config=perceiver,
        image_token_id=_token_id(tok, IMAGE),
        tie_word_embeddings=True,
    )
    model = Idefics2ForConditionalGeneration(config)
    image_processor = Idefics2ImageProcessorPil(
        do_image_splitting=False,
        size={"shortest_edge": spec.image_size, "longest_edge": spec.image_size},
    )
    processor = Idefics2Processor(
        image_processor=image_processor, tokenizer=tok, image_seq_len=latents
    )
    return model, processor


def _build_llava_next(
    spec: TinySpec, tok: PreTrainedTokenizerFast
) -> tuple[PreTrainedModel, ProcessorMixin]:
    vision = {"model_type": "clip_vision_model", **_vision_config(spec)}
    vision["projection_dim"] = spec.vision_hidden
    # One any-res tile at the tower's size: a view's tile equals its base image, so features of
    # one normalised view are exactly what the processor's layout computes.
    grid = [[spec.image_size, spec.image_size]]
    config = LlavaNextConfig(
        vision_config=vision,
        text_config=_text_config(spec, tok),
        image_token_index=_token_id(tok, IMAGE),
        image_grid_pinpoints=grid,
        vision_feature_select_strategy="default",
        vision_feature_layer=-1,
        tie_word_embeddings=True,
    )
    model = LlavaNextForConditionalGeneration(config)
    image_processor = LlavaNextImageProcessorPil(
        size={"shortest_edge": spec.image_size},
        crop_size={"height": spec.image_size, "width": spec.image_size},
        image_grid_pinpoints=grid,
    )
    processor = LlavaNextProcessor(
        image_processor=image_processor,
        tokenizer=tok,
        patch_size=spec.patch_size,
        vision_feature_select_strategy="default",
        image_token=IMAGE,
        num_additional_image_tokens=1,
    )
    return model, processor


_BUILDERS = {
    "idefics3": _build_idefics3,
    "llava": _build_llava,
    "paligemma": _build_paligemma,
    "idefics2": _build_idefics2,
    "llava_next": _build_llava_next,
}


def build_tiny(name: str, seed: int = DEFAULT_SEED) -> tuple[PreTrainedModel, ProcessorMixin]:
    """Build tiny model ``name`` (one of :data:`TINY_NAMES`) and its processor.

    Weights are random but seeded (same ``name`` and ``seed`` give the same weights); the global
    torch RNG is left untouched. The model is returned in eval mode, float32, on CPU.
    """
    spec = SPECS.get(name)
    if spec is None:
        raise ValueError(f"unknown tiny model {name!r}; expected one of {TINY_NAMES}")
    tok = build_tokenizer()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model, processor = _BUILDERS[spec.arch](spec, tok)
    model.eval()
    return model, processor


def init_checkpoint(name: str, out_dir: Path, seed: int = DEFAULT_SEED) -> Path:
    """Write tiny model ``name`` as a checkpoint directory (model + processor + tokenizer).

    The directory has the same layout as a real checkpoint (e.g. a SmolVLM snapshot), so
    services load it through the same ``from_pretrained`` path. Returns ``out_dir``.
    """
    model, processor = build_tiny(name, seed)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir)
    processor.save_pretrained(out_dir)
    return out_dir
