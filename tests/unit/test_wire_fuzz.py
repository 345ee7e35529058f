"""Property and fuzz tests: round trips of generated values; hostile bytes only ever raise DecodeError."""

from __future__ import annotations

import datetime as dt
import decimal
import pathlib
import random
import struct
import uuid
from typing import Any

import msgpack
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from PIL import Image

from dreamlake.lakeshore import wire
from dreamlake.lakeshore.errors import DecodeError

FAST = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])

native_leaf = (
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats(allow_nan=False)
    | st.text(max_size=20)
    | st.binary(max_size=20)
)
native = st.recursive(
    native_leaf,
    lambda kids: st.lists(kids, max_size=5) | st.dictionaries(st.text(max_size=8), kids, max_size=5),
    max_leaves=30,
)

hashable_leaf = st.integers() | st.text(max_size=8) | st.binary(max_size=8) | st.none()
offsets = st.timedeltas(min_value=dt.timedelta(hours=-23), max_value=dt.timedelta(hours=23)).map(dt.timezone)
builtin_leaf = (
    native_leaf
    | st.integers()
    | st.complex_numbers(allow_nan=False)
    | st.datetimes(timezones=st.none() | offsets)
    | st.dates()
    | st.times(timezones=st.none() | offsets)
    | st.timedeltas()
    | st.uuids()
    | st.decimals(allow_nan=False)
    | st.sets(hashable_leaf, max_size=4)
    | st.frozensets(hashable_leaf, max_size=4)
    | st.text(max_size=10).map(pathlib.PurePosixPath)
    | st.text(max_size=10).map(pathlib.PureWindowsPath)
)
builtin = st.recursive(
    builtin_leaf,
    lambda kids: (
        st.lists(kids, max_size=4)
        | st.lists(kids, max_size=4).map(tuple)
        | st.dictionaries(hashable_leaf | st.tuples(st.integers()), kids, max_size=4)
    ),
    max_leaves=20,
)


def same(a: Any, b: Any) -> bool:
    """Equality that also checks types all the way down."""
    if type(a) is not type(b):
        return False
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, dt.datetime):
        return a == b and a.utcoffset() == b.utcoffset()
    return bool(a == b)


@FAST
@given(native)
def test_native_values_round_trip_and_match_plain_msgpack(value: Any) -> None:
    blob = wire.pack(value)
    assert blob == msgpack.packb(value, use_bin_type=True)
    assert same(wire.unpack(blob), value)


@FAST
@given(builtin)
def test_builtin_values_round_trip(value: Any) -> None:
    assert same(wire.unpack(wire.pack(value)), value)


dtypes = hnp.scalar_dtypes() | hnp.byte_string_dtypes() | hnp.unicode_string_dtypes()


@FAST
@given(hnp.arrays(dtypes, hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=4)), st.booleans())
def test_numpy_arrays_round_trip(arr: np.ndarray, fortran: bool) -> None:
    if fortran:
        arr = np.asfortranarray(arr)
    out = wire.unpack(wire.pack(arr))
    assert out.dtype == arr.dtype and out.shape == arr.shape
    np.testing.assert_array_equal(out, arr)


def _check(data: bytes) -> None:
    try:
        wire.unpack(data)
    except DecodeError:
        pass


def _palette_image() -> Image.Image:
    img = Image.new("P", (3, 3))
    img.putpalette(bytes(range(48)), "RGBA")
    return img


SAMPLES: list[bytes] = [
    wire.pack(
        {
            "a": [1, 2.5, "x", b"y", None, True],
            "t": (1, (2, 3)),
            "s": {1, 2},
            "n": np.arange(6, dtype=np.int16).reshape(2, 3),
            "f": np.float32(2),
            "d": dt.datetime(2020, 1, 1, tzinfo=dt.UTC),
            "td": dt.timedelta(1),
            "u": uuid.UUID(int=5),
            "dec": decimal.Decimal("1.5"),
            "p": pathlib.PurePosixPath("/x"),
            "c": 1j,
            "big": 2**70,
        }
    ),
    wire.pack(np.zeros(3, dtype=[("a", "<i4"), ("b", "S2")])),
    wire.pack(np.zeros(2, dtype=np.dtype({"names": ["a"], "formats": ["<f8"], "offsets": [8]}))),
    wire.pack([_palette_image(), Image.new("I;16", (3, 2)), Image.new("1", (9, 2))]),
    wire.pack([torch.arange(6, dtype=torch.int16).reshape(2, 3), torch.ones(2, dtype=torch.bfloat16)]),
]


def test_fuzz_random_bytes_only_raise_decode_error() -> None:
    rng = random.Random(1234)
    for _ in range(3000):
        _check(rng.randbytes(rng.randrange(0, 64)))


@pytest.mark.parametrize("sample", range(len(SAMPLES)))
def test_fuzz_mutated_values_only_raise_decode_error(sample: int) -> None:
    rng = random.Random(sample)
    base = SAMPLES[sample]
    for _ in range(3000):
        data = bytearray(base)
        for _ in range(rng.randrange(1, 4)):
            op = rng.randrange(4)
            i = rng.randrange(len(data))
            if op == 0:
                data[i] ^= 1 << rng.randrange(8)
            elif op == 1:
                data[i] = rng.choice([0x00, 0x7F, 0x80, 0xC1, 0xDC, 0xDD, 0xDE, 0xDF, 0xFF])
            elif op == 2:
                del data[i:]
                data += b"\x00" if not data else b""
            else:
                data[i:i] = rng.randbytes(rng.randrange(1, 5))
        _check(bytes(data))


def test_truncation_and_trailing_bytes_are_decode_errors() -> None:
    blob = SAMPLES[0]
    for cut in range(len(blob)):
        with pytest.raises(DecodeError):
            wire.unpack(blob[:cut])
    with pytest.raises(DecodeError, match="ExtraData"):
        wire.unpack(blob + b"\x00")


@pytest.mark.parametrize(
    "header",
    [
        b"\xdd\xff\xff\xff\xff",
        b"\xdf\xff\xff\xff\xff",
        b"\xdb\xff\xff\xff\xff",
        b"\xc6\xff\xff\xff\xff",
        b"\xc9\x7f\xff\xff\xff\x05",
    ],
    ids=["array32", "map32", "str32", "bin32", "ext32"],
)
def test_huge_length_headers_fail_without_allocating(header: bytes) -> None:
    with pytest.raises(DecodeError):
        wire.unpack(header + b"\x00" * 16)


def test_limits_are_enforced() -> None:
    with pytest.raises(DecodeError, match="max_buffer_size"):
        wire.unpack(wire.pack(b"x" * 100), limits=wire.Limits(max_buffer_size=50))
    with pytest.raises(DecodeError):
        wire.unpack(wire.pack("x" * 100), limits=wire.Limits(max_str_len=50))
    with pytest.raises(DecodeError):
        wire.unpack(wire.pack(list(range(100))), limits=wire.Limits(max_array_len=50))
    with pytest.raises(DecodeError):
        wire.unpack(wire.pack(b"x" * 100), limits=wire.Limits(max_bin_len=50))
    big = wire.pack(np.zeros(100, dtype=np.uint8))
    with pytest.raises(DecodeError):
        wire.unpack(big, limits=wire.Limits(max_ext_len=50))
    assert wire.unpack(big).shape == (100,)


def test_nesting_is_bounded() -> None:
    value: Any = 1
    for _ in range(wire.DEFAULT_LIMITS.max_depth + 1):
        value = (value,)
    with pytest.raises(DecodeError, match="max_depth"):
        wire.unpack(wire.pack(value))
    assert wire.unpack(wire.pack(value[0])) == value[0]
    deep_lists = b"\x91" * 5000 + b"\xc0"
    with pytest.raises(DecodeError):
        wire.unpack(deep_lists)
    deep_ext = b"\xc0"
    for _ in range(500):
        deep_ext = msgpack.packb(msgpack.ExtType(5, msgpack.packb([msgpack.ExtType(5, deep_ext)])))
    with pytest.raises(DecodeError):
        wire.unpack(deep_ext)


@pytest.mark.parametrize(
    "code, data",
    [
        (1, b""),
        (1, struct.pack("<I", 3) + msgpack.packb(["|O", [1], False])[:3]),
        (1, struct.pack("<I", 12) + msgpack.packb(["|O", [1], False]) + b"\0" * 16),
        (1, struct.pack("<I", 14) + msgpack.packb(["<f8", [10**12], False]) + b"\0" * 14),
        (1, struct.pack("<I", 14) + msgpack.packb(["<f8", [-1], False]) + b"\0" * 14),
        (1, struct.pack("<I", 20) + msgpack.packb(["bogus-dtype", [1], False]) + b"\0" * 8),
        (2, struct.pack("<I", 13) + msgpack.packb(["<f8", [1, 1], False]) + b"\0" * 15),
        (4, struct.pack("<I", 15) + msgpack.packb(["RGB", [65535, 65535], None, None]) + b"\0" * 13),
        (4, struct.pack("<I", 13) + msgpack.packb(["XYZ", [1, 1], None, None]) + b"\0" * 14),
        (6, msgpack.packb([[1]])),
        (8, b"short"),
        (9, b"not a date"),
        (12, msgpack.packb(["a", 0, 0])),
        (13, b"\x00" * 15),
        (14, b"\xff"),
        (14, b"1.2.3"),
        (19, b""),
    ],
    ids=lambda x: x if isinstance(x, int) else "",
)
def test_corrupt_builtin_ext_data_is_decode_error(code: int, data: bytes) -> None:
    with pytest.raises(DecodeError, match=f"code {code}"):
        wire.unpack(msgpack.packb(msgpack.ExtType(code, data)))


def test_object_dtype_in_received_bytes_is_refused() -> None:
    header = msgpack.packb(["|O", [1], False])
    raw = struct.pack("<I", len(header)) + header
    raw += b"\0" * (-len(raw) % 16) + b"\0" * 8
    with pytest.raises(DecodeError, match="object"):
        wire.unpack(msgpack.packb(msgpack.ExtType(1, raw)))
