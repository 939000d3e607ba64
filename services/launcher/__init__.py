"""Start the single-node mesh as plain processes: Redis, scheduler, envhub, a worker agent."""
