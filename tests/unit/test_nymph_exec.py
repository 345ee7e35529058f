"""The exec path's payload check: the seed's exact corruption message, and a matching digest passes."""

from __future__ import annotations

import hashlib

import pytest

from nymph.execjob import PayloadError, verify_sha256


def test_sha256_mismatch_raises_the_seeds_exact_message() -> None:
    data = b"payload bytes"
    got = hashlib.sha256(data).hexdigest()
    expected = "0" * 64
    with pytest.raises(PayloadError) as err:
        verify_sha256(data, expected)
    assert str(err.value) == f"payload corrupt: sha256 mismatch (expected {expected}, got {got})"


def test_matching_or_absent_sha256_passes() -> None:
    data = b"payload bytes"
    verify_sha256(data, hashlib.sha256(data).hexdigest())
    verify_sha256(data, None)
