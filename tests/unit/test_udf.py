"""The function author's surface: @udf on plain and generator bodies, scope, run, Thunk."""

from __future__ import annotations

import gc
import sys

import pytest

import dreamlake.lakeshore as dls
from dreamlake.lakeshore import envelope, wire
from dreamlake.lakeshore.decorator import UDF, invocation_context
from dreamlake.lakeshore.default_dispatch import get_default_dispatch, set_default_dispatch
from dreamlake.lakeshore.errors import PlaneError, TransportError


@dls.udf
def add(a: int, b: int = 1) -> int:
    return a + b


@dls.udf(queue="gpu", priority=3, key="k-1", timeout_s=5, max_attempts=2, image="py:3.11")
def configured(x: int) -> int:
    return x


@dls.udf
def where_am_i() -> tuple[str | None, str, str | None]:
    return dls.run.id, dls.run.prefix, dls.run.name


@dls.udf
def scoped_body():
    yield dls.run.prefix, dls.run.name
    with dls.scope("inner"):
        yield dls.run.prefix, dls.run.name
        yield dls.run.prefix, dls.run.name


# -- L0: a generator body is a generator ---------------------------------------------------------


def test_seed004_l0_nothing_runs_until_pulled(capsys: pytest.CaptureFixture[str]) -> None:
    @dls.udf
    def frames(n: int):
        for i in range(n):
            print("rendering", i)
            yield {"frame": i, "px": i * i}

    it = frames(3)  # nothing has run yet
    assert capsys.readouterr().out == ""
    first = next(it)  # runs the body up to the first yield
    assert capsys.readouterr().out == "rendering 0\n"
    rest = list(it)  # pulls the remainder
    assert first == {"frame": 0, "px": 0}
    assert rest == [{"frame": 1, "px": 1}, {"frame": 2, "px": 4}]
    assert capsys.readouterr().out == "rendering 1\nrendering 2\n"


def test_generator_decided_at_decoration() -> None:
    assert scoped_body.is_generator
    assert not add.is_generator
    assert add(2) == 3  # a plain call is a plain call


def test_run_context_only_around_each_next() -> None:
    it = scoped_body()
    assert next(it) == ("", scoped_body.__qualname__)
    assert next(it) == ("inner", scoped_body.__qualname__)
    # the body is paused inside `with dls.scope("inner")`: none of it leaks to the consumer
    assert (dls.run.prefix, dls.run.name, dls.run.id) == ("", None, None)
    with dls.scope("consumer"):  # and a scope the consumer opens later does not reach in
        assert next(it) == ("inner", scoped_body.__qualname__)
        assert dls.run.prefix == "consumer"
    assert list(it) == []


def test_a_generator_dropped_inside_a_scope_closes_in_its_own_context(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    unraisable: list[sys.UnraisableHookArgs] = []
    monkeypatch.setattr(sys, "unraisablehook", unraisable.append)
    cleanup: list[str] = []

    @dls.udf
    def body():
        with dls.scope("inner"):
            try:
                yield 1
                yield 2
            finally:
                cleanup.append(dls.run.prefix)

    it = body()
    assert next(it) == 1
    del it  # dropped mid-iteration, paused inside the scope
    gc.collect()
    assert not unraisable, [str(u.exc_value) for u in unraisable]
    assert capsys.readouterr().err == ""
    assert cleanup == ["inner"]  # the body's own cleanup ran, in the body's context
    assert dls.run.prefix == ""


def test_generator_sees_scope_of_its_call() -> None:
    with dls.scope("scenes/0007"):
        it = scoped_body()
    assert list(it) == [
        ("scenes/0007", scoped_body.__qualname__),
        ("scenes/0007/inner", scoped_body.__qualname__),
        ("scenes/0007/inner", scoped_body.__qualname__),
    ]


def test_local_generator_is_two_way() -> None:
    @dls.udf
    def echo():
        got = yield "ready"
        while got is not None:
            got = yield got * 2

    g = echo()
    assert next(g) == "ready"
    assert g.send(4) == 8
    with pytest.raises(KeyError):
        g.throw(KeyError("x"))


# -- L2: stages as generators -----------------------------------------------------------------------


def test_seed004_l2_stages_pull_on_demand() -> None:
    loaded: list[str] = []

    @dls.udf
    def load(paths):
        for p in paths:
            loaded.append(p)
            yield {"path": p}

    @dls.udf
    def score(rows):
        for r in rows:
            yield {**r, "score": len(r["path"])}

    pipeline = score(load(["a/b.png", "c.png", "d/e/f.png"]))
    best = max(pipeline, key=lambda r: r["score"])
    assert best == {"path": "d/e/f.png", "score": 9}

    loaded.clear()
    first = next(score(load(["x.png", "never/loaded.png"])))
    assert first == {"path": "x.png", "score": 5}
    assert loaded == ["x.png"]  # "never/loaded.png" is never loaded


def test_seed004_l2_as_written() -> None:
    import dreamlake.lakeshore as dls

    @dls.udf
    def load(paths):
        for p in paths:
            yield {"path": p}

    @dls.udf
    def score(rows):
        for r in rows:
            yield {**r, "score": len(r["path"])}

    pipeline = score(load(["a/b.png", "c.png", "d/e/f.png"]))
    best = max(pipeline, key=lambda r: r["score"])

    first = next(score(load(["x.png", "never/loaded.png"])))

    assert best == {"path": "d/e/f.png", "score": 9}
    assert first == {"path": "x.png", "score": 5}


# -- L3: the plain-generator trampoline -------------------------------------------------------------


def test_seed004_l3_send_trampoline() -> None:
    def tuner():  # a plain generator, NOT a @dls.udf
        lr = 0.1
        while True:
            loss = yield lr  # value OUT, measurement IN
            if loss is None:
                return
            lr = lr * 0.5 if loss > 1.0 else lr * 1.1

    g = tuner()
    lr = next(g)  # prime: first suggestion
    seen = [lr]
    for loss in [2.0, 0.8, 0.5]:
        lr = g.send(loss)  # send the measurement, get the next lr
        seen.append(lr)
    g.close()
    assert seen == pytest.approx([0.1, 0.05, 0.055, 0.0605])


# -- scope and run --------------------------------------------------------------------------------


def test_scope_nests_by_joining_and_run_key_resolves() -> None:
    assert dls.run.key("out.png") == "out.png"
    with dls.scope("scenes") as outer:
        assert outer == "scenes"
        with dls.scope("/0007/") as full:
            assert full == "scenes/0007"
            assert dls.run.prefix == "scenes/0007"
            assert dls.run.key("frames/1.png") == "scenes/0007/frames/1.png"
        assert dls.run.prefix == "scenes"
    assert dls.run.prefix == ""


@pytest.mark.parametrize("bad", ["", "/", "a//b", "../up", "a/./b"])
def test_scope_and_key_refuse_bad_paths(bad: str) -> None:
    with pytest.raises(ValueError, match="scope prefix"), dls.scope(bad):
        pass
    with pytest.raises(ValueError, match="run key"):
        dls.run.key(bad)


def test_plain_local_call_sees_run_name_and_no_id() -> None:
    with dls.scope("s"):
        assert where_am_i() == (None, "s", where_am_i.__qualname__)
    assert dls.run.name is None


def test_plain_call_builds_no_envelope(monkeypatch: pytest.MonkeyPatch) -> None:
    def boom(*a: object, **k: object) -> None:
        raise AssertionError("a local call built an Envelope")

    monkeypatch.setattr(envelope.Envelope, "create", boom)
    monkeypatch.setattr(envelope, "fn_for", boom)
    assert add(1, b=5) == 6
    assert next(iter(scoped_body()))[1] == scoped_body.__qualname__


def test_invocation_context_sets_id_and_prefix() -> None:
    env = configured.thunk(1).to_envelope()
    env.prefix = "jobs/7"
    with invocation_context(env):
        assert dls.run.id == env.id
        assert dls.run.key("x") == "jobs/7/x"
    assert dls.run.id is None


def test_begin_and_end_invocation_set_and_reset_what_invocation_context_does() -> None:
    from dreamlake.lakeshore.scopes import begin_invocation, end_invocation

    env = configured.thunk(1).to_envelope()
    env.prefix = "jobs/7"
    with invocation_context(env) as state:
        expected = (dls.run.id, dls.run.prefix, dls.run.name)
    token = begin_invocation(env)
    try:
        assert (dls.run.id, dls.run.prefix, dls.run.name) == expected == tuple(state)
        assert type(state) is type(scopes_state())
    finally:
        end_invocation(token)
    assert (dls.run.id, dls.run.prefix, dls.run.name) == (None, "", None)


def scopes_state() -> object:
    from dreamlake.lakeshore import scopes

    return scopes._STATE.get()


# -- Thunk / Envelope -------------------------------------------------------------------------------


def test_thunk_builds_the_envelope_without_sending() -> None:
    with dls.scope("scenes/0007"):
        th = configured.thunk(41, _priority=9)
    env = th.to_envelope()
    assert env.fn == {
        "kind": "ref",
        "module": __name__,
        "qualname": "configured",
        "src_hash": env.fn["src_hash"],
    }
    assert env.fn["src_hash"].startswith("sha256:")
    assert wire.unpack(env.args) == [41]
    assert wire.unpack(env.kwargs) == {}
    assert (env.prefix, env.key, env.parent) == ("scenes/0007", "k-1", None)
    assert th.run_config() == {
        "queue": "gpu",
        "priority": 9.0,
        "key": "k-1",
        "prefix": "scenes/0007",
        "timeout_s": 5.0,
        "max_attempts": 2,
        "image": "py:3.11",
    }
    roundtrip = envelope.Envelope.from_bytes(env.to_bytes())
    assert roundtrip.id == env.id and roundtrip.prefix == "scenes/0007"
    assert th.to_envelope().id != env.id  # each envelope is a new invocation


def test_udf_wrapper_ships_by_ref_and_resolves_to_the_raw_function() -> None:
    fn = envelope.fn_for(add, "ref")
    assert fn["qualname"] == "add"
    resolved = envelope.resolve_fn(fn, allow_pickled=False)
    assert resolved is add.__lakeshore_fn__


def test_closure_under_ref_transport_is_refused_at_submit() -> None:
    @dls.udf(transport="ref")
    def local_fn() -> int:
        return 1

    with pytest.raises(TransportError, match="transport='pickle'"):
        local_fn.thunk().to_envelope()


def test_no_plane_gives_a_clear_error() -> None:
    set_default_dispatch(None)
    with pytest.raises(PlaneError, match="set_default_dispatch"):
        add.submit(1)
    with pytest.raises(PlaneError, match="_dispatch="):
        get_default_dispatch()


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"queue": ""}, "queue must be"),
        ({"transport": "zip"}, "unknown transport"),
        ({"priority": float("nan")}, "priority must be"),
        ({"priority": "high"}, "priority must be"),
        ({"key": ""}, "key"),
        ({"timeout_s": 0}, "timeout_s"),
        ({"max_attempts": 0}, "max_attempts"),
    ],
)
def test_bad_decorator_options_say_what_to_do(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        UDF(lambda: None, **kwargs)  # type: ignore[arg-type]


def test_decorator_keeps_function_metadata() -> None:
    assert add.__name__ == "add"
    assert add.__doc__ is None
    assert add.__wrapped__ is add.__lakeshore_fn__
    assert "add" in repr(add)


# -- the module is not named like the decorator ----------------------------------------------------


def test_importing_the_sdk_modules_never_rebinds_dls_udf() -> None:
    """``dls.udf`` stays the decorator whatever gets imported, in whatever order."""
    import importlib

    from dreamlake.lakeshore import decorator

    importlib.import_module("dreamlake.lakeshore.decorator")
    import dreamlake.lakeshore

    assert dreamlake.lakeshore.udf is decorator.udf
    assert dls.udf is decorator.udf

    @dls.udf(queue="q")
    def f() -> int:
        return 1

    assert isinstance(f, UDF) and f.queue == "q" and f() == 1


def test_fresh_interpreter_sees_the_decorator_and_the_entry_hook() -> None:
    import subprocess
    import sys

    from tests.conftest import ROOT

    code = (
        "import sys, types\n"
        "import dreamlake.lakeshore.decorator\n"
        "import dreamlake.lakeshore as dls\n"
        "assert isinstance(dls.udf, types.FunctionType), dls.udf\n"
        "assert not isinstance(dls.decorator.udf, types.ModuleType)\n"
        "hook = sys.modules['dreamlake.lakeshore.decorator'].invocation_context\n"
        "assert callable(hook)\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout == "ok\n"
