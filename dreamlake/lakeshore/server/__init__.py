"""The control plane: ``lakeshore server``.

A Starlette app (``server.app.create_app``) over the one store (``dreamlake.lakeshore.store``):
msgpack routes for producers and daemons, JSON routes for namespace exec jobs, bearer-token auth,
long polls woken by an in-process hub, payload presign and live frame fan-out. Importing this
package imports nothing heavy; import the submodules you need.
"""
