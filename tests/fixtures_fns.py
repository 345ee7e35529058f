"""Functions that tests ship by reference; subprocesses import this module (PYTHONPATH = repo root)."""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Generator, Iterator
from typing import Any


def add(a: int, b: int = 0) -> int:
    return a + b


def noop() -> None:
    return None


def count(n: int) -> Generator[int, None, str]:
    for i in range(n):
        yield i * i
    return "done"


def boom(message: str = "kaboom") -> None:
    raise ValueError(message)


def gen_boom(n: int) -> Iterator[int]:
    yield from range(n)
    raise RuntimeError("mid-stream failure")


def returns_iterator(n: int) -> Iterator[int]:
    """Not a generator function, but returns one: the entry drains it as a stream all the same."""
    return count(n)


def env_value(name: str) -> str | None:
    return os.environ.get(name)


def cwd() -> str:
    return os.getcwd()


class Adder:
    """A callable instance: no __qualname__ of its own, so ``auto`` pickles it."""

    def __init__(self, k: int) -> None:
        self.k = k

    def __call__(self, x: int) -> int:
        return x + self.k


adder = Adder(10)


class Ns:
    @staticmethod
    def triple(x: int) -> int:
        return 3 * x


def make_closure(k: int) -> Callable[[int], int]:
    def inner(x: int) -> int:
        return x * k

    return inner


square = lambda x: x * x  # noqa: E731


class Wrapper:
    """Stands in for the SDK's @udf wrapper: the module attribute is this object, not the function."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        functools.update_wrapper(self, fn)
        self.__lakeshore_fn__ = fn

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise AssertionError("the worker must unwrap to __lakeshore_fn__, not call the wrapper")


@Wrapper
def wrapped_add(a: int, b: int) -> int:
    return a + b


UNPICKLED: list[str] = []


def _record_unpickle(tag: str) -> Callable[[], None]:
    UNPICKLED.append(tag)
    return noop


class UnpickleMarker:
    """Unpickling this object appends to UNPICKLED: proves whether a gate ran before unpickle."""

    def __reduce__(self) -> tuple[Any, ...]:
        return (_record_unpickle, ("unpickled",))


def yield_then_wait(flag: str) -> Iterator[str]:
    """Yields once, then waits (up to 30 s) for ``flag`` to exist: lets a test tail the journal live."""
    import time

    yield "first"
    deadline = time.monotonic() + 30
    while not os.path.exists(flag) and time.monotonic() < deadline:
        time.sleep(0.01)
    yield "second"


async def async_add(a: int, b: int = 0) -> int:
    import asyncio

    await asyncio.sleep(0)
    return a + b


async def async_boom(message: str = "async kaboom") -> None:
    import asyncio

    await asyncio.sleep(0)
    raise ValueError(message)


async def async_count(n: int) -> Any:
    import asyncio

    for i in range(n):
        await asyncio.sleep(0)
        yield i * i
