"""The process default plane: where ``.submit()``, ``SyncQueue`` and the handles send when nothing
names a plane. Its own small module (part of the entry bundle) so that ``decorator``, ``queue`` and
``handles`` all read it without importing one another."""

from __future__ import annotations

from dreamlake.lakeshore.errors import PlaneError

TYPE_CHECKING = False  # typing costs every invocation's start-up (see decorator.py)
if TYPE_CHECKING:
    from dreamlake.lakeshore.dispatch import Plane

__all__ = ["get_default_dispatch", "set_default_dispatch"]

_default_plane: Plane | None = None


def set_default_dispatch(plane: Plane | None) -> None:
    """Set (or clear, with ``None``) the plane ``.submit()`` and ``SyncQueue`` use by default."""
    global _default_plane
    _default_plane = plane


def get_default_dispatch() -> Plane:
    """The process default plane: the one set, else an ``HttpDispatch`` from ``LAKESHORE_URL`` /
    ``LAKESHORE_TOKEN`` or the config file (``dreamlake.lakeshore.settings``), made once;
    :class:`PlaneError` naming the fixes when there is none."""
    global _default_plane
    if _default_plane is None:
        from dreamlake.lakeshore.settings import default_plane

        _default_plane = default_plane()
    if _default_plane is None:
        raise PlaneError(
            "no dispatch plane: export LAKESHORE_URL and LAKESHORE_TOKEN (`lakeshore server` prints "
            "both), pass _dispatch=plane to submit(), give @dls.udf(dispatch=plane), "
            "or call dls.set_default_dispatch(plane) once at start-up "
            '(plane = Dispatch(":memory:") in process, or HttpDispatch(url, token))'
        )
    return _default_plane
