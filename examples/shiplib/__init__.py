"""A user's own package, next to the script that uses it: never installed, never deployed to a
worker. ``examples/06_ship_code.py`` submits its functions; the SDK ships this directory with
each call (``@dls.udf``'s default ``code="auto"``) and nymph runs it from its code cache."""
