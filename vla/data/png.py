"""The dataset's image codec: PNG, written without row filters, decoded with a size cap.

Images are PNG bytes where LeRobot v3 uses MP4 videos. Our frames are small synthetic images:
PNG is lossless (the policy trains on exactly what the simulator rendered), gives random
access by row without seeking a video decoder, and costs a few hundred bytes per 64x64 frame.
We write PNGs without row filters, which decode with one ``zlib`` call; PNGs written by other
tools are decoded by Pillow.
"""

from __future__ import annotations

import io
import struct
import zlib

import numpy as np
from PIL import Image

from vla.data.layout import INFO_PATH, DatasetError

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
# What Pillow raises for a corrupt PNG (UnidentifiedImageError is an OSError).
_DECODE_ERRORS = (OSError, ValueError, SyntaxError, zlib.error, struct.error)


def _png_chunk(tag: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + tag + data + struct.pack(">I", zlib.crc32(tag + data))


def encode_png(image_H_W_3: np.ndarray) -> bytes:
    """A standard 8-bit RGB PNG whose rows all use filter 0 (None).

    Written by hand rather than with Pillow: filter 0 lets :func:`decode_png` decode with a
    single ``zlib.decompress`` and a reshape (~4x faster than Pillow), and flat synthetic
    frames compress just as well without PNG's row filters. Any PNG reader can open it.
    """
    height, width, _ = image_H_W_3.shape
    rows_H_R = np.zeros((height, 1 + 3 * width), np.uint8)  # column 0: the filter byte
    rows_H_R[:, 1:] = image_H_W_3.reshape(height, 3 * width)
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)  # 8-bit RGB, no interlace
    return (
        PNG_SIGNATURE
        + _png_chunk(b"IHDR", header)
        + _png_chunk(b"IDAT", zlib.compress(rows_H_R.tobytes(), 6))
        + _png_chunk(b"IEND", b"")
    )


def _decode_fast(data: bytes, shape: tuple[int, ...]) -> np.ndarray | None:
    """Decode a PNG as :func:`encode_png` writes it; ``None`` for any other kind of PNG.

    The size is checked against ``shape`` before inflating, and inflating is capped, so a
    tenant's malformed or hostile file cannot make us allocate more than one frame.
    """
    if not data.startswith(PNG_SIGNATURE):
        raise ValueError("not a PNG (bad signature)")
    pos, header, idat = len(PNG_SIGNATURE), None, []
    while pos + 8 <= len(data):
        (size,) = struct.unpack_from(">I", data, pos)
        tag = data[pos + 4 : pos + 8]
        if tag == b"IHDR":
            header = struct.unpack_from(">IIBBBBB", data, pos + 8)
        elif tag == b"IDAT":
            idat.append(data[pos + 8 : pos + 8 + size])
        elif tag == b"IEND":
            break
        pos += size + 12
    if header is None or header[2:] != (8, 2, 0, 0, 0):
        return None
    width, height = header[0], header[1]
    _check_size(height, width, shape)
    expected = height * (1 + 3 * width)
    inflater = zlib.decompressobj()
    raw = inflater.decompress(b"".join(idat), expected + 1)
    if len(raw) != expected or not inflater.eof:
        raise ValueError(f"truncated or oversized pixel data ({len(raw)} of {expected} bytes)")
    rows_H_R = np.frombuffer(raw, np.uint8).reshape(height, 1 + 3 * width)
    if rows_H_R[:, 0].any():  # row filters in use: leave the unfiltering to Pillow
        return None
    return rows_H_R[:, 1:].reshape(height, width, 3)


def _check_size(height: int, width: int, shape: tuple[int, ...]) -> None:
    if (height, width, 3) != shape:
        raise ValueError(f"image has shape {(height, width, 3)}, {INFO_PATH} declares {shape}")


def decode_png(data: bytes, shape: tuple[int, ...], key: str, where: str) -> np.ndarray:
    """One frame as uint8 ``shape``; :class:`DatasetError` naming ``key`` and ``where`` if not."""
    try:
        image_H_W_3 = _decode_fast(data, shape)
        if image_H_W_3 is None:
            with Image.open(io.BytesIO(data)) as image:
                _check_size(image.height, image.width, shape)  # before decoding any pixels
                image_H_W_3 = np.asarray(image.convert("RGB"))
    except _DECODE_ERRORS as exc:
        raise DatasetError(f"column {key!r}: unreadable image at {where}: {exc}") from exc
    return image_H_W_3
