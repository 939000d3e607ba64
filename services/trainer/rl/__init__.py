"""The managed RL loop: collect, advantages, update, sync, validate, report."""
