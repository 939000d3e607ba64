"""The Tinker-compatible HTTP gateway: the official ``tinker`` SDK, unchanged, against the mesh."""
