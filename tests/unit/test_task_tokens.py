"""Task tokens (server/task_tokens.py): minted under one key, refused when forged, expired or re-keyed."""

from __future__ import annotations

import base64
import hashlib
import hmac
import time

import msgpack
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


def test_a_token_is_signed_with_hmac_sha256_of_its_payload_so_every_replica_and_version_agrees() -> None:
    """The signature is the one docs/protocol.md names (HMAC-SHA256 of the payload under the
    shared key), whatever way this version computes it: a token minted by one replica (or the
    version before a rolling upgrade) verifies on every other, and a token signed so by hand is
    accepted, one signed under another key is not."""
    key = b"k" * 32
    inv = new_ulid()
    payload = msgpack.packb([1, inv, 2, "team-a", int(time.time()) + 600])

    def b64(data: bytes) -> str:
        return base64.urlsafe_b64encode(data).rstrip(b"=").decode()

    by_hand = f"{PREFIX}{b64(payload)}.{b64(hmac.new(key, payload, hashlib.sha256).digest())}"
    tokens = TaskTokens(key)
    principal = tokens.verify(by_hand)
    assert principal is not None and (principal.invocation_id, principal.attempt) == (inv, 2)
    minted = tokens.mint(inv, 2, "team-a", time.time() + 600)
    body, _, sig = minted[len(PREFIX) :].partition(".")
    raw = base64.urlsafe_b64decode(body + "=" * (-len(body) % 4))
    assert sig == b64(hmac.new(key, raw, hashlib.sha256).digest())
    assert TaskTokens(b"j" * 32).verify(by_hand) is None
