"""The Envelope codec, function transport (ref | pickle) and the worker-side gates, in order."""

from __future__ import annotations

import hashlib
import os
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import cloudpickle
import msgpack
import pytest

from dreamlake.lakeshore import envelope as env
from dreamlake.lakeshore import envelope_reader, fn_gates, fn_record
from dreamlake.lakeshore.envelope import (
    INLINE_PICKLE_LIMIT,
    WIRE_VERSION,
    Envelope,
    check_runtime,
    fn_for,
    is_pickled,
    resolve_fn,
    src_hash,
)
from dreamlake.lakeshore.errors import (
    EnvelopeError,
    GateError,
    PickleRefused,
    RuntimeMismatch,
    StaleSource,
    TransportError,
    VersionError,
)
from dreamlake.lakeshore.ids import new_ulid
from tests import fixtures_fns as ff
from tests.conftest import ROOT

ARGS = msgpack.packb([1, 2])
KWARGS = msgpack.packb({"b": 3})


def _envelope(**over: Any) -> Envelope:
    fields: dict[str, Any] = {"id": new_ulid(), "fn": fn_for(ff.add), "args": ARGS, "kwargs": KWARGS}
    fields.update(over)
    return Envelope(**fields)


def _raw(**over: Any) -> bytes:
    body = msgpack.unpackb(_envelope().to_bytes())
    body.update(over)
    data: bytes = msgpack.packb(body, use_bin_type=True)
    return data


# --- the Envelope codec ----------------------------------------------------------------------------


def test_round_trip_keeps_every_field() -> None:
    e = _envelope(prefix="scenes/0007", key="k-1", cfg={"code": {"sha": "abc"}}, parent=new_ulid())
    back = Envelope.from_bytes(e.to_bytes())
    assert back == e
    assert back.v == WIRE_VERSION


def test_create_packs_args_and_kwargs_with_the_value_codec() -> None:
    e = Envelope.create(fn_for(ff.add), (1, (2, 3)), {"b": [4]}, prefix="p")
    back = Envelope.from_bytes(e.to_bytes())
    assert back.unpack_args() == ([1, (2, 3)], {"b": [4]})
    assert back.prefix == "p"


def test_envelope_is_a_plain_msgpack_map_with_bin_args() -> None:
    body = msgpack.unpackb(_envelope().to_bytes(), raw=False)
    assert list(body)[:9] == ["v", "id", "fn", "args", "kwargs", "prefix", "key", "cfg", "parent"]
    assert body["args"] == ARGS and isinstance(body["args"], bytes)


def test_header_skips_args_and_kwargs() -> None:
    e = _envelope(args=b"\xc1" * 1000, kwargs=b"\xc1", prefix="x")  # 0xc1 never decodes as msgpack
    header = Envelope.header(e.to_bytes())
    assert "args" not in header and "kwargs" not in header
    assert header["id"] == e.id and header["fn"] == e.fn and header["prefix"] == "x"


def test_newer_version_is_refused_with_the_fix() -> None:
    data = _raw(v=WIRE_VERSION + 1)
    with pytest.raises(VersionError, match="upgrade dreamlake-lakeshore"):
        Envelope.from_bytes(data)
    with pytest.raises(VersionError):
        Envelope.header(data)


def test_unknown_cfg_and_top_level_keys_pass_through() -> None:
    data = _raw(cfg={"code": {"url": "s3://x"}, "future": [1, 2]}, shiny={"new": True})
    back = Envelope.from_bytes(data)
    assert back.cfg["future"] == [1, 2]
    assert back.extra == {"shiny": {"new": True}}
    assert msgpack.unpackb(back.to_bytes()) == msgpack.unpackb(data)
    assert Envelope.header(data)["shiny"] == {"new": True}


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (b"\x93\x01\x02\x03", "msgpack map"),
        (b"", "truncated"),
        (msgpack.packb({"v": 1}), "envelope id"),
        (None, "bytes"),
    ],
)
def test_garbage_is_an_envelope_error(data: Any, message: str) -> None:
    with pytest.raises(EnvelopeError, match=message):
        Envelope.from_bytes(data)


@pytest.mark.parametrize(
    ("over", "message"),
    [
        ({"args": [1, 2]}, "'args' must be bin"),
        ({"fn": {"kind": "exec"}}, "'ref' or 'pickle'"),
        ({"fn": {"kind": "ref", "module": "m"}}, "'qualname' must be str"),
        ({"cfg": []}, "'cfg' must be dict"),
        ({"prefix": 7}, "'prefix' must be str"),
        ({"v": "1"}, "positive int"),
        ({"id": "../../etc"}, "ULID"),
    ],
)
def test_bad_fields_are_named(over: dict[str, Any], message: str) -> None:
    with pytest.raises(EnvelopeError, match=message):
        Envelope.from_bytes(_raw(**over))


def test_a_nil_prefix_means_no_prefix() -> None:
    # a peer with no scope may send "prefix": nil (or leave it out): both read as "", no prefix
    for data in (
        _raw(prefix=None),
        msgpack.packb({k: v for k, v in msgpack.unpackb(_raw()).items() if k != "prefix"}),
    ):
        assert Envelope.from_bytes(data).prefix == ""
        assert Envelope.header(data)["prefix"] == ""


@pytest.mark.parametrize("transport", ["ref", "pickle"])
def test_mutated_envelopes_only_raise_envelope_error(transport: str) -> None:
    # Envelopes arrive from the network: flipped bits, cuts and insertions never escape as another error.
    fn = fn_for(ff.add, transport=transport)
    base = Envelope.create(fn, [1, (2, 3)], {"b": 4}, prefix="p", key="k", cfg={"code": {"x": 1}}).to_bytes()
    rng = random.Random(transport)
    for _ in range(2000):
        data = bytearray(base)
        for _ in range(rng.randrange(1, 4)):
            i = rng.randrange(len(data))
            op = rng.randrange(3)
            if op == 0:
                data[i] ^= 1 << rng.randrange(8)
            elif op == 1:
                del data[max(i, 1) :]
            else:
                data[i:i] = rng.randbytes(rng.randrange(1, 5))
        for decode in (Envelope.from_bytes, Envelope.header):
            try:
                decode(bytes(data))
            except EnvelopeError:
                pass


def _decoded(decode: Any, data: bytes) -> Any:
    try:
        out = decode(data)
    except EnvelopeError as exc:
        return ("error", str(exc))
    return out.to_bytes() if isinstance(out, Envelope) else out


def test_a_small_envelope_read_in_one_decode_reads_as_the_field_by_field_reader(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # an Envelope of at most 64 KiB is decoded at once; a bigger one field by field (its arguments
    # skipped by their headers): both readers give the same fields, or the same kind of error
    fn = fn_for(ff.add, transport="ref")
    base = Envelope.create(fn, [1, (2, 3)], {"b": 4}, prefix="p", key="k", cfg={"code": {"x": 1}}).to_bytes()
    rng = random.Random(7)
    cases = [base, _raw(), b"", b"\x93\x01\x02\x03", base + b"\x00", base[:-3], msgpack.packb({1: 2})]
    for _ in range(500):
        data = bytearray(base)
        i = rng.randrange(len(data))
        data[i] ^= 1 << rng.randrange(8)
        cases.append(bytes(data))
    small = [(_decoded(Envelope.from_bytes, c), _decoded(Envelope.header, c)) for c in cases]
    monkeypatch.setattr(
        envelope_reader, "_WINDOW", 64
    )  # each of these is "big" now: the field-by-field reader
    big = [(_decoded(Envelope.from_bytes, c), _decoded(Envelope.header, c)) for c in cases]
    for case, a, b in zip(cases, small, big, strict=True):
        assert a == b, case
    assert "args" not in small[0][1] and Envelope.from_bytes(base).unpack_args() == ([1, (2, 3)], {"b": 4})


def test_trailing_bytes_are_refused() -> None:
    with pytest.raises(EnvelopeError, match="trailing"):
        Envelope.from_bytes(_envelope().to_bytes() + b"\x00")


# --- transport: auto / ref / pickle ------------------------------------------------------------------


def _defined_in_main() -> Any:
    ns: dict[str, Any] = {"__name__": "__main__"}
    exec("def main_fn(x):\n    return x + 1\n", ns)
    return ns["main_fn"]


@pytest.mark.parametrize(
    ("make", "why"),
    [
        (lambda: ff.square, "lambda"),
        (lambda: ff.make_closure(2), "<locals>"),
        (_defined_in_main, "__main__"),
        (lambda: ff.adder, "callable instance"),
        (lambda: ff.adder.__call__, "bound to a Adder instance"),
    ],
    ids=["lambda", "closure", "main", "instance", "bound-method"],
)
def test_auto_pickles_exactly_what_is_not_importable(make: Any, why: str) -> None:
    obj = make()
    assert fn_for(obj)["kind"] == "pickle"
    with pytest.raises(TransportError, match=why) as info:
        fn_for(obj, transport="ref")
    assert "transport='pickle'" in str(info.value)


@pytest.mark.parametrize("obj", [ff.add, ff.count, ff.Ns.triple, len, ff.Adder])
def test_auto_ships_importable_callables_by_ref(obj: Any) -> None:
    record = fn_for(obj)
    assert record["kind"] == "ref"
    assert resolve_fn(record, allow_pickled=False) is obj


def test_ref_record_fields() -> None:
    record = fn_for(ff.add)
    source = Path(ff.__file__).read_text()
    start = source.index("def add(")
    body = source[start : source.index("\n\n\n", start)] + "\n"
    assert record == {
        "kind": "ref",
        "module": "tests.fixtures_fns",
        "qualname": "add",
        "src_hash": "sha256:" + hashlib.sha256(body.encode()).hexdigest()[:16],
    }
    assert fn_for(len)["src_hash"] is None  # no source for a builtin


def test_pickle_record_fields() -> None:
    record = fn_for(ff.add, transport="pickle")
    assert is_pickled(record) and not is_pickled(fn_for(ff.add))
    assert record["hash"] == "sha256:" + hashlib.sha256(record["blob"]).hexdigest()
    assert record["qualname"] == "add"
    assert record["where"] == f"add ({ff.__file__}:{ff.add.__code__.co_firstlineno})"
    assert record["source"].startswith("def add(")
    runtime = record["runtime"]
    assert runtime["python"] == ".".join(map(str, sys.version_info[:3]))
    assert runtime["impl"] == sys.implementation.name
    assert runtime["cloudpickle"] == cloudpickle.__version__
    assert runtime["pickle_protocol"] == cloudpickle.DEFAULT_PROTOCOL
    assert runtime["platform"].startswith(sys.platform + "-")


def test_pickled_lambda_runs_after_resolve() -> None:
    f = resolve_fn(fn_for(ff.make_closure(7)), allow_pickled=True)
    assert f(6) == 42


def test_sdk_wrapper_ships_by_ref_and_unwraps_on_the_worker() -> None:
    record = fn_for(ff.wrapped_add)
    assert record["kind"] == "ref"
    assert (record["module"], record["qualname"]) == ("tests.fixtures_fns", "wrapped_add")
    assert record["src_hash"] == src_hash(ff.wrapped_add.__lakeshore_fn__)
    f = resolve_fn(record, allow_pickled=False)
    assert f(2, 3) == 5  # the wrapper itself would raise


def test_over_limit_pickle_says_captured_state() -> None:
    data = os.urandom(INLINE_PICKLE_LIMIT + 1024)
    heavy = lambda: len(data)  # noqa: E731
    with pytest.raises(TransportError, match="captured state") as info:
        fn_for(heavy)
    assert "as arguments" in str(info.value)


def test_unknown_transport_is_refused() -> None:
    with pytest.raises(TransportError, match="'auto', 'ref' or 'pickle'"):
        fn_for(ff.add, transport="bytecode")


def test_importing_envelope_does_not_import_cloudpickle() -> None:
    code = "import sys, dreamlake.lakeshore.envelope; print('cloudpickle' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


# --- the gates, in order ------------------------------------------------------------------------------


def _marker_record(**runtime: Any) -> dict[str, Any]:
    record = fn_for(ff.add, transport="pickle")
    blob = cloudpickle.dumps(ff.UnpickleMarker())
    record.update(blob=blob, hash="sha256:" + hashlib.sha256(blob).hexdigest())
    record["runtime"] = {**record["runtime"], **runtime}
    return record


@pytest.fixture(autouse=True)
def _clear_unpickled() -> None:
    ff.UNPICKLED.clear()


def test_gate1_pickle_refused_by_default_before_anything_else() -> None:
    record = _marker_record(python="2.7.18")  # would also fail gate 2
    with pytest.raises(PickleRefused, match="--allow-pickled") as info:
        resolve_fn(record, allow_pickled=False)
    assert "trusts the submitter" in str(info.value)
    assert ff.UNPICKLED == []


def test_gate2_runtime_is_checked_before_unpickle() -> None:
    record = _marker_record(python="2.7.18")
    record["hash"] = "sha256:" + "0" * 64  # a bad hash too: the runtime gate answers first
    with pytest.raises(RuntimeMismatch, match=r"2\.7\.18"):
        resolve_fn(record, allow_pickled=True)
    assert ff.UNPICKLED == []


def test_gate2_blob_hash_is_verified_before_unpickle() -> None:
    record = _marker_record()
    record["hash"] = "sha256:" + "0" * 64
    with pytest.raises(EnvelopeError, match="does not match"):
        resolve_fn(record, allow_pickled=True)
    assert ff.UNPICKLED == []
    resolve_fn(_marker_record(), allow_pickled=True)
    assert ff.UNPICKLED == ["unpickled"]


def _runtime(python: str | None = None, cp: str | None = None) -> dict[str, Any]:
    mine = ".".join(map(str, sys.version_info[:3]))
    return {
        "python": python or mine,
        "impl": sys.implementation.name,
        "cloudpickle": cp or cloudpickle.__version__,
    }


def _bump(version: str, index: int) -> str:
    parts = [int(p) for p in version.split(".")[:3]]
    parts[index] += 1
    return ".".join(map(str, parts))


MY_PY = ".".join(map(str, sys.version_info[:3]))
MY_CP = cloudpickle.__version__


@pytest.mark.parametrize(
    ("runtime", "strict", "minor"),
    [
        (_runtime(), True, True),
        (_runtime(python=_bump(MY_PY, 2)), False, True),
        (_runtime(python=_bump(MY_PY, 1)), False, False),
        (_runtime(cp=_bump(MY_CP, 1)), False, True),
        (_runtime(cp=_bump(MY_CP, 0)), False, False),
        ({**_runtime(), "impl": "pypy"}, False, False),
    ],
    ids=["same", "micro", "minor", "cp-minor", "cp-major", "impl"],
)
def test_runtime_policies(runtime: dict[str, Any], strict: bool, minor: bool) -> None:
    for policy, ok in (("strict", strict), ("minor", minor)):
        if ok:
            check_runtime(runtime, policy)
        else:
            with pytest.raises(RuntimeMismatch, match=f"policy '{policy}'"):
                check_runtime(runtime, policy)
    check_runtime(runtime, "off")
    check_runtime({}, "off")


def test_runtime_policy_default_is_minor() -> None:
    with pytest.raises(RuntimeMismatch, match="policy 'minor'"):
        check_runtime(_runtime(python=_bump(MY_PY, 1)))


def test_unknown_runtime_policy_is_refused() -> None:
    with pytest.raises(ValueError, match="'strict', 'minor' or 'off'"):
        resolve_fn(fn_for(ff.add), allow_pickled=False, runtime_policy="lax")


STALE = "sha256:" + "0" * 16


def test_gate3_stale_source_fails_loud() -> None:
    record = {**fn_for(ff.add), "src_hash": STALE}
    with pytest.raises(StaleSource, match="different code") as info:
        resolve_fn(record, allow_pickled=False)
    assert isinstance(info.value, GateError)


def test_gate3_hashes_a_loaded_functions_source_once_and_refuses_every_stale_call(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A long-lived worker runs the same function again and again: a source that matched the
    submitter's hash is not sliced and hashed again, and a stale hash is refused (and read) on
    every call."""

    fn_record._MATCHED.clear()
    fn_gates._RESOLVED.clear()  # a worker that has resolved nothing yet
    sliced: list[Any] = []
    real = fn_record._sliced_source

    def counting(fn: Any) -> Any:
        sliced.append(fn)
        return real(fn)

    monkeypatch.setattr(fn_record, "_sliced_source", counting)
    record = fn_for(ff.add)
    assert record["src_hash"]
    for _ in range(3):
        assert resolve_fn(record, allow_pickled=False)(2, 3) == 5
    assert len(sliced) == 1
    for _ in range(2):  # a mismatch is read again each time (the file may have been fixed)
        with pytest.raises(StaleSource, match="different code"):
            resolve_fn({**record, "src_hash": STALE}, allow_pickled=False)
    assert len(sliced) == 3
    fn_record._MATCHED.clear()


def test_a_submitters_source_hash_is_made_once_and_follows_an_edit_of_its_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every submit of a function by reference carries its source hash: it is read and hashed
    once while the file stays as it was, and hashed again from the edited file (what ships)."""
    import importlib
    import inspect

    mod = tmp_path / "edited_fns.py"
    mod.write_text("def f(x):\n    return x + 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    fn = importlib.import_module("edited_fns").f
    read: list[Any] = []
    real = inspect.getsource
    monkeypatch.setattr(inspect, "getsource", lambda obj: read.append(obj) or real(obj))

    def sha(text: str) -> str:
        return "sha256:" + hashlib.sha256(text.encode()).hexdigest()[:16]

    for _ in range(3):
        assert fn_for(fn)["src_hash"] == sha("def f(x):\n    return x + 1\n")
    assert len(read) == 1
    mod.write_text("def f(x):\n    return x + 2  # edited\n")
    assert fn_for(fn)["src_hash"] == sha("def f(x):\n    return x + 2  # edited\n")
    assert len(read) == 2


@pytest.mark.parametrize(
    ("record", "policy"),
    [
        ({"kind": "ref", "module": "tests.fixtures_fns", "qualname": "add"}, "minor"),  # no hash sent
        ({"kind": "ref", "module": "tests.fixtures_fns", "qualname": "add", "src_hash": None}, "strict"),
        ({"kind": "ref", "module": "builtins", "qualname": "len", "src_hash": STALE}, "strict"),  # no source
        ({"kind": "ref", "module": "tests.fixtures_fns", "qualname": "add", "src_hash": STALE}, "off"),
    ],
    ids=["no-hash", "null-hash", "source-unavailable", "policy-off"],
)
def test_gate3_skips(record: dict[str, Any], policy: str) -> None:
    assert callable(resolve_fn(record, allow_pickled=False, runtime_policy=policy))


def test_unimportable_ref_says_what_to_do() -> None:
    with pytest.raises(EnvelopeError, match="PYTHONPATH"):
        resolve_fn({"kind": "ref", "module": "no_such_mod_xyz", "qualname": "f"}, allow_pickled=False)
    with pytest.raises(EnvelopeError, match="no attribute 'nope'"):
        resolve_fn({"kind": "ref", "module": "tests.fixtures_fns", "qualname": "nope"}, allow_pickled=False)


def test_module_level_names_are_exported() -> None:
    assert env.INLINE_PICKLE_LIMIT == 32 * 1024
    assert env.WIRE_VERSION == 1


# -- big Envelopes (issue 13): parts, headers and decodes that do not copy the arguments ------------


def _big_envelope(n: int) -> Envelope:
    return Envelope.create(
        {"kind": "ref", "module": "m", "qualname": "f"}, [b"x" * n], {"k": 1}, cfg={"a": [1]}
    )


@pytest.mark.parametrize("n", [0, 200, 300, 70_000, 2_000_000])
def test_to_parts_joins_to_the_packed_bytes(n: int) -> None:
    env = _big_envelope(n)
    parts = env.to_parts()
    assert b"".join(parts) == env.to_bytes() == msgpack.packb(env._body(), use_bin_type=True)
    assert any(p is env.args for p in parts)  # the arguments themselves, not a copy


def test_header_and_decode_read_a_memoryview_in_place(tmp_path: Any) -> None:
    import mmap

    env = _big_envelope(3_000_000)
    path = tmp_path / "args.msgpack"
    path.write_bytes(env.to_bytes())
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        view = memoryview(mm)
        assert Envelope.header(view)["id"] == env.id
        assert Envelope.from_bytes(view) == env
        view.release()  # nothing kept a view of the map: it closes
    with pytest.raises(EnvelopeError, match="truncated"):
        Envelope.header(memoryview(env.to_bytes())[:-10])
    with pytest.raises(EnvelopeError, match="trailing"):
        Envelope.from_bytes(env.to_bytes() + b"\x00")


@pytest.mark.parametrize("n", [0, 200, 70_000, 2_000_000])
def test_pieces_join_to_the_packed_bytes_and_keep_big_arguments_uncopied(n: int) -> None:
    env = _big_envelope(n)
    pieces = env.pieces()
    assert b"".join(pieces) == env.to_bytes()
    if n >= 1 << 20:
        assert any(p is env.args for p in pieces)  # streamed to the payload store in place
    else:
        assert len(pieces) == 1  # a small one in one msgpack call
