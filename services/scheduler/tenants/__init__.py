"""Tenants, users, credentials and quotas: who may do what, and how much."""
