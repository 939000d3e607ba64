"""The agent loop: episodes played turn by turn, their records, seeds and scheduling."""
