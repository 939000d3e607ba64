"""The web dashboard: server-rendered pages over the scheduler's API, called with the
signed-in user's own API key (so a user sees only their tenant's jobs)."""
