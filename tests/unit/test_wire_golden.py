"""Golden vectors: the exact bytes of every built-in ext code, so a wire change shows up in review.

``tests/golden/wire_vectors.json`` lists ``{"name", "code", "value", "hex"}``; ``value`` is a Python
expression (evaluated with ``np``, ``Image``, ``dt``, ``decimal``, ``uuid``, ``pathlib`` in scope).
A vector with ``"needs": "torch"`` imports torch (in the test extra; a regen without it keeps its
bytes); ``"decode_only": true`` marks bytes this platform cannot produce (a Windows path),
checked by unpacking only.
To change the wire on purpose, or to add a vector (give it ``"hex": ""``), regenerate and commit
the diff::

    .venv/bin/python tests/unit/test_wire_golden.py --regen
"""

from __future__ import annotations

import datetime as dt
import decimal
import importlib
import json
import pathlib
import sys
import uuid
from typing import Any

import msgpack
import numpy as np
import pytest
from PIL import Image

from dreamlake.lakeshore import wire

VECTORS = pathlib.Path(__file__).resolve().parent.parent / "golden" / "wire_vectors.json"
SCOPE = {
    "np": np,
    "Image": Image,
    "dt": dt,
    "decimal": decimal,
    "uuid": uuid,
    "pathlib": pathlib,
    "msgpack": msgpack,
}


def build(vector: dict[str, Any]) -> Any:
    scope = dict(SCOPE)
    if vector.get("needs"):  # in the test extra: a missing one fails the test, never skips it
        scope[vector["needs"]] = importlib.import_module(vector["needs"])
    return eval(vector["value"], scope)  # trusted: the file is in this repository


def load() -> list[dict[str, Any]]:
    return list(json.loads(VECTORS.read_text()))


def equal(a: Any, b: Any) -> bool:
    if isinstance(a, np.ndarray):
        return (
            type(b) is np.ndarray and a.dtype == b.dtype and a.shape == b.shape and bool(np.array_equal(a, b))
        )
    if type(a).__module__.startswith("torch"):
        return type(b) is type(a) and a.dtype == b.dtype and bool((a == b).all())
    if isinstance(a, Image.Image):
        return (a.mode, a.size, a.tobytes(), a.getpalette()) == (b.mode, b.size, b.tobytes(), b.getpalette())
    return type(a) is type(b) and bool(a == b)


@pytest.mark.parametrize("vector", load(), ids=lambda v: v["name"])
def test_golden_bytes(vector: dict[str, Any]) -> None:
    value = build(vector)
    expected = bytes.fromhex(vector["hex"])
    if not vector.get("decode_only"):
        assert wire.pack(value).hex() == expected.hex(), "wire bytes changed; see this file's docstring"
    assert equal(wire.unpack(expected), value)


def test_every_builtin_code_has_a_vector() -> None:
    codes = {v["code"] for v in load()}
    assert set(range(1, 20)) <= codes


def test_vector_codes_are_the_outer_ext_codes() -> None:
    for v in load():
        if v["code"]:
            obj = msgpack.unpackb(bytes.fromhex(v["hex"]), strict_map_key=False)
            assert isinstance(obj, msgpack.ExtType) and obj.code == v["code"], v["name"]


def regen() -> None:
    vectors = load()
    for v in vectors:
        if v.get("decode_only"):
            continue
        try:
            v["hex"] = wire.pack(build(v)).hex()
        except ImportError:
            print(f"kept {v['name']}: {v['needs']} is not installed")
    VECTORS.write_text(json.dumps(vectors, indent=1) + "\n")
    print(f"wrote {len(vectors)} vectors to {VECTORS}")


if __name__ == "__main__":
    if sys.argv[1:] != ["--regen"]:
        sys.exit("usage: test_wire_golden.py --regen")
    regen()
