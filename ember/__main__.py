"""``python -m ember`` is the ``ember`` command."""

from ember.entrypoints.console import run

run()
