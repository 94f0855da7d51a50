"""``python -m ember`` is the ``ember`` command."""

import sys

from ember.entrypoints.cli import main

sys.exit(main())
