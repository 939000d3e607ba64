"""Supervised fine-tuning: chat data -> token batches -> weighted cross entropy."""
