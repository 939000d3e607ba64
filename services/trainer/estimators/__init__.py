"""Advantage estimators: small pure tensor functions, one module each."""
