"""Alembic environment for the store: runs on the connection ``open_store`` hands over.

There is no alembic.ini: ``engine.migrate`` builds the Config in code and passes an open
connection in ``config.attributes["connection"]``. For ``alembic revision --autogenerate`` by hand,
pass ``-x url=sqlite:///scratch.db``.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import context

from dreamlake.lakeshore.store.schema import metadata

config = context.config


def run() -> None:
    conn = config.attributes.get("connection")
    if conn is None:
        url = context.get_x_argument(as_dictionary=True).get("url")
        if not url:
            raise SystemExit(
                "pass -x url=<database url> (or run through dreamlake.lakeshore.store.open_store)"
            )
        engine = sa.create_engine(url)
        with engine.begin() as own:
            context.configure(connection=own, target_metadata=metadata, render_as_batch=True)
            context.run_migrations()
        return
    context.configure(connection=conn, target_metadata=metadata, render_as_batch=True)
    with context.begin_transaction():
        context.run_migrations()


run()
