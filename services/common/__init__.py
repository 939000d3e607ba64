"""Pieces every service uses: gRPC server construction, error mapping, logging, settings."""
