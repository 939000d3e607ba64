"""``python -m opentinker`` is the ``opentinker`` command."""

from opentinker.cli import main

main()
