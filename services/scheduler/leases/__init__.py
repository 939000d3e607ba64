"""The GPU lease ledger in Redis: leases, their history, draining and usage."""
