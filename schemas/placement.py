"""The ``placement`` KV record: which role instance serves which backbone, and what it is.

Key ``<role>.<backbone>.<instance>``; written by a trainer or inferencer once its backbone is
loaded, deleted when it stops (a killed instance leaves its key: read it together with the
instance's heartbeat, as :func:`bus.placement.live_placements` does).
"""

from __future__ import annotations

import msgspec


class PlacementRecord(msgspec.Struct, frozen=True):
    """One role instance serving one backbone."""

    #: Backbone id (the ``backbone:`` a spec names, a token of the TRAIN/INFER subjects).
    backbone: str
    #: ``trainer`` or ``inferencer``.
    role: str
    #: The instance's id (its heartbeat key is ``<role>.<instance>``).
    instance: str = ""
    #: Architecture: the checkpoint's ``config.model_type`` (``idefics3``, ``paligemma``...).
    model_type: str = ""
    #: Parameters kept resident (decoder layers above the feature layer are not).
    num_params: int = 0
    #: Side of the square images the vision tower takes.
    image_size: int = 0
    #: Prefix tokens one image view occupies.
    image_tokens: int = 0
    #: Token budget: the most positions (image + text tokens) the decoder takes; 0 = unknown.
    max_tokens: int = 0
    #: Feature width D that heads consume.
    hidden_size: int = 0
    dtype: str = ""
    device: str = ""
    #: When the instance started serving (unix seconds).
    at: float = 0.0


PLACEMENT_DECODER = msgspec.msgpack.Decoder(PlacementRecord)


def placement_key(record: PlacementRecord) -> str:
    return f"{record.role}.{record.backbone}.{record.instance}"
