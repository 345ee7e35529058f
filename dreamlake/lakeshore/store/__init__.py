"""The store: invocations, the frame journal, leases, tokens and exec jobs, over SQLite or PostgreSQL."""
