"""ULIDs are the durable handles and become paths: they must sort by time and be validated strictly."""

from __future__ import annotations

import os
import time

import pytest

from dreamlake.lakeshore import ids
from dreamlake.lakeshore.errors import InvalidId


def test_new_ulids_are_valid_unique_and_sorted() -> None:
    made = [ids.new_ulid() for _ in range(2000)]
    assert all(ids.is_ulid(u) for u in made)
    assert len(set(made)) == len(made)
    assert made == sorted(made)  # monotonic within a process, even within one millisecond


def test_ulid_encodes_its_creation_time() -> None:
    before = time.time_ns() // 1_000_000
    u = ids.new_ulid()
    after = time.time_ns() // 1_000_000
    assert before <= ids.ulid_time_ms(u) <= after


@pytest.mark.parametrize(
    "bad",
    [
        "",
        "../../etc/passwd",
        "01hx2k3m4n5p6q7r8s9t0v1w2x",  # lower case is not canonical
        "01HX2K3M4N5P6Q7R8S9T0V1W2",  # 25 chars
        "01HX2K3M4N5P6Q7R8S9T0V1W2XY",  # 27 chars
        "81HX2K3M4N5P6Q7R8S9T0V1W2X",  # first char > 7 overflows 128 bits
        "01HX2K3M4N5P6Q7R8S9T0V1W2I",  # I is not Crockford
        None,
        42,
        b"01HX2K3M4N5P6Q7R8S9T0V1W2X",
    ],
)
def test_validate_refuses_anything_but_a_canonical_ulid(bad: object) -> None:
    with pytest.raises(InvalidId, match="expected a 26-character ULID"):
        ids.validate(bad, "invocation id")


def test_validate_returns_a_valid_id_unchanged() -> None:
    assert ids.validate("01HX2K3M4N5P6Q7R8S9T0V1W2X") == "01HX2K3M4N5P6Q7R8S9T0V1W2X"


def test_validate_names_what_was_invalid() -> None:
    with pytest.raises(InvalidId, match=r"invalid invocation id '\.\./x'"):
        ids.validate("../x", "invocation id")


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_makes_ids_of_its_own() -> None:
    """Parent and child, right after a fork, make different ids: the child does not go on with the
    parent's random pool or last id (prefork runners and uvicorn's workers fork)."""
    ids.new_ulid()  # the parent's pool and sequence are in use
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child
        os.close(r)
        os.write(w, "\n".join(ids.new_ulid() for _ in range(50)).encode())
        os._exit(0)
    os.close(w)
    mine = [ids.new_ulid() for _ in range(50)]
    with os.fdopen(r) as f:
        theirs = f.read().split("\n")
    os.waitpid(pid, 0)
    assert len(theirs) == 50 and all(ids.is_ulid(u) for u in theirs)
    assert not set(mine) & set(theirs)
    assert not {u[10:] for u in mine} & {u[10:] for u in theirs}  # nor the same random parts
