"""The one test stack: real processes and waits shared by the integration, fault, security and bench suites.

- :mod:`tests.stack.wait`: :func:`until` / :func:`until_async` (wait on a condition, with a deadline
  and a message naming what was awaited), :func:`within` (the same, answering None at the deadline);
- :mod:`tests.stack.ports`: :func:`free_port`;
- :mod:`tests.stack.procs`: :func:`child_env` (the environment of the checkout's subprocesses),
  :func:`kill_group` (a process group, by its leader);
- :mod:`tests.stack.server`: :class:`Server`, ``lakeshore server`` as a subprocess;
- :mod:`tests.stack.nymph`: :class:`Nymph` / :class:`UserNymph`, ``nymph start`` as a subprocess;
- :mod:`tests.stack.producer`: the producer routes over HTTP (submit, await, status, stream);
- :mod:`tests.stack.fixtures`: the pytest plugin (``nymph_factory``, ``server``), loaded by
  ``tests/conftest.py``.

Every process a fixture starts runs in a session (process group) of its own, and the fixture kills
the group at teardown, so nothing a test started outlives it. No test module imports another test
module: what two test files share lives here, or in a non-test kit module beside them
(``tests/unit/test_test_layering.py`` holds the suite to that).
"""
