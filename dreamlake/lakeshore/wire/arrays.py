"""The optional numpy / torch / PIL codecs of :mod:`dreamlake.lakeshore.wire` (codes 1..4).

Imported by :mod:`.codec` on first use of one of these libraries (never at ``wire``'s import time);
each ``*_codec(s)`` function imports its library and returns its codecs for the codec to register,
or raises ``ImportError``. Use them through ``dreamlake.lakeshore.wire``, not from here. Runs on
Python >= 3.9 (the entry bundle).
"""

from __future__ import annotations

import math
import struct

import msgpack

from .base import Codec, MiB

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Any, Literal

_HDR = struct.Struct("<I")
_HEADER_LIMITS = {"max_str_len": 1 * MiB, "max_bin_len": 64 * MiB, "max_array_len": 4096, "max_map_len": 64}

# Headers hold no custom types, so packing one never calls back into Python: one shared packer is safe.
_HEADER_PACKER = msgpack.Packer(use_bin_type=True)


def _header(header: list[Any]) -> bytes:
    """``u32 length + msgpack header``, zero padded to a multiple of 16 bytes."""
    h: bytes = _HEADER_PACKER.pack(header)
    return b"".join((_HDR.pack(len(h)), h, b"\0" * (-(_HDR.size + len(h)) % 16)))


def _with_header(header: list[Any], raw: Any) -> bytes:
    return b"".join((_header(header), raw))


def _split_header(data: bytes) -> tuple[list[Any], memoryview]:
    mv = memoryview(data)
    if len(mv) < _HDR.size:
        raise ValueError("truncated header")
    (hlen,) = _HDR.unpack_from(mv)
    end = _HDR.size + hlen
    if end > len(mv):
        raise ValueError("header length past the end of the data")
    header = msgpack.unpackb(mv[_HDR.size : end], raw=False, **_HEADER_LIMITS)
    if type(header) is not list:
        raise ValueError("header is not an array")
    start = end + (-end % 16)
    if start > len(mv) or any(mv[end:start]):
        raise ValueError("bad header padding")
    return header, mv[start:]


def _shape(value: Any, ndim_max: int = 64) -> tuple[int, ...]:
    if type(value) is not list or len(value) > ndim_max:
        raise ValueError(f"shape must be a list of at most {ndim_max} ints")
    if not all(type(d) is int and d >= 0 for d in value):
        raise ValueError("shape dims must be non-negative ints")
    return tuple(value)


def numpy_codecs() -> tuple[list[Codec], Callable[[Any], tuple[bytes, Any]]]:
    """The ndarray (code 1) and numpy scalar (code 2) codecs, and the ``(header, raw bytes)`` split of
    an array the codec uses to frame a big top-level array in one copy."""
    import numpy as np

    def descr_out(dtype: Any) -> Any:
        return dtype.str if dtype.fields is None else dtype.descr

    def dtype_in(d: Any) -> Any:
        """The dtype of a ``dtype.str`` or ``dtype.descr``; a descr field named ``""`` is padding
        (as ``dtype.descr`` writes gaps and offsets), so padded and aligned structs keep their layout."""
        if type(d) is str:
            return np.dtype(d)
        if type(d) is not list:
            raise ValueError("dtype must be a str or a field list")
        names: list[str] = []
        formats: list[Any] = []
        offsets: list[int] = []
        titles: list[Any] = []
        offset = 0
        for f in d:
            if type(f) is not list or len(f) not in (2, 3):
                raise ValueError("bad structured dtype field")
            title, name = f[0] if type(f[0]) is list and len(f[0]) == 2 else (None, f[0])
            if type(name) is not str or (title is not None and type(title) is not str):
                raise ValueError("structured dtype field names must be str")
            sub = dtype_in(f[1])
            if len(f) == 3:
                sub = np.dtype((sub, _shape(f[2])))
            if name:
                names.append(name)
                formats.append(sub)
                offsets.append(offset)
                titles.append(title)
            offset += sub.itemsize
        spec = {"names": names, "formats": formats, "offsets": offsets, "itemsize": offset}
        if any(t is not None for t in titles):
            spec["titles"] = titles
        return np.dtype(spec)  # type: ignore[call-overload]

    def array_parts(arr: Any) -> tuple[bytes, Any]:
        if type(arr) is not np.ndarray:
            if isinstance(arr, np.ma.MaskedArray):
                raise TypeError(
                    "cannot pack a numpy masked array: the mask would be lost. Pack arr.filled(value), "
                    "or arr.data and arr.mask as two arrays"
                )
            arr = arr.view(np.ndarray)  # a subclass (np.memmap, np.matrix) travels as its ndarray
        if arr.dtype.hasobject:
            raise TypeError(
                f"cannot pack a numpy array of dtype {arr.dtype}: object arrays hold arbitrary Python "
                "objects. Convert it to a fixed dtype (arr.astype(str), arr.astype(float)) or to a list"
            )
        fortran = bool(arr.flags.f_contiguous and not arr.flags.c_contiguous)
        if not (arr.flags.c_contiguous or fortran):
            arr = np.ascontiguousarray(arr)
        raw: Any = b""
        if arr.nbytes:
            raw = memoryview(arr.ravel(order="K").view(np.uint8))
        return _header([descr_out(arr.dtype), list(arr.shape), fortran]), raw

    def encode_array(arr: Any) -> bytes:
        return b"".join(array_parts(arr))

    def decode_array(data: bytes) -> Any:
        header, raw = _split_header(data)
        if len(header) != 3 or type(header[2]) is not bool:
            raise ValueError("ndarray header must be [dtype, shape, fortran]")
        dtype = dtype_in(header[0])
        if dtype.hasobject:
            raise ValueError("object dtype refused")
        shape = _shape(header[1])
        order: Literal["C", "F"] = "F" if header[2] else "C"
        count = math.prod(shape)
        if count * dtype.itemsize != len(raw):
            raise ValueError(
                f"array data is {len(raw)} bytes; {dtype} x {shape} needs {count * dtype.itemsize}"
            )
        if len(raw) == 0:
            arr = np.empty(shape, dtype=dtype, order=order)
            arr.flags.writeable = False
            return arr
        return np.frombuffer(raw, dtype=dtype, count=count).reshape(shape, order=order)

    def encode_scalar(x: Any) -> bytes:
        return encode_array(np.asarray(x))

    def decode_scalar(data: bytes) -> Any:
        arr = decode_array(data)
        if arr.ndim != 0:
            raise ValueError("numpy scalar must be a 0-d array")
        return arr[()]

    codecs = [
        Codec(1, np.ndarray, encode_array, decode_array, "numpy.ndarray"),
        Codec(2, np.generic, encode_scalar, decode_scalar, "numpy.scalar"),
    ]
    return codecs, array_parts


def torch_codec() -> Codec:
    """The torch.Tensor codec (code 3)."""
    import torch

    def encode(t: Any) -> bytes:
        # Only dense tensors with plain element bytes travel; the rest would lose what they are.
        if t.is_nested or t.layout != torch.strided:
            raise TypeError(
                f"cannot pack a {t.layout} torch tensor: only dense (strided) tensors travel. "
                "Convert it with t.to_dense() (or pack its indices and values as separate tensors)"
            )
        if t.is_quantized:
            raise TypeError(
                f"cannot pack a quantized torch tensor ({t.dtype}): its scale and zero point would be "
                "lost. Convert it with t.dequantize() (or pack t.int_repr() with the quantization "
                "parameters)"
            )
        if t.is_meta:
            raise TypeError("cannot pack a torch tensor on the meta device: it has no data")
        t = t.detach().to("cpu").contiguous()  # a CUDA (or MPS, ...) tensor is copied to the host
        raw: Any = b""
        if t.numel():
            raw = memoryview(t.reshape(-1).view(torch.uint8).numpy())
        return _with_header([str(t.dtype).removeprefix("torch."), list(t.shape)], raw)

    def decode(data: bytes) -> Any:
        header, raw = _split_header(data)
        if len(header) != 2 or type(header[0]) is not str:
            raise ValueError("tensor header must be [dtype, shape]")
        dtype = getattr(torch, header[0], None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"unknown torch dtype {header[0]!r}")
        if header[0].startswith(("qint", "quint")):  # never packed: raw bytes without scale / zero point
            raise ValueError(f"quantized torch dtype {header[0]!r} refused")
        shape = _shape(header[1])
        # dtype.itemsize is torch >= 2.1; an older torch in a user's runtime measures an empty tensor
        itemsize = getattr(dtype, "itemsize", None) or torch.empty((), dtype=dtype).element_size()
        need = math.prod(shape) * itemsize
        if need != len(raw):
            raise ValueError(f"tensor data is {len(raw)} bytes; {dtype} x {shape} needs {need}")
        if len(raw) == 0:
            return torch.empty(shape, dtype=dtype)
        flat = torch.frombuffer(bytearray(raw), dtype=torch.uint8)  # a writable copy, as torch expects
        return flat.view(dtype).reshape(shape)

    return Codec(3, torch.Tensor, encode, decode, "torch.Tensor")


def pil_codec() -> Codec:
    """The PIL.Image.Image codec (code 4)."""
    from PIL import Image

    def encode(img: Any) -> bytes:
        palette = img.palette
        pmode, pdata = (palette.mode, bytes(img.getpalette(palette.mode) or b"")) if palette else (None, None)
        return _with_header([img.mode, list(img.size), pmode, pdata], img.tobytes())

    def decode(data: bytes) -> Any:
        header, raw = _split_header(data)
        if len(header) != 4 or type(header[0]) is not str:
            raise ValueError("image header must be [mode, size, palette mode, palette]")
        mode, (w, h) = header[0], _shape(header[1], 2) if len(header[1]) == 2 else (-1, -1)
        if w < 0:
            raise ValueError("image size must be [width, height]")
        if w * h > 8 * len(raw):  # no mode packs more than 8 pixels a byte: bound the allocation
            raise ValueError(f"{len(raw)} bytes cannot hold a {w}x{h} image")
        if w * h == 0:
            img = Image.new(mode, (w, h))
        else:
            row = len(Image.new(mode, (w, 1)).tobytes())
            if row * h != len(raw):
                raise ValueError(f"image data is {len(raw)} bytes; {mode} {w}x{h} needs {row * h}")
            img = Image.frombytes(mode, (w, h), bytes(raw))
        if header[2] is not None:
            img.putpalette(bytes(header[3]), header[2])
        return img

    return Codec(4, Image.Image, encode, decode, "PIL.Image")
