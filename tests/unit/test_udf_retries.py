"""``@dls.udf``'s retry policy travels in run_config as the control plane reads it (issue 12)."""

from __future__ import annotations

import pytest

import dreamlake.lakeshore as dls


def test_retry_on_backoff_and_resumable_ride_in_run_config() -> None:
    @dls.udf(max_attempts=3, retry_on=(TimeoutError, "Timeout"), backoff_s=2, resumable=True)
    def fetch(url: str) -> str:
        return url

    cfg = fetch.thunk("x").run_config()
    assert cfg["max_attempts"] == 3
    assert cfg["retry_on"] == ["TimeoutError", "Timeout"]  # names: the worker reports type names
    assert cfg["backoff_s"] == 2.0 and cfg["resumable"] is True
    plain = dls.udf(lambda: None).thunk().run_config()
    assert "retry_on" not in plain and "resumable" not in plain


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"retry_on": (42,)}, "exception classes or their names"),
        ({"backoff_s": -1}, "backoff_s"),
        ({"backoff_s": True}, "backoff_s"),
    ],
)
def test_a_bad_retry_policy_says_what_to_write(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        dls.udf(**kwargs)(lambda: None)
