"""``python -m ember`` is the ``ember`` command."""

from ember.entrypoints.cli import run

run()
