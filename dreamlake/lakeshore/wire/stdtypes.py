"""The built-in codecs of standard-library types (ext codes 5..19 of :mod:`dreamlake.lakeshore.wire`).

``tuple`` / ``set`` / ``frozenset`` (5..7: their items as a nested wire list, a set's sorted where
its items sort), ``complex`` (8), ``datetime`` / ``date`` / ``time`` (9..11: ISO text, keeping a
sub-second UTC offset), ``timedelta`` (12), ``uuid.UUID`` (13), ``decimal.Decimal`` (14), the
``pathlib`` classes (15..18) and ints beyond 64 bits (19). The registry (:mod:`.codec`) registers
the first ones at import (:func:`builtin_codecs`, given its own pack and unpack for the nested
items: this module imports nothing of it) and the uuid / decimal / pathlib ones on first use, so
the entry does not import those modules at start-up. Runs on Python >= 3.9 (the entry bundle).
"""

from __future__ import annotations

import datetime as _dt
import os
import struct

from dreamlake.lakeshore.errors import DecodeError

from .base import Codec

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Any

_COMPLEX = struct.Struct("<dd")


def sorted_if_possible(items: set[Any] | frozenset[Any]) -> list[Any]:
    try:
        return sorted(items)
    except TypeError:
        return list(items)


def int_encode(i: int) -> bytes:
    return int(i).to_bytes((int(i).bit_length() + 8) // 8, "big", signed=True)


def _int_decode(data: bytes) -> int:
    if not data:
        raise ValueError("empty big-int")
    return int.from_bytes(data, "big", signed=True)


def _iso_decode(cls: Any, data: bytes) -> Any:
    """``cls.fromisoformat`` that keeps a sub-second UTC offset (CPython 3.11 silently drops it)."""
    text = data.decode("ascii")
    value = cls.fromisoformat(text)
    sign_at = max(text.rfind("+"), text.rfind("-"))
    offset = text[sign_at + 1 :] if sign_at > text.find(":") - 3 else ""
    if "." in offset and value.tzinfo is not None:
        hh, mm, rest = offset.split(":")
        ss, us = rest.split(".")
        delta = _dt.timedelta(
            hours=int(hh), minutes=int(mm), seconds=int(ss), microseconds=int(us.ljust(6, "0"))
        )
        value = value.replace(tzinfo=_dt.timezone(-delta if text[sign_at] == "-" else delta))
    return value


def builtin_codecs(pack_items: Callable[[list[Any]], bytes], unpack: Callable[[bytes], Any]) -> list[Codec]:
    """The codecs registered at import (codes 5..12); ``pack_items`` / ``unpack``: the registry's
    own, for the nested items of a tuple, set, frozenset or timedelta."""

    def _nested(data: bytes) -> list[Any]:
        items = unpack(data)
        if type(items) is not list:
            raise DecodeError(f"expected a msgpack array inside the ext value, got {type(items).__name__}")
        return items

    def _td_decode(data: bytes) -> _dt.timedelta:
        days, seconds, micros = unpack(data)
        if not all(type(x) is int for x in (days, seconds, micros)):
            raise ValueError("timedelta fields must be ints")
        return _dt.timedelta(days=days, seconds=seconds, microseconds=micros)

    return [
        Codec(5, tuple, lambda t: pack_items(list(t)), lambda b: tuple(_nested(b)), "tuple"),
        Codec(6, set, lambda s: pack_items(sorted_if_possible(s)), lambda b: set(_nested(b)), "set"),
        Codec(
            7,
            frozenset,
            lambda s: pack_items(sorted_if_possible(s)),
            lambda b: frozenset(_nested(b)),
            "frozenset",
        ),
        Codec(
            8,
            complex,
            lambda c: _COMPLEX.pack(c.real, c.imag),
            lambda b: complex(*_COMPLEX.unpack(b)),
            "complex",
        ),
        Codec(
            9,
            _dt.datetime,
            lambda d: d.isoformat().encode(),
            lambda b: _iso_decode(_dt.datetime, b),
            "datetime",
        ),
        Codec(
            10,
            _dt.date,
            lambda d: d.isoformat().encode(),
            lambda b: _dt.date.fromisoformat(b.decode("ascii")),
            "date",
        ),
        Codec(
            11,
            _dt.time,
            lambda d: d.isoformat().encode(),
            lambda b: _iso_decode(_dt.time, b),
            "time",
        ),
        Codec(
            12,
            _dt.timedelta,
            lambda d: pack_items([d.days, d.seconds, d.microseconds]),
            _td_decode,
            "timedelta",
        ),
    ]


# Only ints beyond 64 bits reach the codec (msgpack packs the rest); the type slot is int's own.
BIGINT = Codec(19, int, int_encode, _int_decode, "bigint")


def uuid_codecs() -> list[Codec]:
    import uuid

    return [Codec(13, uuid.UUID, lambda u: u.bytes, lambda b: uuid.UUID(bytes=b), "uuid")]


def decimal_codecs() -> list[Codec]:
    import decimal

    def decode(data: bytes) -> decimal.Decimal:
        text = data.decode("ascii")
        with decimal.localcontext() as ctx:
            ctx.traps[decimal.InvalidOperation] = True
            return decimal.Decimal(text)

    return [Codec(14, decimal.Decimal, lambda d: str(d).encode(), decode, "decimal")]


def pathlib_codecs() -> list[Codec]:
    import pathlib

    def path_bytes(p: pathlib.PurePath) -> bytes:
        return str(p).encode("utf-8", "surrogateescape")

    def decoder(cls: type[pathlib.PurePath]) -> Callable[[bytes], pathlib.PurePath]:
        def decode(data: bytes) -> pathlib.PurePath:
            return cls(data.decode("utf-8", "surrogateescape"))

        return decode

    posix_cls: type[pathlib.PurePath] = pathlib.PurePosixPath if os.name == "nt" else pathlib.Path
    windows_cls: type[pathlib.PurePath] = pathlib.Path if os.name == "nt" else pathlib.PureWindowsPath
    return [
        Codec(15, pathlib.PurePosixPath, path_bytes, decoder(pathlib.PurePosixPath), "pure-posix-path"),
        Codec(16, pathlib.PureWindowsPath, path_bytes, decoder(pathlib.PureWindowsPath), "pure-windows-path"),
        Codec(17, pathlib.PosixPath, path_bytes, decoder(posix_cls), "posix-path"),
        Codec(18, pathlib.WindowsPath, path_bytes, decoder(windows_cls), "windows-path"),
    ]
