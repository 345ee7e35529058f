"""The value codec: round trips of every built-in type, strict types, errors, the codec registry."""

from __future__ import annotations

import collections
import datetime as dt
import decimal
import enum
import json
import pathlib
import struct
import subprocess
import sys
import uuid
import warnings
from typing import Any, NamedTuple

import msgpack
import numpy as np
import pytest
from PIL import Image

from dreamlake.lakeshore import wire
from dreamlake.lakeshore.errors import DecodeError


def rt(value: Any) -> Any:
    return wire.unpack(wire.pack(value))


def test_seed_example() -> None:
    out = rt({"x": np.zeros(4), "pair": (1, 2)})
    assert out["pair"] == (1, 2) and type(out["pair"]) is tuple
    np.testing.assert_array_equal(out["x"], np.zeros(4))


def _stable_id(value: Any) -> str:
    """``repr``, with a set's members sorted: a set of strings prints in hash order, which differs
    between interpreters (``PYTHONHASHSEED``), and pytest-xdist needs every worker to collect the
    same test ids."""
    if isinstance(value, (set, frozenset)) and value:
        inner = "{" + ", ".join(sorted(map(repr, value))) + "}"
        return inner if type(value) is set else f"{type(value).__name__}({inner})"
    return repr(value)


@pytest.mark.parametrize(
    "value",
    [
        None,
        True,
        0,
        -1,
        2**64 - 1,
        -(2**63),
        2**64,
        -(2**63) - 1,
        10**40,
        -(10**40),
        1.5,
        "héllo",
        b"\x00\xff",
        [1, [2, (3, 4)]],
        {"a": 1, 2: "b", (1, 2): [3]},
        (),
        ((1,), ((2,),)),
        {1, 2, 3},
        {"b", "a"},
        frozenset({(1, 2), 3}),
        set(),
        complex(1.5, -2),
        dt.datetime(2024, 5, 6, 7, 8, 9, 123456),
        dt.datetime(2024, 5, 6, 7, 8, 9, tzinfo=dt.timezone(dt.timedelta(hours=5, minutes=30))),
        dt.datetime(2024, 5, 6, tzinfo=dt.timezone(-dt.timedelta(hours=3, seconds=7, microseconds=1))),
        dt.date(1, 1, 1),
        dt.time(23, 59, 59, 999999),
        dt.time(1, 2, tzinfo=dt.UTC),
        dt.timedelta(days=-3, seconds=5, microseconds=7),
        uuid.UUID("12345678-1234-5678-1234-567812345678"),
        decimal.Decimal("3.14159265358979323846264338327950288"),
        decimal.Decimal("-0"),
        decimal.Decimal("Infinity"),
        pathlib.PurePosixPath("/a/b c"),
        pathlib.PureWindowsPath(r"C:\Users\x"),
        pathlib.Path("rel/path"),
    ],
    ids=lambda value: _stable_id(value),
)
def test_round_trip_keeps_value_and_type(value: Any) -> None:
    out = rt(value)
    assert out == value
    assert type(out) is type(value)


def test_aware_datetime_keeps_offset() -> None:
    tz = dt.timezone(dt.timedelta(hours=-7))
    out = rt(dt.datetime(2020, 1, 1, 12, tzinfo=tz))
    assert out.utcoffset() == dt.timedelta(hours=-7)
    assert out.hour == 12


def test_nan_decimal_and_surrogate_path() -> None:
    assert rt(decimal.Decimal("NaN")).is_nan()
    weird = pathlib.PurePosixPath("caf\udce9")  # a non-UTF-8 file name, as os.fsdecode gives it
    assert rt(weird) == weird


def test_unknown_ext_passes_through_byte_identical() -> None:
    blob = msgpack.packb({"v": msgpack.ExtType(99, b"future")}, use_bin_type=True)
    value = wire.unpack(blob)
    assert value == {"v": msgpack.ExtType(99, b"future")}
    assert wire.pack(value) == blob


@pytest.mark.parametrize("code", [0, 20, 63, 99, 127], ids=lambda c: f"code{c}")
@pytest.mark.parametrize("size", [0, 1, 4, 16, 17, 255, 256, 70_000], ids=lambda n: f"{n}B")
def test_unknown_ext_of_any_size_and_nesting_repacks_byte_identical(code: int, size: int) -> None:
    # A newer peer's value (a reserved built-in code, a user code not registered here) passes through.
    ext = msgpack.ExtType(code, (bytes(range(256)) * (size // 256 + 1))[:size])
    for value in (ext, [ext, 1], {"k": ext}):
        blob = msgpack.packb(value, use_bin_type=True)
        assert wire.unpack(blob) == value
        assert wire.pack(wire.unpack(blob)) == blob
    in_tuple = wire.pack((ext,))
    assert wire.unpack(in_tuple) == (ext,) and wire.pack(wire.unpack(in_tuple)) == in_tuple


def test_subclasses_pack_as_their_base() -> None:
    class Color(enum.IntEnum):
        RED = 3

    class Name(str, enum.Enum):  # noqa: UP042 - the (str, Enum) idiom users write is what is tested
        A = "alpha"

    class Pair(NamedTuple):
        a: int
        b: int

    out = rt([Color.RED, Name.A, Pair(1, 2), collections.OrderedDict(a=1), collections.Counter("aa")])
    assert out == [3, "alpha", (1, 2), {"a": 1}, {"a": 2}]
    assert [type(x) for x in out] == [int, str, tuple, dict, dict]


def test_unknown_type_names_type_and_fix() -> None:
    class Widget:
        pass

    with pytest.raises(TypeError) as e:
        wire.pack({"w": [Widget()]})
    msg = str(e.value)
    assert "Widget" in msg and "wire.register" in msg and "64..127" in msg


def test_plain_enum_is_refused() -> None:
    class Mode(enum.Enum):
        A = 1

    with pytest.raises(TypeError, match="Mode"):
        wire.pack(Mode.A)


# ---------------------------------------------------------------- numpy


@pytest.mark.parametrize(
    "arr",
    [
        np.arange(12, dtype=np.float64).reshape(3, 4),
        np.arange(12, dtype=">i4").reshape(3, 4),
        np.array([True, False, True]),
        np.array([1 + 2j, 3 - 4j], dtype=np.complex64),
        np.array(["2020-01-01", "NaT"], dtype="datetime64[ns]"),
        np.array([1, -2], dtype="timedelta64[s]"),
        np.array(["ab", "c"], dtype="U3"),
        np.array([b"ab", b"c"], dtype="S2"),
        np.zeros((2, 0, 3), dtype=np.int16),
        np.array(7.5, dtype=np.float16),
        np.array([(1, 2.0), (3, 4.0)], dtype=[("a", "<i4"), ("b", "<f8")]),
        np.zeros(2, dtype=[("xy", "<f4", (2,)), ("n", [("k", "u1"), ("t", "S3")])]),
        np.zeros(3, dtype=np.dtype({"names": ["a", "b"], "formats": ["u1", "<f8"], "offsets": [0, 8]})),
        np.ones(2, dtype=np.dtype([("a", "u1"), ("b", "<f8")], align=True)),
        np.zeros(2, dtype=np.dtype({"names": ["a"], "formats": ["<i4"], "offsets": [4], "itemsize": 12})),
        np.zeros(2, dtype=[(("Title", "t"), "<i4")]),
        np.array([1 + 2j], dtype=np.clongdouble),
        np.array(["2020-01-01T00:00:00.123456789"], dtype="M8[ns]").reshape(1, 1),
        np.broadcast_to(np.arange(3, dtype=np.int16), (4, 3)),
        np.asfortranarray(np.arange(24, dtype=np.int32).reshape(2, 3, 4)),
        np.asfortranarray(np.eye(3, dtype=bool)),
        np.arange(60).reshape(3, 4, 5)[:, ::2, ::-1],
        np.arange(6).reshape(2, 3).T,
        np.arange(40, dtype=np.uint8).reshape(5, 8)[::2, 1::3],
        np.arange(10, dtype=np.float64)[::-1],
    ],
    ids=lambda a: f"{a.dtype}{a.shape}",
)
def test_numpy_array_round_trip(arr: np.ndarray) -> None:
    out = rt(arr)
    assert type(out) is np.ndarray
    assert out.dtype == arr.dtype and out.shape == arr.shape
    np.testing.assert_array_equal(out, arr)
    assert out.flags.aligned


def test_fortran_order_is_kept_and_unpack_is_zero_copy_readonly() -> None:
    arr = np.asfortranarray(np.arange(6, dtype=np.float64).reshape(2, 3))
    out = rt(arr)
    assert out.flags.f_contiguous and not out.flags.c_contiguous
    assert not out.flags.writeable and not out.flags.owndata  # a view of the received bytes
    out.copy()[0, 0] = 1.0


def test_numpy_scalars_keep_their_type() -> None:
    values = [
        np.float32(1.5),
        np.int64(-3),
        np.bool_(True),
        np.datetime64("2020-01-01"),
        np.datetime64("2020-01-01T12:00:00.123456789"),
        np.timedelta64(5, "ms"),
        np.complex128(1j),
        np.float16(-0.0),
    ]
    out = rt(values)
    for a, b in zip(values, out, strict=True):
        assert type(a) is type(b) and a == b


def test_object_arrays_are_refused_with_the_fix() -> None:
    with pytest.raises(TypeError, match=r"object.*astype"):
        wire.pack(np.array([{}, 1], dtype=object))


def test_ndarray_subclass_packs_as_ndarray() -> None:
    class Tagged(np.ndarray):
        pass

    out = rt(np.arange(3).view(Tagged))
    assert type(out) is np.ndarray and out.tolist() == [0, 1, 2]


def test_masked_array_is_refused_rather_than_losing_its_mask() -> None:
    with pytest.raises(TypeError, match=r"mask.*filled"):
        wire.pack(np.ma.masked_array([1, 2], mask=[0, 1]))


# ---------------------------------------------------------------- PIL, torch


@pytest.mark.parametrize(
    "mode", ["1", "L", "LA", "P", "PA", "RGB", "RGBA", "CMYK", "YCbCr", "I", "F", "I;16", "I;16B"]
)
def test_pil_image_is_lossless(mode: str) -> None:
    rng = np.random.default_rng(0)
    img = Image.frombytes(mode, (7, 5), rng.bytes(len(Image.new(mode, (7, 5)).tobytes())))
    if mode in ("P", "PA"):
        img.putpalette(list(range(256)) * 3)
    out = rt(img)
    assert isinstance(out, Image.Image)
    assert (out.mode, out.size) == (img.mode, img.size)
    assert out.tobytes() == img.tobytes()
    assert out.getpalette() == img.getpalette()


def test_pil_palette_keeps_its_mode_and_length() -> None:
    rgba = Image.frombytes("P", (4, 4), bytes(range(16)))
    rgba.putpalette(bytes(range(64)), "RGBA")
    out = rt(rgba)
    assert out.palette.mode == "RGBA" and out.getpalette("RGBA") == rgba.getpalette("RGBA")
    short = Image.frombytes("P", (2, 2), bytes([0, 1, 2, 3]))
    short.putpalette([255, 0, 0, 0, 255, 0, 0, 0, 255, 9, 9, 9])
    assert rt(short).getpalette() == short.getpalette() == [255, 0, 0, 0, 255, 0, 0, 0, 255, 9, 9, 9]
    quantized = Image.fromarray(np.random.default_rng(1).integers(0, 255, (8, 8, 3), dtype=np.uint8))
    quantized = quantized.convert("P")
    back = rt(quantized)
    assert back.convert("RGB").tobytes() == quantized.convert("RGB").tobytes()


def test_empty_pil_image() -> None:
    out = rt(Image.new("RGB", (0, 3)))
    assert out.size == (0, 3)


def _torch() -> Any:
    import torch  # in the test extra: the torch codec is tested, never skipped

    return torch


def _torch_cases() -> list[Any]:
    torch = _torch()
    return [
        torch.arange(6, dtype=torch.float32).reshape(2, 3),
        torch.tensor([True, False]),
        torch.ones(3, dtype=torch.bfloat16),
        torch.tensor([1 + 2j, -3j], dtype=torch.complex64),
        torch.tensor([-1, 2], dtype=torch.int8),
        torch.tensor([0, 65535], dtype=torch.int32).to(torch.uint16),
        torch.tensor(3.5, dtype=torch.float64),  # 0-d
        torch.zeros(2, 0),
        torch.zeros(3, dtype=torch.float8_e4m3fn),
    ]


@pytest.mark.parametrize("index", range(9))
def test_torch_tensor_round_trip(index: int) -> None:
    torch = _torch()
    t = _torch_cases()[index]
    out = rt(t)
    assert type(out) is torch.Tensor
    assert (out.dtype, out.shape, out.device.type) == (t.dtype, t.shape, "cpu")
    assert _tensor_bytes(out) == _tensor_bytes(t)  # bit for bit, NaN payloads and -0.0 included
    _tensor_bytes(out, zero=True)  # unpacked tensors are writable (torch warns on read-only memory)
    assert not out.any()


def _tensor_bytes(t: Any, *, zero: bool = False) -> list[int]:
    flat = t.reshape(-1).view(_torch().uint8)
    if zero:
        flat.zero_()
    return list(flat.tolist())


def test_torch_views_and_autograd() -> None:
    torch = _torch()
    strided = torch.arange(24).reshape(4, 6)[::2, 1::2]
    assert rt(strided).tolist() == strided.tolist()
    assert rt(torch.arange(6).reshape(2, 3).t()).tolist() == [[0, 3], [1, 4], [2, 5]]
    channels_last = torch.randn(1, 3, 4, 4).to(memory_format=torch.channels_last)
    assert torch.equal(rt(channels_last), channels_last)
    grad = torch.ones(2, requires_grad=True) * 2
    out = rt(grad)
    assert not out.requires_grad and out.grad_fn is None and out.tolist() == [2.0, 2.0]
    assert type(rt(torch.nn.Parameter(torch.ones(2)))) is torch.Tensor


def test_torch_tensors_that_would_lose_meaning_are_refused_with_the_fix() -> None:
    torch = _torch()
    with pytest.raises(TypeError, match="to_dense"):
        wire.pack(torch.eye(3).to_sparse())
    with pytest.raises(TypeError, match="meta"):
        wire.pack(torch.empty(2, device="meta"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # quantized tensors are deprecated in torch itself
        quantized = torch.quantize_per_tensor(torch.ones(2), 0.1, 0, torch.quint8)
    with pytest.raises(TypeError, match="dequantize"):
        wire.pack(quantized)


def test_torch_quantized_dtype_from_a_peer_is_a_decode_error() -> None:
    header = msgpack.packb(["qint32", [2]])
    raw = struct.pack("<I", len(header)) + header
    raw += b"\0" * (-len(raw) % 16) + b"\1" * 8
    with pytest.raises(DecodeError, match="quantized"):
        wire.unpack(msgpack.packb(msgpack.ExtType(3, raw)))


def test_cuda_tensor_comes_back_on_cpu() -> None:
    torch = _torch()
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device here (the CPU build of torch); the codec moves tensors to the host")
    t = torch.arange(6, dtype=torch.float16, device="cuda").reshape(2, 3)
    out = rt({"t": t})["t"]
    assert out.device.type == "cpu" and out.dtype == t.dtype
    assert torch.equal(out, t.cpu())
    assert wire.pack(t) == wire.pack(t.cpu())  # the same bytes as the host copy


# ---------------------------------------------------------------- registry


class Point:
    def __init__(self, x: int, y: int) -> None:
        self.x, self.y = x, y

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Point) and (self.x, self.y) == (other.x, other.y)


POINT = wire.Codec(64, Point, lambda p: wire.pack([p.x, p.y]), lambda b: Point(*wire.unpack(b)), "point")


@pytest.fixture
def point_codec() -> Any:
    wire.register(POINT)
    yield POINT
    wire.unregister(64)


def test_user_codec_round_trips_nested(point_codec: wire.Codec) -> None:
    value = {"p": Point(1, 2), "t": (Point(3, 4),)}
    assert rt(value) == value


def test_user_codec_bytes_start_with_its_code(point_codec: wire.Codec) -> None:
    blob = wire.pack(Point(1, 2))
    assert msgpack.unpackb(blob) == msgpack.ExtType(64, wire.pack([1, 2]))


def test_register_refuses_collisions_and_bad_codes(point_codec: wire.Codec) -> None:
    wire.register(POINT)  # the same codec again is a no-op
    with pytest.raises(ValueError, match="already taken by 'point'"):
        wire.register(wire.Codec(64, Widget, bytes, bytes, "widget"))
    with pytest.raises(ValueError, match="already packed by 'point'"):
        wire.register(wire.Codec(65, Point, bytes, bytes, "point2"))
    with pytest.raises(ValueError, match=r"64\.\.127"):
        wire.register(wire.Codec(5, Widget, bytes, bytes, "widget"))
    with pytest.raises(ValueError, match=r"64\.\.127"):
        wire.register(wire.Codec(128, Widget, bytes, bytes, "widget"))
    with pytest.raises(ValueError, match="already packed"):
        wire.register(wire.Codec(66, dt.datetime, bytes, bytes, "my-datetime"))
    with pytest.raises(ValueError, match="already packed"):
        wire.register(wire.Codec(66, np.ndarray, bytes, bytes, "my-array"))
    with pytest.raises(ValueError, match="msgpack-native"):
        wire.register(wire.Codec(66, dict, bytes, bytes, "my-dict"))


class Widget:
    pass


def test_unregistered_code_unpacks_as_ext_then_decodes_once_registered() -> None:
    wire.register(POINT)
    blob = wire.pack(Point(5, 6))
    wire.unregister(64)
    assert isinstance(wire.unpack(blob), msgpack.ExtType)
    with pytest.raises(TypeError, match="Point"):
        wire.pack(Point(5, 6))


def test_user_codec_decode_failure_is_decode_error(point_codec: wire.Codec) -> None:
    blob = msgpack.packb(msgpack.ExtType(64, b"\xc1"))
    with pytest.raises(DecodeError, match="point"):
        wire.unpack(blob)


def test_codec_returning_non_bytes_is_named() -> None:
    wire.register(wire.Codec(70, Widget, lambda w: 42, bytes, "bad-widget"))
    try:
        with pytest.raises(TypeError, match="bad-widget"):
            wire.pack(Widget())
    finally:
        wire.unregister(70)


def test_import_does_not_pull_numpy_torch_pil() -> None:
    code = (
        "import sys, json; import dreamlake.lakeshore.wire as w; w.unpack(w.pack({'a': (1, 2)}));"
        "print(json.dumps([m for m in ('numpy', 'torch', 'PIL') if m in sys.modules]))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout) == []


@pytest.mark.parametrize("module", ["base", "codec", "arrays", "frames"])
def test_each_wire_module_imports_first_in_a_fresh_interpreter(module: str) -> None:
    # No import cycle: whichever module of the package is imported first, it loads and the codec works.
    code = (
        f"import dreamlake.lakeshore.wire.{module}; from dreamlake.lakeshore import wire as w; "
        "assert w.unpack(w.pack((1, 'a'))) == (1, 'a'); "
        "assert w.decode_frame(w.encode_frame(w.FRAME_END, 0, b'')).final"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_numpy_ext_passes_through_where_numpy_is_absent() -> None:
    blob = wire.pack([np.arange(3)])
    code = (
        "import sys; sys.modules['numpy'] = None; import dreamlake.lakeshore.wire as w;"
        f"v = w.unpack({blob!r}); import msgpack; assert isinstance(v[0], msgpack.ExtType), v;"
        f"assert w.pack(v) == {blob!r}"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_user_ndarray_subclass_loads_numpy_codec_first() -> None:
    code = (
        "import numpy as np; import dreamlake.lakeshore.wire as w\n"
        "class Sub(np.ndarray): pass\n"
        "assert w.unpack(w.pack(np.arange(2).view(Sub))).tolist() == [0, 1]"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize(
    "arr",
    [
        np.arange(1 << 19, dtype=np.float32),
        np.zeros((1024, 1024, 3), dtype=np.uint8),
        np.asfortranarray(np.ones((512, 512), dtype=np.float64)),
        np.arange(1 << 20, dtype=np.int64)[::2],
    ],
    ids=["f4", "u1-image", "fortran-f8", "strided"],
)
def test_big_top_level_arrays_take_the_same_bytes_both_ways(arr: np.ndarray) -> None:
    blob = wire.pack(arr)
    assert blob == msgpack.packb(msgpack.ExtType(1, wire.pack([arr])[7:]))  # as the general path packs
    out = wire.unpack(blob)
    np.testing.assert_array_equal(out, arr)
    assert out.flags.aligned and not out.flags.writeable
    with pytest.raises(DecodeError):
        wire.unpack(blob[:-1])
    with pytest.raises(DecodeError):
        wire.unpack(blob + b"\x00")


def _buffer_owner(arr: np.ndarray) -> Any:
    base: Any = arr
    while isinstance(base, np.ndarray):
        base = base.base
    return base.obj if isinstance(base, memoryview) else base


def test_unpack_never_copies_array_data_itself() -> None:
    image = np.zeros((1024, 1024, 3), dtype=np.uint8)  # big, top level, byte-aligned: the input itself
    blob = wire.pack(image)
    assert _buffer_owner(wire.unpack(blob)) is blob
    small = {"a": np.arange(4, dtype=np.float64)}  # nested: a view of the ext data msgpack hands over
    out = wire.unpack(wire.pack(small))["a"]
    assert not out.flags.owndata and isinstance(_buffer_owner(out), bytes)


def test_a_list_of_big_arrays_packs_in_one_copy_as_the_packer_would() -> None:
    """An Envelope's args (a list) holding big ndarrays is joined from the arrays in place (issue 13),
    to exactly the bytes of the general path."""
    from dreamlake.lakeshore.wire import codec

    a = np.arange(300_000, dtype=np.float64)
    f = np.ones((3, 2000, 200), dtype=np.int16, order="F")
    value = [a, 1, "x", f, [a[:3]]]
    fast = wire.pack(value)
    big, codec._BIG = codec._BIG, 1 << 62
    try:
        assert fast == wire.pack(value)
    finally:
        codec._BIG = big
    out = wire.unpack(fast)
    assert (out[0] == a).all() and (out[3] == f).all() and out[3].flags.f_contiguous and out[1:3] == [1, "x"]


def test_limits_for_widens_only_the_byte_bounds() -> None:
    assert wire.limits_for(b"x" * 10) is wire.DEFAULT_LIMITS
    big = wire.limits_for(memoryview(bytearray(200 * 1024 * 1024)))
    assert big.max_buffer_size == big.max_bin_len == big.max_ext_len == big.max_str_len == 200 * 1024 * 1024
    assert (big.max_array_len, big.max_map_len, big.max_depth) == (
        wire.DEFAULT_LIMITS.max_array_len,
        wire.DEFAULT_LIMITS.max_map_len,
        wire.DEFAULT_LIMITS.max_depth,
    )
