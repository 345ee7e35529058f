"""The value codec: msgpack with integer ExtType codes, plus the frame format of result streams.

``pack(value) -> bytes`` and ``unpack(data) -> value`` carry every user value (args, kwargs, results,
generator frames). Containers are plain msgpack (``strict_types=True``); anything msgpack does not
know travels as ``ExtType(code, data)`` produced by a :class:`Codec`. ``import dreamlake.lakeshore.wire``
needs msgpack alone: numpy, torch and PIL are imported only when a value of theirs is packed or an
ext code of theirs is unpacked (a value is recognised by ``type(obj).__module__`` first).

Built-in ext codes (1..63; 20..63 are reserved for future built-ins). ``hdr`` below is
``u32 little-endian length + msgpack header``, zero padded so the raw bytes start 16-byte aligned.

====  ==========================  ===================================================================
code  type                        ext data
====  ==========================  ===================================================================
1     numpy.ndarray               hdr ``[dtype, shape, fortran]`` + raw bytes in memory order. dtype is
                                  ``dtype.str`` (``"<f8"``, ``"<M8[ns]"``) or, structured, ``dtype.descr``
2     numpy scalar (np.generic)   as code 1, of the 0-d array; unpacks to the numpy scalar
3     torch.Tensor                hdr ``[dtype name, shape]`` + raw bytes (C order); comes back on CPU
4     PIL.Image.Image             hdr ``[mode, [w, h], palette mode | None, palette | None]`` + raw pixels
5     tuple                       msgpack array of the items
6     set                         msgpack array of the items (sorted when the items sort)
7     frozenset                   as set
8     complex                     ``<dd`` (real, imag), 16 bytes
9     datetime.datetime           UTF-8 ``isoformat()``; an aware value keeps its UTC offset (a zone
                                  comes back as a fixed ``timezone``; ``fold`` is not kept)
10    datetime.date               UTF-8 ``isoformat()``
11    datetime.time               UTF-8 ``isoformat()`` (offset kept as for datetime)
12    datetime.timedelta          msgpack ``[days, seconds, microseconds]``
13    uuid.UUID                   the 16 bytes
14    decimal.Decimal             UTF-8 ``str()`` (NaN, Infinity and the sign of zero are kept)
15    pathlib.PurePosixPath       UTF-8 (surrogateescape) of ``str(path)``
16    pathlib.PureWindowsPath     as 15
17    pathlib.PosixPath           as 15; unpacks to ``Path`` (``PurePosixPath`` on Windows)
18    pathlib.WindowsPath         as 15; unpacks to ``WindowsPath`` on Windows, else ``PureWindowsPath``
19    int beyond 64 bits          signed big-endian two's complement
====  ==========================  ===================================================================

User codecs take codes 64..127: ``register(Codec(64, MyType, encode, decode, "my-type"))``.

Behaviour worth knowing:

* Numpy arrays of any dtype but ``object`` (refused with ``TypeError``): bool, complex, datetime64 /
  timedelta64 with their unit, strings, structured (padded and aligned layouts kept). C or Fortran
  order is kept; other views (slices, transposes, broadcasts) are packed as a C-order copy. Unpacked
  arrays are **read-only** views, never copied by the codec (``arr.copy()`` to mutate): of the ext
  data msgpack hands over, or for a big top-level array of the input ``bytes`` themselves when that
  view is aligned for the dtype. Byte order is kept. Subclasses
  (``np.memmap``, ``np.matrix``) pack as ``ndarray``; a masked array is refused (its mask would be
  lost). ``np.str_`` / ``np.bytes_`` subclass ``str`` / ``bytes`` and come back as those.
* Torch tensors: dense tensors of every non-quantized dtype. A CUDA (or any non-CPU) tensor is copied
  to the host and **comes back on CPU**: move it with ``.to(device)`` on the other side. The autograd
  graph and ``requires_grad`` are dropped (``detach()``); strides are not kept (a contiguous copy);
  unpacked tensors are writable copies. Sparse, nested, quantized and meta tensors raise
  ``TypeError`` with the conversion to use.
* PIL images: mode, size, pixel bytes and palette (with its mode) are kept exactly, for every mode
  (``1``, ``L``, ``P``, ``RGB``, ``RGBA``, ``I;16``, ``F``, ...). ``img.info`` (transparency key, EXIF,
  ICC profile) and the source file format are not carried.
* ``strict_types=True``: the exact type decides. A subclass with no codec of its own is packed as the
  first class of its MRO that has one or that msgpack knows: ``IntEnum`` -> ``int``, ``OrderedDict``
  -> ``dict``, a namedtuple -> ``tuple``, a pandas ``Timestamp`` -> ``datetime``. That is lossy
  by design (as ``json``); register a codec for the subclass to keep it. ``bytearray`` and
  ``memoryview`` come back as ``bytes``.
* An unknown type raises ``TypeError`` naming it and the fix. An unknown ext code unpacks to
  ``msgpack.ExtType(code, data)`` and re-packs byte-identically, as does a numpy/torch/PIL value
  read where that library is not installed.
* ``unpack`` is for untrusted bytes: the buffer, every str/bin/ext/array/map and the nesting of ext
  values are bounded by :class:`Limits` (array and map lengths also by the buffer length, so a short
  header cannot make a huge allocation); msgpack itself bounds array/map nesting at 1024 per level.
  Garbage, truncation, trailing bytes and corrupt ext data raise :class:`DecodeError`. Maps may have
  non-str keys (``{1: "a"}``, tuples); such keys hash deterministically, so a hostile peer can make a
  large map slow to build (``max_map_len`` bounds it).

Frames (``[kind, seq, body, meta]``, see docs/architecture.md) are plain msgpack: the control plane
reads them without this codec. :class:`FrameReader` reassembles frames split at any byte boundary.

The package: ``base`` (``Limits``, ``Codec``), ``codec`` (registry, ``pack`` / ``unpack``, the stdlib
codecs), ``arrays`` (numpy / torch / PIL, imported on first use) and ``frames``. Each imports only
``base`` of the package (``codec`` imports ``arrays`` when a codec of theirs is first needed), so any
of them loads first without a cycle. Import the names from here.
"""

from __future__ import annotations

from .base import DEFAULT_LIMITS, Codec, Limits, MiB, limits_for
from .codec import BUILTIN_CODES, USER_CODES, pack, register, unpack, unregister
from .frames import (
    DEFAULT_FRAME_LIMITS,
    FRAME_END,
    FRAME_ERROR,
    FRAME_KINDS,
    FRAME_LOG,
    FRAME_VALUE,
    Frame,
    FrameReader,
    decode_frame,
    encode_frame,
)

__all__ = [
    "BUILTIN_CODES",
    "DEFAULT_FRAME_LIMITS",
    "DEFAULT_LIMITS",
    "FRAME_END",
    "FRAME_ERROR",
    "FRAME_KINDS",
    "FRAME_LOG",
    "FRAME_VALUE",
    "USER_CODES",
    "Codec",
    "Frame",
    "FrameReader",
    "Limits",
    "MiB",
    "decode_frame",
    "encode_frame",
    "limits_for",
    "pack",
    "register",
    "unpack",
    "unregister",
]
