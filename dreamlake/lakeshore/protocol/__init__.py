"""The client side of the control plane's protocol, in one place (docs/protocol.md).

* :mod:`~dreamlake.lakeshore.protocol.routes` -- every route path a client calls;
* :mod:`~dreamlake.lakeshore.protocol.shapes` -- their bodies and answers, typed;
* :mod:`~dreamlake.lakeshore.protocol.limits` -- what the control plane allows
  (:class:`ServerLimits`, from its register answer or ``GET /v1/ops/info``) and the one
  by-reference rule (:func:`by_reference`);
* :mod:`~dreamlake.lakeshore.protocol.daemon` -- :class:`DaemonClient`, a worker's routes
  (nymph, ``lakeshore worker``);
* :mod:`~dreamlake.lakeshore.protocol.producer` -- :class:`ProducerClient`, a producer's routes
  (``HttpDispatch``).

This package itself imports neither httpx nor the two clients: ``routes`` and ``limits`` are
light, and the clients load with :mod:`dreamlake.lakeshore.client`. Part of the entry bundle
(Python >= 3.9). The server's side of the same routes is ``server/authz.py``'s table.
"""
