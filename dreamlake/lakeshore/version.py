"""The package's version, in a module of its own: modules inside the package read it from here, so
that none imports the package facade (``dreamlake/lakeshore/__init__.py``, which names them all)."""

__version__ = "0.1.0"
