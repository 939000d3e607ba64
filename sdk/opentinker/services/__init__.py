"""Server-side code: each subpackage is built from ``services/<name>/`` in the repository.

Importing these needs the ``server`` extra (torch, transformers, redis, ...).
"""
