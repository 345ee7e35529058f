"""Runner plugins: a third-party distribution registers runners, broken ones are reported, not fatal.

The fake distribution is real: a ``fakeplug-0.1.dist-info`` with ``entry_points.txt`` on a
temporary ``sys.path`` entry, found by importlib.metadata exactly as an installed wheel would be.
"""

from __future__ import annotations

import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from nymph.plugins import RunnerInfo, RunnerLoadError, available_runners, list_runners, load_runner
from nymph.runner import Capabilities, Runner

MODULE = """
from nymph.runner import Capabilities, RunnerUnavailable


class FakeRunner:
    name = "fake"
    capabilities = Capabilities(gpus=True)

    def check(self): pass
    def start(self, task): raise NotImplementedError
    def wait(self, handle, timeout=None): return None
    def stop(self, handle, grace_s): pass
    def destroy(self, handle): pass
    def inspect(self, handle): return "gone"
    def recover(self, handle): return False


class DownRunner(FakeRunner):
    name = "down"

    def check(self):
        raise RunnerUnavailable("the fake engine is not running: start it")


class CrashRunner(FakeRunner):
    name = "crash"

    def check(self):
        raise ZeroDivisionError("boom")


class Shapeless:
    name = "shapeless"
    capabilities = Capabilities()

    def check(self): pass


class Misnamed(FakeRunner):
    name = "other"


class Boaster(FakeRunner):
    name = "boaster"
    capabilities = Capabilities(list_labelled=True)


class Shy(FakeRunner):
    name = "shy"

    def list_labelled(self, worker_id=None): return []


class Closing(FakeRunner):
    name = "closing"
    closed = 0

    def close(self):
        type(self).closed += 1


def make_runner():
    return FakeRunner()
"""

ENTRY_POINTS = """
[nymph.runners]
fake = fakeplug_ok:FakeRunner
down = fakeplug_ok:DownRunner
crash = fakeplug_ok:CrashRunner
broken = fakeplug_broken:Runner
shapeless = fakeplug_ok:Shapeless
misnamed = fakeplug_ok:Misnamed
notclass = fakeplug_ok:make_runner
boaster = fakeplug_ok:Boaster
shy = fakeplug_ok:Shy
closing = fakeplug_ok:Closing
engine = fakeplug_deep:Runner

[console_scripts]
unrelated = fakeplug_ok:make_runner
"""


@pytest.fixture(scope="module")
def fakeplug(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    root = tmp_path_factory.mktemp("site")
    (root / "fakeplug_ok.py").write_text(MODULE)
    (root / "fakeplug_broken.py").write_text("import fakeplug_dependency_that_is_not_installed\n")
    (root / "fakeplug_deep.py").write_text("import fakeplug_transitive_dependency\n")  # (not a Requires-Dist)
    info = root / "fakeplug-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: fakeplug\nVersion: 0.1\nProvides-Extra: engine\n"
        'Requires-Dist: fakeplug_dependency_that_is_not_installed; extra == "engine"\n'
    )
    (info / "entry_points.txt").write_text(textwrap.dedent(ENTRY_POINTS))
    sys.path.insert(0, str(root))
    try:
        yield root
    finally:
        sys.path.remove(str(root))
        for mod in ("fakeplug_ok", "fakeplug_broken", "fakeplug_deep"):
            sys.modules.pop(mod, None)


def by_name(infos: list[RunnerInfo]) -> dict[str, RunnerInfo]:
    return {i.name: i for i in infos}


def test_third_party_runner_loads_by_name(fakeplug: Path) -> None:
    cls = load_runner("fake")
    assert cls.__name__ == "FakeRunner"
    assert cls.capabilities == Capabilities(gpus=True)
    assert "fake" in available_runners()
    assert "unrelated" not in available_runners()  # other groups are not runners


def test_unknown_name_lists_the_available_runners(fakeplug: Path) -> None:
    with pytest.raises(RunnerLoadError) as err:
        load_runner("nosuch")
    msg = str(err.value)
    assert "'nosuch'" in msg
    assert "available:" in msg
    assert "fake" in msg and "broken" in msg


def test_import_error_names_plugin_distribution_and_problem(fakeplug: Path) -> None:
    with pytest.raises(RunnerLoadError) as err:
        load_runner("broken")
    msg = str(err.value)
    assert "'broken'" in msg
    assert "fakeplug 0.1" in msg
    assert "fakeplug_broken:Runner" in msg
    assert "fakeplug_dependency_that_is_not_installed" in msg
    # the missing module is a requirement of an extra: the message names the pip command
    assert "install it: pip install 'fakeplug[engine]'" in msg


def test_a_missing_dependency_of_a_dependency_names_the_runners_extra(fakeplug: Path) -> None:
    """kubernetes needs urllib3: a kube runner without it said `pip install urllib3`, where the
    runner's own extra is what brings everything it needs."""
    with pytest.raises(RunnerLoadError) as err:
        load_runner("engine")
    msg = str(err.value)
    assert "fakeplug_transitive_dependency" in msg
    assert "pip install 'fakeplug[engine]'" in msg and "pip install fakeplug_transitive" not in msg


@pytest.mark.parametrize(
    ("name", "problem"),
    [
        ("shapeless", "lacks the Runner method(s) start, wait, stop, destroy, inspect, recover"),
        ("notclass", "not a class"),
        ("misnamed", "declares name 'other' but is registered as 'misnamed'"),
        ("boaster", "declares capabilities.list_labelled but has no list_labelled() method"),
    ],
)
def test_wrong_shape_is_refused_at_load(fakeplug: Path, name: str, problem: str) -> None:
    with pytest.raises(RunnerLoadError) as err:
        load_runner(name)
    assert problem in str(err.value)
    assert "fakeplug 0.1" in str(err.value)


def test_list_reports_every_plugin_and_never_raises(fakeplug: Path) -> None:
    infos = by_name(list_runners())

    fake = infos["fake"]
    assert fake.usable and fake.problem is None
    assert (fake.value, fake.distribution, fake.version) == ("fakeplug_ok:FakeRunner", "fakeplug", "0.1")

    for name in ("broken", "shapeless", "notclass", "misnamed", "down", "crash"):
        assert not infos[name].usable, name
        assert infos[name].problem, name
        assert infos[name].distribution == "fakeplug"
    assert "the fake engine is not running" in (infos["down"].problem or "")
    assert "ZeroDivisionError" in (infos["crash"].problem or "")
    assert "fakeplug_dependency_that_is_not_installed" in (infos["broken"].problem or "")


def test_a_broken_plugin_does_not_stop_a_good_one(fakeplug: Path) -> None:
    with pytest.raises(RunnerLoadError):
        load_runner("broken")
    assert load_runner("fake").name == "fake"


def test_project_runners_are_registered() -> None:
    # The project's own runners are entry points like any third party's.
    assert {"process", "docker", "gvisor"} <= set(available_runners())


def test_a_runner_without_close_loads_with_a_no_op_close(fakeplug: Path) -> None:
    import fakeplug_ok  # type: ignore[import-not-found]

    cls = load_runner("fake")  # written before close() joined the protocol
    assert issubclass(cls, fakeplug_ok.FakeRunner) and cls.__name__ == "FakeRunner"
    runner = cls()
    assert runner.close() is None and isinstance(runner, Runner)
    closing = load_runner("closing")
    assert closing is fakeplug_ok.Closing  # its own close() is kept, the class untouched
    closing().close()
    assert fakeplug_ok.Closing.closed == 1


def test_a_feature_method_without_its_capability_is_loaded_with_a_warning(
    fakeplug: Path, caplog: pytest.LogCaptureFixture
) -> None:
    cls = load_runner("shy")
    assert not cls.capabilities.list_labelled  # nymph reads features from capabilities only
    assert "has list_labelled() but its capabilities do not declare list_labelled=True" in caplog.text
