"""Functions with big arguments and results, written as a user writes them
(tests/integration/test_payload_refs.py). No dreamlake here: containers use the entry bundle's."""

from __future__ import annotations

import hashlib

import dreamlake.lakeshore as dls


@dls.udf
def echo(data):
    """The argument back, with its digest as the worker saw it."""
    return {"sha256": hashlib.sha256(data).hexdigest(), "data": data}


@dls.udf
def digest(data):
    return hashlib.sha256(data).hexdigest()


@dls.udf
def sized(n):
    return b"r" * n


@dls.udf
def big_frames(n, size):
    for i in range(n):
        yield bytes([65 + i]) * size
    return "done"


@dls.udf
def array_total(a):
    """A numpy array argument (the zero-copy path): its sum and shape."""
    return {"sum": float(a.sum()), "shape": list(a.shape), "dtype": str(a.dtype)}
