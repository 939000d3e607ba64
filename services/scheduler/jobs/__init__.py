"""Jobs: their store, queue, life cycle, attempts, events and progress."""
