"""Tensors on the wire: ``(dtype, shape, data)`` with zero-copy numpy/torch views.

A :class:`Tensor` is a msgspec Struct, so it nests in any message and is encoded by msgpack
as a small array plus one binary blob. Nothing is pickled. Sizes are checked on every
conversion: a payload whose byte count does not match ``dtype`` x ``shape`` is rejected.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import msgspec
import numpy as np

if TYPE_CHECKING:
    import torch

#: dtypes allowed on the wire (numpy names). bfloat16 travels as its raw 2-byte words.
SUPPORTED_DTYPES: dict[str, int] = {
    "float32": 4,
    "float64": 8,
    "float16": 2,
    "bfloat16": 2,
    "int64": 8,
    "int32": 4,
    "int16": 2,
    "int8": 1,
    "uint8": 1,
    "bool": 1,
}


#: Most dims a wire tensor may have (numpy's own limit is 64; no input here has more than 6).
MAX_NDIM = 32
#: numpy cannot describe an array whose non-zero dims times its item size pass this, even
#: when another dim is zero and it holds no data (``reshape`` raises "array is too big").
_MAX_EXTENT_BYTES = int(np.iinfo(np.intp).max)


class TensorError(ValueError):
    """A tensor payload that cannot be decoded: wrong size, bad shape or unsupported dtype."""


class Tensor(msgspec.Struct, frozen=True, array_like=True):
    """A dense array: numpy dtype name, shape, and the C-order bytes."""

    dtype: str
    shape: tuple[int, ...]
    data: bytes

    def validate(self) -> Tensor:
        """Raise :class:`TensorError` unless dtype is supported and ``data`` has the right size."""
        itemsize = SUPPORTED_DTYPES.get(self.dtype)
        if itemsize is None:
            raise TensorError(
                f"unsupported dtype {self.dtype!r}; expected one of {sorted(SUPPORTED_DTYPES)}"
            )
        if any((not isinstance(d, int)) or d < 0 for d in self.shape):
            raise TensorError(f"invalid shape {self.shape!r}: dims must be non-negative ints")
        if len(self.shape) > MAX_NDIM:
            raise TensorError(
                f"invalid shape {self.shape!r}: {len(self.shape)} dims, at most {MAX_NDIM}"
            )
        if math.prod(d for d in self.shape if d) * itemsize > _MAX_EXTENT_BYTES:
            raise TensorError(
                f"invalid shape {self.shape!r}: its non-zero dims span more bytes than an "
                "array can address"
            )
        expected = math.prod(self.shape) * itemsize
        if len(self.data) != expected:
            raise TensorError(
                f"tensor of dtype {self.dtype} and shape {self.shape} needs {expected} bytes, "
                f"got {len(self.data)}"
            )
        return self

    @property
    def nbytes(self) -> int:
        return len(self.data)

    @classmethod
    def from_numpy(cls, array: np.ndarray) -> Tensor:
        """Wrap a numpy array (copied only if it is not C-contiguous)."""
        name = array.dtype.name
        if name not in SUPPORTED_DTYPES:
            raise TensorError(f"unsupported dtype {name!r}")
        contiguous = np.ascontiguousarray(array)
        return cls(name, tuple(int(d) for d in contiguous.shape), contiguous.tobytes())

    def to_numpy(self) -> np.ndarray:
        """A read-only numpy view over ``data`` (no copy). bfloat16 comes back as uint16 words."""
        self.validate()
        np_dtype = np.uint16 if self.dtype == "bfloat16" else np.dtype(self.dtype)
        return np.frombuffer(self.data, dtype=np_dtype).reshape(self.shape)

    @classmethod
    def from_torch(cls, tensor: torch.Tensor) -> Tensor:
        """Wrap a CPU/GPU torch tensor (moved to CPU; bfloat16 kept bit-exact)."""
        import torch

        t = tensor.detach().to("cpu").contiguous()
        if t.dtype == torch.bfloat16:
            raw = t.view(torch.int16).numpy().tobytes()
            return cls("bfloat16", tuple(t.shape), raw)
        return cls.from_numpy(t.numpy())

    def to_torch(self) -> torch.Tensor:
        """A torch tensor with the payload's values.

        numpy views are zero-copy; torch needs writable memory and ``bytes`` is immutable, so
        this makes exactly one copy (sharing would let a write corrupt the message)."""
        import torch

        array = self.to_numpy()
        if self.dtype == "bfloat16":
            return torch.from_numpy(array.view(np.int16).copy()).view(torch.bfloat16)
        return torch.from_numpy(array.copy())


def tensor_from(value: Any) -> Tensor:
    """Convert a numpy array or torch tensor to :class:`Tensor`."""
    if isinstance(value, Tensor):
        return value
    if isinstance(value, np.ndarray):
        return Tensor.from_numpy(value)
    return Tensor.from_torch(value)


#: Floating dtypes (the ones that can hold NaN or infinity).
FLOAT_DTYPES = frozenset({"float32", "float64", "float16", "bfloat16"})


def check_finite(tensor: Tensor, field: str) -> None:
    """Raise :class:`TensorError` naming ``field`` if a float tensor holds NaN or infinity
    (integer and bool tensors always pass). ``tensor`` must already be valid."""
    if tensor.dtype not in FLOAT_DTYPES:
        return
    array = tensor.to_numpy()
    if tensor.dtype == "bfloat16":  # raw words: exponent all ones is inf/NaN
        bad = int(np.count_nonzero((array & 0x7F80) == 0x7F80))
    else:
        bad = int(array.size - np.count_nonzero(np.isfinite(array)))
    if bad:
        raise TensorError(f"{field}: {bad} of {array.size} values are NaN or infinite")


def check_tensor(
    tensor: Tensor, field: str, dtype: str, ndim: int, *, finite: bool = True
) -> tuple[int, ...]:
    """Raise :class:`TensorError` naming ``field`` unless ``tensor`` is valid, of ``dtype``
    and ``ndim`` dims (and finite, for floats); returns its shape."""
    try:
        tensor.validate()
    except TensorError as exc:
        raise TensorError(f"{field}: {exc}") from exc
    shape = tuple(tensor.shape)
    if tensor.dtype != dtype or len(shape) != ndim:
        raise TensorError(f"{field}: expected {dtype} of {ndim} dims, got {tensor.dtype} {shape}")
    if finite:
        check_finite(tensor, field)
    return shape
