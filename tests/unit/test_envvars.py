"""One integer-from-environment parser and one name for the inline threshold (dreamlake/lakeshore/envvars.py)."""

from __future__ import annotations

import pytest

from dreamlake.lakeshore import codeship, envvars
from dreamlake.lakeshore.dispatch.http import inline_threshold_from_env
from dreamlake.lakeshore.server.payloads import PayloadConfig


def test_unset_or_empty_is_the_default_and_a_whole_number_is_read() -> None:
    assert envvars.env_int("X_BYTES", 7, env={}) == 7
    assert envvars.env_int("X_BYTES", 7, env={"X_BYTES": "  "}) == 7
    assert envvars.env_int("X_BYTES", 7, env={"X_BYTES": " 12 "}) == 12


@pytest.mark.parametrize(("raw", "says"), [("12k", "is not a whole number"), ("-1", "is below 0")])
def test_a_bad_value_names_the_variable_and_the_fix(raw: str, says: str) -> None:
    with pytest.raises(ValueError, match=f"X_BYTES.*{says}.*unset it"):
        envvars.env_int("X_BYTES", 7, env={"X_BYTES": raw})


def test_the_inline_threshold_has_one_name_everywhere(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LAKESHORE_INLINE_THRESHOLD_BYTES", raising=False)
    monkeypatch.setenv("INLINE_THRESHOLD_BYTES", "1234")
    assert inline_threshold_from_env() == 1234  # HTTP submits
    assert codeship._threshold() == 1234  # code archives
    assert PayloadConfig.from_env({"INLINE_THRESHOLD_BYTES": "1234"}).inline_threshold_bytes == 1234


def test_the_old_name_is_a_deprecated_alias(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("INLINE_THRESHOLD_BYTES", raising=False)
    monkeypatch.setenv("LAKESHORE_INLINE_THRESHOLD_BYTES", "99")
    with pytest.warns(
        FutureWarning, match="LAKESHORE_INLINE_THRESHOLD_BYTES is deprecated: set INLINE_THRESHOLD_BYTES"
    ):
        assert codeship._threshold() == 99
    monkeypatch.setenv("INLINE_THRESHOLD_BYTES", "5")  # the name wins over the alias
    assert envvars.inline_threshold() == 5
