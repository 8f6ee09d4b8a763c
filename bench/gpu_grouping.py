"""The group-batching sweep on a GPU-sized backbone: build a >= 0.5 B-parameter VLM from a
config (random weights, seeded; nothing downloaded), run ``joynexus bench grouping``'s cells
on it and write the same JSON.

The default preset, ``0.6b``, is the SmolVLM architecture (Idefics3) at real widths: a
SigLIP-base vision tower (768 wide, 12 layers, 16-pixel patches) on 256 x 256 views, pixel
shuffle by 2 (64 image tokens per view, as SmolVLM's), and a Llama decoder 1536 wide with 20
layers, 12 heads / 4 KV heads and a 4096 MLP — about 0.59 B parameters — in bfloat16 on CUDA.
The tokenizer is the tiny models' (vocab 512): the embedding table is small, every other
weight is full size, so the backbone's compute per token is a real model's. ``--tiny`` builds
the same architecture at toy widths on the CPU in float32, so a test can run the whole script.

    python -m bench.gpu_grouping --json out/grouping-gpu.json       # needs a CUDA device
    python -m bench.gpu_grouping --tiny --tenants 1,2 --local-batch 1,2 --repeats 1 --json F
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch
from transformers import (
    Idefics3Config,
    Idefics3ForConditionalGeneration,
    Idefics3ImageProcessorPil,
    Idefics3Processor,
)

from bench.grouping import DEFAULT_REPEATS, STAGES, format_table, int_list, sweep
from vla import tiny
from vla.backbone import Backbone

#: Parameters the full-size preset must reach (the issue's bar for a GPU-sized backbone).
MIN_PARAMS = 500_000_000


@dataclass(frozen=True)
class Preset:
    """Widths of the Idefics3 backbone the script builds."""

    image_size: int
    patch_size: int
    vision_hidden: int
    vision_layers: int
    vision_heads: int
    vision_mlp: int
    text_hidden: int
    text_layers: int
    text_heads: int
    text_kv_heads: int
    text_mlp: int
    scale_factor: int = 2


PRESETS: dict[str, Preset] = {
    "0.6b": Preset(256, 16, 768, 12, 12, 3072, 1536, 20, 12, 4, 4096),
    "tiny": Preset(64, 8, 64, 2, 4, 256, 128, 2, 4, 4, 256),
}


def build_model(
    preset: str, device: str | torch.device, seed: int = 0
) -> tuple[Idefics3ForConditionalGeneration, Idefics3Processor]:
    """The preset's model (seeded random float32 weights, built on ``device``; ``"meta"``
    builds only the shapes) and its processor."""
    p = PRESETS[preset]
    tok = tiny.build_tokenizer()
    image_token = tok.convert_tokens_to_ids(tiny.IMAGE)
    if not isinstance(image_token, int):
        raise RuntimeError(f"tokenizer has no id for {tiny.IMAGE!r}")
    config = Idefics3Config(
        vision_config={
            "hidden_size": p.vision_hidden,
            "intermediate_size": p.vision_mlp,
            "num_hidden_layers": p.vision_layers,
            "num_attention_heads": p.vision_heads,
            "image_size": p.image_size,
            "patch_size": p.patch_size,
            "num_channels": 3,
        },
        text_config={
            "model_type": "llama",
            "vocab_size": tiny.VOCAB_SIZE,
            "hidden_size": p.text_hidden,
            "intermediate_size": p.text_mlp,
            "num_hidden_layers": p.text_layers,
            "num_attention_heads": p.text_heads,
            "num_key_value_heads": p.text_kv_heads,
            "max_position_embeddings": 4096,
            "pad_token_id": tok.pad_token_id,
            "bos_token_id": tok.bos_token_id,
            "eos_token_id": tok.eos_token_id,
            "tie_word_embeddings": True,
        },
        scale_factor=p.scale_factor,
        image_token_id=image_token,
        tie_word_embeddings=True,
    )
    torch.manual_seed(seed)
    # Built on the device: a 0.6 B float32 init on the CPU would take longer than the sweep.
    with torch.device(device):
        model = Idefics3ForConditionalGeneration(config)
    image_seq_len = (p.image_size // p.patch_size) ** 2 // p.scale_factor**2
    processor = Idefics3Processor(
        image_processor=Idefics3ImageProcessorPil(
            do_image_splitting=False,
            size={"longest_edge": p.image_size},
            max_image_size={"longest_edge": p.image_size},
        ),
        tokenizer=tok,
        image_seq_len=image_seq_len,
    )
    return model, processor


def build_backbone(preset: str, device: str, dtype: str, seed: int = 0) -> Backbone:
    """The preset's backbone with seeded random weights, on ``device`` in ``dtype``."""
    model, processor = build_model(preset, device, seed)
    model = model.to(dtype=getattr(torch, dtype))  # type: ignore[call-arg]
    return Backbone(model, processor, backbone_id=f"idefics3-{preset.replace('.', '-')}")


def run(
    preset: str,
    device: str,
    dtype: str,
    tenants: Sequence[int],
    local_batches: Sequence[int],
    stages: Sequence[str],
    repeats: int,
    threads: int,
    split: bool,
    warmup: int = 1,
) -> dict[str, Any]:
    """Build the backbone, run the sweep, return ``bench grouping``'s JSON plus the preset."""
    torch.set_num_threads(threads)
    t0 = time.perf_counter()
    bb = build_backbone(preset, device, dtype)
    build_s = time.perf_counter() - t0
    if preset != "tiny" and bb.num_params < MIN_PARAMS:
        raise RuntimeError(f"preset {preset} has {bb.num_params:,} parameters < {MIN_PARAMS:,}")
    name = f"{preset} (config, random weights)"
    result = sweep(bb, name, tenants, local_batches, stages, repeats, warmup, split=split)
    result["preset"] = preset
    result["preset_config"] = asdict(PRESETS[preset])
    result["build_s"] = round(build_s, 2)
    return result


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m bench.gpu_grouping``: the grouping sweep on a GPU-sized backbone."""
    p = argparse.ArgumentParser(prog="python -m bench.gpu_grouping", description=__doc__)
    p.add_argument("--tiny", action="store_true", help="toy widths on the CPU (smoke run)")
    p.add_argument("--preset", choices=sorted(PRESETS), help="default 0.6b (tiny with --tiny)")
    p.add_argument("--device", help="default cuda (cpu with --tiny)")
    p.add_argument("--dtype", help="default bfloat16 on CUDA, float32 on the CPU")
    p.add_argument("--tenants", type=int_list, default=[1, 2, 4, 8], help="e.g. 1,2,4,8")
    p.add_argument("--local-batch", type=int_list, default=[1, 2, 4, 8], help="e.g. 1,2,4,8")
    p.add_argument("--stages", default=",".join(STAGES), help=f"comma-separated subset of {STAGES}")
    p.add_argument("--repeats", type=int, default=None, help="timed pairs per cell (default 9)")
    p.add_argument("--warmup", type=int, default=1, help="untimed pairs per cell")
    p.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    p.add_argument("--split", action=argparse.BooleanOptionalAction, default=True,
                   help="split grouped forwards by the measured cost table")  # fmt: skip
    p.add_argument("--json", metavar="FILE", help="also write the result as JSON")
    args = p.parse_args(argv)
    preset = args.preset or ("tiny" if args.tiny else "0.6b")
    device = args.device or ("cpu" if args.tiny else "cuda")
    dtype = args.dtype or ("float32" if device == "cpu" else "bfloat16")
    if device.startswith("cuda") and not torch.cuda.is_available():
        print(
            "gpu_grouping: no CUDA device here; run it where one is, or --tiny for the CPU "
            "smoke run",
            file=sys.stderr,
        )
        return 2
    if dtype not in ("float32", "bfloat16", "float16"):
        p.error(f"--dtype must be float32, bfloat16 or float16, got {dtype!r}")
    repeats = args.repeats or DEFAULT_REPEATS["tiny"]
    stages = [s.strip() for s in args.stages.split(",") if s.strip()]
    result = run(
        preset, device, dtype, args.tenants, args.local_batch, stages, repeats, args.threads,
        args.split, args.warmup,
    )  # fmt: skip
    print(f"{preset}: {result['num_params']:,} parameters, {dtype} on {result['device']}")
    print(format_table(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
