"""Task tokens (server/task_tokens.py): minted under one key, refused when forged, expired or re-keyed."""

from __future__ import annotations

import pytest

from dreamlake.lakeshore.ids import new_ulid
from dreamlake.lakeshore.server.task_tokens import PREFIX, TaskTokens

KEY = b"k" * 32


def test_a_minted_token_verifies_to_its_invocation() -> None:
    inv = new_ulid()
    token = TaskTokens(KEY).mint(inv, 2, "team-a", expires_at=2000.0)
    assert token.startswith(PREFIX)
    p = TaskTokens(KEY).verify(token, now=1999.0)
    assert p is not None
    assert (p.kind, p.invocation_id, p.attempt, p.namespace) == ("task", inv, 2, "team-a")


def test_forged_expired_and_foreign_tokens_are_nobody() -> None:
    signer = TaskTokens(KEY)
    token = signer.mint(new_ulid(), 1, "default", expires_at=2000.0)
    assert signer.verify(token, now=2000.0) is None  # expired
    assert TaskTokens(b"x" * 32).verify(token, now=1.0) is None  # another key
    body, _, sig = token.partition(".")
    assert signer.verify(body + "." + sig[:-2] + "AA", now=1.0) is None  # tampered signature
    other = signer.mint(new_ulid(), 9, "admin-ns", expires_at=2000.0)
    assert signer.verify(other.partition(".")[0] + "." + sig, now=1.0) is None  # spliced payload
    for junk in ("", PREFIX, PREFIX + "!!.??", "lsk_" + token[4:], token + "x"):
        assert signer.verify(junk, now=1.0) is None


def test_a_short_key_is_refused() -> None:
    with pytest.raises(ValueError, match="32 bytes"):
        TaskTokens(b"short")
